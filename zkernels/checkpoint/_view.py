"""The one place that knows how a ``ZeroOptimizer`` keeps its state: the checkpoint's view.

[Note: the checkpoint adapter]
Everything else in ``zkernels.checkpoint`` (file format, manifest, atomic publish, resharded
reads, consolidation) speaks only in terms of this module's objects: named parameters with
their full shape, and *pieces*: a contiguous element range ``[start, end)`` of one flattened
parameter held by this rank, with 1-D fp32 tensors for its master values and both AdamW
moments. Any way of sharding (flat units with their shard states today, stage 3's
sharded parameters, state offloaded to host RAM or NVMe later) is a new body for
:meth:`OptimizerView.pieces` and :meth:`OptimizerView.finish_load`, nothing more.

Contract of :meth:`pieces`: a piece's tensors are valid until the generator advances (an
offloaded state may stage them in and write them back between pieces); the saver only reads
them, the loader only writes them. Pieces of one rank never overlap, and over all ranks the
pieces of a parameter tile ``[0, numel)`` exactly (the saver checks it).

This body reads the optimizer only through the declared view, ``CheckpointSource`` and
``CheckpointUnit`` in ``zkernels/zero/checkpoint_view.py`` ([Note: the declared checkpoint
view]): the flat parameter units (``opt.units``), each mapping every element of this rank's
shard to ``(name, start in the parameter)`` (``param_slices_in_shard``), and each unit's
state (``opt.zero_units[u.index]``, its ``ZeroUnit``: ``read_state`` gives its step and
[shard_numel] fp32 master and moments). Loading writes into those tensors, then hands each
unit's back (``write_state``: the unit rewrites its compute shard from the master, in the
compute dtype; its own tensors are passed, so nothing is copied twice) and ``publish``es the
units (stages 1-2: all-gather the full buffer; stage 3: drop a stale gathered copy, the next
gather reads the new shards).
Buffers, and frozen parameters at stages 1-2 (whole on every rank), come from
``opt.module``'s ``state_dict()``.

[Note: frozen pieces]
At stage 3 frozen parameters are sharded (``opt.frozen_units``, [Note: frozen parameters at
stage 3] in ``zkernels/zero/parameters/units.py``): each rank saves the pieces of them it holds, like a
trainable parameter's but with its values only (field "master", in the dtype the shard keeps:
the parameter's own, or ``param_dtype``) and no moments; the manifest lists them under
``params`` with ``"frozen": true``, and their ``state_dict`` keys as kind "param". So they
are written from the shards, read into the shards at any world size, and consolidated into
the full tensor by the code that does it for trainable ones. A load reads a rank's frozen
pieces from whichever form the checkpoint holds: such pieces, a whole tensor saved at
stages 1-2 (kind "frozen"), or a then-trainable parameter's master; a frozen-pieces
parameter loaded at stages 1-2 fills the whole tensor (``load._load_model_tensors``).

[Note: a torch class's pieces]
A group running a ``torch.optim`` class (issue 26) saves, per piece, the field "master" and
one field per element-wise state key of its class (``momentum_buffer``, ``sum``, ...: the
keys ``read_rule_state`` gives), and the piece's 0-dim state (``step``, NAdam's
``mu_product``, ...) as numbers under "scalars"; the manifest names each group's optimizer
("optimizer", only where it is not the fused AdamW, whose checkpoints stay as they were).
Loading reads the saved fields into zeroed flat buffers of the unit's shard at any world
size, gives every piece its parameter's saved scalars (the pieces of a parameter agree) and
hands the unit back with ``write_rule_state``. One optimizer's checkpoint into another is
refused by name (``load.check_compatible``). The fused Lion and SGD give their pieces the
same way (``exp_avg``, ``momentum_buffer``, ``step``); Muon's and Adafactor's owners send each
rank its pieces of their state, every tensor broadcast to the parameter's shape, and gather
them back on load ([Note: whole matrices on owners] in ``zkernels/zero/state/matrix_rule.py``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from ..zero.checkpoint_view import CheckpointSource
from ._lowbit import describe, field_specs

FIELDS = ("master", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class ParamInfo:
    """A trainable parameter as the checkpoint names it.

    Attributes:
        name: its first name in ``module.named_parameters()`` (tied aliases map to it).
        shape: its full shape.
        group: index of its param group.
    """

    name: str
    shape: Tuple[int, ...]
    group: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class FrozenInfo:
    """A frozen parameter sharded at stage 3 (see [Note: frozen pieces]).

    Attributes:
        name: its first name in ``module.named_parameters()``.
        shape: its full shape.
        dtype: the dtype its shards keep (and the checkpoint stores).
    """

    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype


@dataclass
class FrozenPiece:
    """Elements ``[start, end)`` of the flattened frozen parameter ``name`` held by this
    rank: ``tensor`` is a writable view of its shard."""

    name: str
    start: int
    end: int
    tensor: torch.Tensor


@dataclass
class ShardPiece:
    """Elements ``[start, end)`` of the flattened parameter ``name`` held by this rank.

    Attributes:
        tensors: ``{field: [end - start] fp32 tensor}`` for each of ``FIELDS``; writable views
            of the optimizer's own storage (valid until the next piece is requested).
        step: AdamW steps applied to these elements.
        scalars: a torch class's 0-dim state of the piece (``step``, ...) by key (the loader
            fills it); empty for the fused AdamW.
    """

    name: str
    start: int
    end: int
    step: int
    tensors: Dict[str, torch.Tensor]
    scalars: Dict[str, float] = None
    state_format: Optional[dict] = None   # saved as trained: [Note: low-bit moments in a
                                          # checkpoint] in _lowbit.py


@dataclass(frozen=True)
class ModelEntry:
    """One key of ``module.state_dict()``.

    Attributes:
        key: the state_dict key.
        kind: ``"param"`` (a trainable parameter: its value is the master; or a frozen one
            sharded at stage 3: its pieces, see [Note: frozen pieces]), ``"frozen"`` (a whole
            parameter with requires_grad=False), ``"buffer"`` or ``"alias"`` (the same
            tensor as an earlier key, e.g. tied weights).
        of: for ``"param"``, the parameter's name; for ``"alias"``, the earlier key.
        tensor: the tensor itself (for ``"frozen"`` and ``"buffer"``).
    """

    key: str
    kind: str
    of: Optional[str] = None
    tensor: Optional[torch.Tensor] = None


class OptimizerView:
    """What ``save``/``load`` read from and write into a ``ZeroOptimizer`` (see
    [Note: the checkpoint adapter]).

    Args:
        opt: a ``zkernels.ZeroOptimizer``.
    """

    def __init__(self, opt) -> None:
        if not isinstance(opt, CheckpointSource):
            raise TypeError(f"opt must be a zkernels.ZeroOptimizer, got {type(opt).__name__}")
        if not isinstance(opt.module, torch.nn.Module):
            raise TypeError("opt has no module: zkernels.checkpoint needs the ZeroOptimizer "
                            "the model was built with (opt.module)")
        self.opt = opt
        # Each group's optimizer ([Note: a torch class's pieces]).
        self.optimizers: List[str] = list(opt.optimizer_names)
        self._rule: Dict[int, tuple] = {}   # unit index -> (step, master, flat, scalars)
        self.module = opt.module
        # overlap_param_gather: the last step's all-gathers write the full buffers (of which
        # the fp32 masters are views) until waited for; save and load read and write them.
        opt.wait_params()
        # (step, (master, exp_avg, exp_avg_sq)) per unit index, through the optimizer: the
        # live tensors on the device or in host RAM; for NVMe offload, copies read from its
        # files (held here until finish_load writes them back, so an NVMe save or load holds
        # the rank's state in host RAM for its duration).
        self._staged: Dict[int, Tuple[int, Tuple[torch.Tensor, ...]]] = {}
        # id(param) -> canonical name (its first name in named_parameters(), as units.py).
        self._names: Dict[int, str] = {id(p): n for n, p in self.module.named_parameters()}
        unit_params: Dict[str, ParamInfo] = {}
        for u in opt.units:
            for name, shape in zip(u.names, u.shapes):
                unit_params[name] = ParamInfo(name, tuple(shape), u.group_index)
        # Registration order, the order state_dict() and the consolidated export use.
        self.params: Dict[str, ParamInfo] = {n: unit_params[n] for n in
                                             dict(self.module.named_parameters())
                                             if n in unit_params}
        self.group_names: List[List[str]] = [[self._names[id(p)] for p in g["params"]]
                                             for g in opt.param_groups]
        # Stage 3's frozen parameters, sharded (see [Note: frozen pieces]).
        self.frozen_units = list(opt.frozen_units)
        frozen: Dict[str, FrozenInfo] = {}
        for u in self.frozen_units:
            for name, shape in zip(u.names, u.shapes):
                frozen[name] = FrozenInfo(name, tuple(shape), u.compute_dtype)
        self.frozen: Dict[str, FrozenInfo] = {n: frozen[n] for n in
                                              dict(self.module.named_parameters())
                                              if n in frozen}
        self.comm = opt.checkpoint_comm
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        # Hybrid sharding: rank and world_size above are within the shard group (they name
        # the shard files); every replica holds the same shards, so only the first replica
        # writes them, each shard once. ``everyone`` (all N ranks) agrees on each phase and
        # its rank 0 leads (see zkernels/comm/hybrid.py).
        self.everyone = opt.checkpoint_world
        self.writes_shards = opt.replica_rank == 0
        self.leads = self.everyone.rank == 0
        self.device = opt.units[0].device
        self._steps: Dict[int, List[int]] = {}
        # Low-bit moments ([Note: low-bit moments in a checkpoint] in _lowbit.py): each
        # parameter's format here, the saved tensors of the pieces loaded in the same format
        # ((name, start) -> raw), and the conversions a load made (saved, here).
        self.formats: Dict[str, Optional[dict]] = {
            name: opt.zero_units[u.index].state_format for u in opt.units for name in u.names}
        self._raw: Dict[Tuple[str, int], Dict[str, torch.Tensor]] = {}
        self.converted: set = set()

    def describe(self) -> Dict[str, object]:
        """How this optimizer runs (recorded in the manifest, for people)."""
        return {"world_size": self.world_size, "stage": self.opt.stage,
                "param_dtype": str(self.opt.param_dtype).replace("torch.", ""),
                "offload": self.opt.offload}

    def piece_ranges(self) -> List[Tuple[str, int, int, int, Tuple[str, ...]]]:
        """``(name, start, end, step, fields)`` of every piece :meth:`pieces` yields, in that
        order, without touching the tensors (the saver lays out its file from this first)."""
        out = []
        for u in self.opt.units:
            fields = FIELDS if self._fused(u) else ("master",) + tuple(self._rule_of(u)[2])
            if self._fused(u) and self.opt.zero_units[u.index].state_format is not None:
                fields = None   # low-bit: by piece (the scales' count follows its range)
            steps = self._param_steps(u)
            out += [(name, a, a + n, steps[name], fields or tuple(
                        f for f, _, _ in field_specs(self.formats[name], a, a + n)))
                    for name, a, _, n in u.param_slices_in_shard()]
        return out

    def field_specs(self, name: str, start: int, end: int, fields: Tuple[str, ...]):
        """``[(field, dtype, numel)]`` of a piece :meth:`pieces` yields with ``as_trained``."""
        if fields == FIELDS or self.formats.get(name) is not None:
            return field_specs(self.formats.get(name), start, end)
        return [(f, torch.float32, end - start) for f in fields]

    def keep_lowbit(self, piece: ShardPiece, saved: Optional[dict],
                    raw: Optional[Dict[str, torch.Tensor]]) -> None:
        """Loading: ``piece``'s moments were saved in format ``saved`` (None: fp32; ``raw``
        its saved tensors): kept to restore bit for bit where this run has the same format,
        else the conversion is noted (:attr:`converted`)."""
        here = self.formats.get(piece.name)
        if here is not None and saved == here:
            self._raw[(piece.name, piece.start)] = raw
        elif saved != here:
            self.converted.add((describe(saved), describe(here)))

    def _param_steps(self, u) -> Dict[str, int]:
        """Each parameter's step count ([Note: unused parameters]): as :meth:`set_steps` gave
        it, else the optimizer's (a torch class's unit: its unit count, the class keeps each
        piece's own ``step`` among the piece's scalars)."""
        z = self.opt.zero_units[u.index]
        if self._fused(u):
            return dict(zip(u.names, self._steps.get(u.index) or z.param_steps))
        return {n: self._rule_step(u, z.state_step) for n in u.names}

    def _rule_step(self, u, step: int) -> int:
        given = self._steps.get(u.index)
        return max(given, default=0) if given else step

    def _fused(self, unit) -> bool:
        return self.optimizers[unit.group_index] == "adamw"

    def _rule_of(self, unit, fields: Optional[Dict[str, Tuple[str, ...]]] = None):
        """A torch class's unit, staged: ``(step, master, {key: [shard_numel] flat}, [per
        piece scalars])`` (see [Note: a torch class's pieces]); loading (``fields``: each
        parameter's saved fields) flat buffers of zeros for the saved keys."""
        if unit.index not in self._rule:
            step, master, states = self.opt.zero_units[unit.index].read_rule_state()
            flat: Dict[str, torch.Tensor] = {}
            scalars = []
            slices = list(unit.param_slices_in_shard())
            if fields is not None:
                keys = {f for name, _, _, _ in slices for f in fields.get(name, ())} - \
                    {"master"}
                flat = {k: torch.zeros_like(master) for k in sorted(keys)}
                scalars = [{} for _ in slices]
            else:
                for (_, _, s, n), st in zip(slices, states):
                    sc = {}
                    for k, t in st.items():
                        if isinstance(t, torch.Tensor) and t.dim() > 0:
                            flat.setdefault(k, torch.zeros_like(master))[s:s + n] = \
                                t.reshape(-1)
                        else:
                            sc[k] = float(t)
                    scalars.append(sc)
            self._rule[unit.index] = (step, master, flat, scalars)
        return self._rule[unit.index]

    def pieces(self, fields: Optional[Dict[str, Tuple[str, ...]]] = None,
               as_trained: bool = False) -> Iterator[ShardPiece]:
        """Every piece of this rank; ``fields`` (loading): each parameter's saved fields, for
        a torch class's units (its state keys come from the checkpoint); ``as_trained``
        (saving): low-bit moments as the optimizer keeps them (codes and the piece's block
        scales, or bf16), else fp32 (dequantized copies)."""
        for u in self.opt.units:
            if not self._fused(u):
                step, master, flat, scalars = self._rule_of(u, fields)
                step = self._rule_step(u, step)
                for (name, a, s, n), sc in zip(u.param_slices_in_shard(), scalars):
                    yield ShardPiece(name, a, a + n, step,
                                     {"master": master[s:s + n],
                                      **{k: t[s:s + n] for k, t in flat.items()}}, sc)
                continue
            _, tensors = self._state(u)
            steps = self._param_steps(u)
            # (``own``, not ``fields``: the argument is read again by the next rule unit's
            # pieces; rebinding it lost their saved keys after a fused unit)
            own = dict(zip(FIELDS, tensors))
            z = self.opt.zero_units[u.index]
            desc = z.state_format if as_trained else None
            low = z.read_lowbit_state() if desc is not None else None
            for name, a, s, n in u.param_slices_in_shard():
                if low is None:
                    yield ShardPiece(name, a, a + n, steps[name],
                                     {f: t[s:s + n] for f, t in own.items()})
                    continue
                bs = desc["block_size"]
                yield ShardPiece(name, a, a + n, steps[name], {
                    "master": own["master"][s:s + n],
                    **{k: t[s:s + n] if not k.endswith("_scales") else
                       t[s // bs:-(-(s + n) // bs)] for k, t in low.items()}},
                    state_format=desc)

    def frozen_piece_ranges(self) -> List[Tuple[str, int, int, torch.dtype]]:
        """``(name, start, end, dtype)`` of every piece :meth:`frozen_pieces` yields."""
        return [(name, a, a + n, u.compute_dtype) for u in self.frozen_units
                for name, a, _, n in u.param_slices_in_shard()]

    def frozen_pieces(self, write: bool = False) -> Iterator[FrozenPiece]:
        """This rank's pieces of the sharded frozen parameters, views of the shards (of a host
        copy where a shard is on disk): the saver reads them; the loader (``write``) writes
        them, and a unit's copy is written back before the next unit's pieces come."""
        for u in self.frozen_units:
            with u.shard_values(write_back=write) as shard:
                for name, a, s, n in u.param_slices_in_shard():
                    yield FrozenPiece(name, a, a + n, shard[s:s + n])

    def _state(self, unit):
        """``(step, tensors)`` of ``unit``: the step :meth:`set_steps` gave it, if any."""
        if unit.index not in self._staged:
            self._staged[unit.index] = self.opt.zero_units[unit.index].read_state()
        step, tensors = self._staged[unit.index]
        given = self._steps.get(unit.index)
        return (max(given, default=0) if given else step), tensors

    def set_steps(self, steps: Dict[str, int]) -> None:
        """Give every parameter its saved AdamW step count (each parameter keeps its own:
        [Note: unused parameters] in ``zkernels/zero/gradients/presence.py``)."""
        for u in self.opt.units:
            self._steps[u.index] = [steps[n] for n in u.names]

    def hparams(self) -> List[dict]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]

    def set_hparams(self, groups: List[dict]) -> None:
        for g, saved in zip(self.opt.param_groups, groups):
            for k, v in saved.items():
                g[k] = tuple(v) if isinstance(g.get(k), tuple) and isinstance(v, list) else v

    def model_entries(self) -> List[ModelEntry]:
        """Every key of ``module.state_dict()``, in order."""
        entries, first_key = [], {}
        # Stage 3: the sharded parameters' values come from the shards, not from here.
        with self.opt.sharded_state_dict_keys():
            state = self.module.state_dict(keep_vars=True)
        for key, t in state.items():
            if id(t) in self._names and (self._names[id(t)] in self.params
                                         or self._names[id(t)] in self.frozen):
                entries.append(ModelEntry(key, "param", of=self._names[id(t)]))
            elif id(t) in first_key:
                entries.append(ModelEntry(key, "alias", of=first_key[id(t)]))
            else:
                first_key[id(t)] = key
                kind = "frozen" if isinstance(t, torch.nn.Parameter) else "buffer"
                entries.append(ModelEntry(key, kind, tensor=t.detach()))
        return entries

    def scalars(self) -> Dict[str, object]:
        return self.opt.counters()

    def set_scalars(self, saved: Dict[str, object]) -> None:
        """Restore the counters; the loss scale only where both sides scale (fp16)."""
        self.opt.load_counters(saved)

    @torch.no_grad()
    def finish_load(self) -> None:
        """The states hold the checkpoint's values: let the update strategy rebuild each
        unit's compute shard from its master (rounded to param_dtype; its own tensors are
        passed, so nothing is copied twice), then the gather policy publish it (collective)."""
        for u in self.opt.units:
            z = self.opt.zero_units[u.index]
            if not self._fused(u):
                step, master, flat, scalars = self._rule_of(u)
                states = [{**{k: t[s:s + n] for k, t in flat.items()},
                           **{k: torch.tensor(v) for k, v in sc.items()}}
                          for (_, _, s, n), sc in zip(u.param_slices_in_shard(), scalars)]
                z.write_rule_state(self._rule_step(u, step), master, states)
                continue
            step, tensors = self._state(u)
            z.write_state(step, *tensors, param_steps=self._steps.get(u.index))
            self._restore_lowbit(u)
        self._staged.clear()
        self._raw.clear()
        self._rule.clear()
        self._steps.clear()
        # Frozen units too: their shards were written, so a stale gathered copy goes.
        self.opt.publish(list(self.opt.units) + self.frozen_units)

    def _restore_lowbit(self, u) -> None:
        """A low-bit unit whose every piece was saved in its format: its codes and scales (or
        bf16 moments) as saved, over what ``write_state`` quantized from their fp32 values."""
        z = self.opt.zero_units[u.index]
        desc = z.state_format
        slices = list(u.param_slices_in_shard())
        if desc is None or not all((name, a) in self._raw for name, a, _, _ in slices):
            return
        live = z.read_lowbit_state()
        out = {k: t.detach().clone() for k, t in live.items()}
        bs = desc["block_size"]
        for name, a, s, n in slices:
            raw = self._raw[(name, a)]
            for k, t in raw.items():
                if k.endswith("_scales"):
                    out[k][s // bs:s // bs + t.numel()] = t
                else:
                    out[k][s:s + n] = t
        z.write_lowbit_state(out)

    # -- Pretrained weights (``pretrained.py``): values only, one unit at a time. --

    @torch.no_grad()
    def write_fresh(self, fill) -> None:
        """A fresh start from given weights, unit by unit: for every piece this rank holds,
        ``fill(name, start, end, out)`` writes the values of elements ``[start, end)`` of
        parameter ``name`` into ``out`` (the fp32 master's view; a frozen shard's, in its
        dtype), or leaves it as it is (a key no file holds keeps its value); both moments
        are zeroed and the step is 0. Each unit's state is handed back before the next is read (with NVMe offload
        one unit is in host RAM at a time). Call :meth:`finish_fresh` after."""
        self._staged.clear()
        for u in self.opt.units:
            z = self.opt.zero_units[u.index]
            _, (master, exp_avg, exp_avg_sq) = z.read_state()
            for name, a, s, n in u.param_slices_in_shard():
                fill(name, a, a + n, master[s:s + n])
            exp_avg.zero_()
            exp_avg_sq.zero_()
            z.write_state(0, master, exp_avg, exp_avg_sq)
        for fp in self.frozen_pieces(write=True):
            fill(fp.name, fp.start, fp.end, fp.tensor)

    def finish_fresh(self) -> None:
        """Step counters to 0 and every rank's parameters following the shards (collective)."""
        self.opt.load_counters({"num_steps": 0, "overflow_skips": 0, "loss_scaler": None})
        self.opt.publish(list(self.opt.units) + self.frozen_units)

    @torch.no_grad()
    def full_units(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """``(name, full tensor)`` of every sharded parameter, unit by unit: each unit's fp32
        masters (a frozen unit's values, in its dtype) all-gathered over the shard group into
        one buffer of the unit's size, which is dropped before the next unit (collective:
        every rank iterates to the end). Tensors are on this rank's device, valid until the
        generator advances."""
        units = [(u, True) for u in self.opt.units] + [(u, False) for u in self.frozen_units]
        for u, trainable in units:
            if trainable:
                shard = self.opt.zero_units[u.index].read_state()[1][0]
                full = self._gather(u, shard)
            else:
                with u.shard_values() as shard:
                    full = self._gather(u, shard)
            for name, shape, off in zip(u.names, u.shapes, u.layout.offsets):
                n = math.prod(shape)
                yield name, full[off:off + n].view(tuple(shape))
            del full

    def _gather(self, unit, shard: torch.Tensor) -> torch.Tensor:
        shard = shard.to(self.device)
        full = torch.empty(unit.layout.padded_numel, dtype=shard.dtype, device=self.device)
        self.comm.all_gather(full, shard.contiguous()).wait()
        return full
