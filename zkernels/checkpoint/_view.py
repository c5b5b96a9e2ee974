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

This body: the optimizer's flat parameter units (``opt.units``, ``zkernels/zero/parameters/units.py``) and
the update strategy's shard states (``opt.shard_update.states``, ``shard_state.py``). A state
reads its unit's parameter names and layout, and ``unit.param_slices_in_shard()`` maps every
element of its shard to ``(name, start in the parameter)``; its master and moments are
[shard_numel] fp32. Loading writes into those tensors, then hands each state back to the
update strategy (``load_state``: it rewrites the unit's compute shard from the master, in the
compute dtype) and lets the unit's gather policy ``publish`` it (stages 1-2: all-gather the
full buffer; stage 3: drop a stale gathered copy, the next gather reads the new shards).
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
"""
from __future__ import annotations

import contextlib

from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from .errors import IncompatibleCheckpointError

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
    """

    name: str
    start: int
    end: int
    step: int
    tensors: Dict[str, torch.Tensor]


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
        if not all(hasattr(opt, a) for a in ("units", "shard_update", "comm")):
            raise TypeError(f"opt must be a zkernels.ZeroOptimizer, got {type(opt).__name__}")
        module = getattr(opt, "module", None)
        if not isinstance(module, torch.nn.Module):
            raise TypeError("opt has no module: zkernels.checkpoint needs the ZeroOptimizer "
                            "the model was built with (opt.module)")
        self.opt = opt
        self.module = module
        # overlap_param_gather: the last step's all-gathers write the full buffers (of which
        # the fp32 masters are views) until waited for; save and load read and write them.
        wait = getattr(opt, "wait_params", None)
        if wait is not None:
            wait()
        self._states = {st.unit_index: st for st in opt.shard_update.states}
        # (master, exp_avg, exp_avg_sq) per unit, through the update strategy: the live
        # tensors on the device or in host RAM; for NVMe offload, copies read from its files
        # (held here until finish_load writes them back, so an NVMe save or load holds the
        # rank's state in host RAM for its duration).
        self._staged: Dict[int, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # id(param) -> canonical name (its first name in named_parameters(), as units.py).
        self._names: Dict[int, str] = {id(p): n for n, p in module.named_parameters()}
        unit_params: Dict[str, ParamInfo] = {}
        for u in opt.units:
            # Stage 3's freed parameters are empty: their shapes come from the gather policy.
            shapes = getattr(u.gather, "shapes", None) or [p.shape for p in u.params]
            for name, shape in zip(u.names, shapes):
                unit_params[name] = ParamInfo(name, tuple(shape), u.group_index)
        # Registration order, the order state_dict() and the consolidated export use.
        self.params: Dict[str, ParamInfo] = {n: unit_params[n] for n in
                                             dict(module.named_parameters()) if n in unit_params}
        self.group_names: List[List[str]] = [[self._names[id(p)] for p in g["params"]]
                                             for g in opt.param_groups]
        # Stage 3's frozen parameters, sharded (see [Note: frozen pieces]).
        self.frozen_units = list(getattr(opt, "frozen_units", ()))
        frozen: Dict[str, FrozenInfo] = {}
        for u in self.frozen_units:
            for name, shape in zip(u.names, u.gather.shapes):
                frozen[name] = FrozenInfo(name, tuple(shape), u.compute_dtype)
        self.frozen: Dict[str, FrozenInfo] = {n: frozen[n] for n in
                                              dict(module.named_parameters()) if n in frozen}
        # Unmetered: checkpoint traffic is not a training step's.
        self.comm = getattr(opt.comm, "inner", opt.comm)
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        # Hybrid sharding: rank and world_size above are within the shard group (they name
        # the shard files); every replica holds the same shards, so only the first replica
        # writes them, each shard once. ``everyone`` (all N ranks) agrees on each phase and
        # its rank 0 leads (see zkernels/comm/hybrid.py).
        self.everyone = getattr(self.comm, "world", self.comm)
        self.writes_shards = getattr(self.comm, "replica_rank", 0) == 0
        self.leads = self.everyone.rank == 0
        self.device = opt.units[0].device

    def describe(self) -> Dict[str, object]:
        """How this optimizer runs (recorded in the manifest, for people)."""
        placement = getattr(self.opt.shard_update, "placement", "device")
        return {"world_size": self.world_size, "stage": self.opt.stage,
                "param_dtype": str(self.opt.precision.param_dtype).replace("torch.", ""),
                "offload": None if placement == "device" else placement}

    def _unit_states(self):
        for u in self.opt.units:
            yield u, self._states[u.index]

    def piece_ranges(self) -> List[Tuple[str, int, int, int]]:
        """``(name, start, end, step)`` of every piece :meth:`pieces` yields, in that order,
        without touching the tensors (the saver lays out its file from this first)."""
        return [(name, a, a + n, st.step) for u, st in self._unit_states()
                for name, a, _, n in u.param_slices_in_shard()]

    def pieces(self) -> Iterator[ShardPiece]:
        for u, st in self._unit_states():
            tensors = dict(zip(FIELDS, self._tensors(st)))
            for name, a, s, n in u.param_slices_in_shard():
                yield ShardPiece(name, a, a + n, st.step,
                                 {f: t[s:s + n] for f, t in tensors.items()})

    def frozen_piece_ranges(self) -> List[Tuple[str, int, int, torch.dtype]]:
        """``(name, start, end, dtype)`` of every piece :meth:`frozen_pieces` yields."""
        return [(name, a, a + n, u.compute_dtype) for u in self.frozen_units
                for name, a, _, n in u.param_slices_in_shard()]

    def frozen_pieces(self) -> Iterator[FrozenPiece]:
        """This rank's pieces of the sharded frozen parameters (views of the shards: the
        saver reads them, the loader writes them)."""
        for u in self.frozen_units:
            shard = u.compute_shard
            for name, a, s, n in u.param_slices_in_shard():
                yield FrozenPiece(name, a, a + n, shard[s:s + n])

    def _tensors(self, st):
        if st.unit_index not in self._staged:
            self._staged[st.unit_index] = tuple(
                self.opt.shard_update.state_tensors(st.unit_index))
        return self._staged[st.unit_index]

    def set_steps(self, steps: Dict[str, int]) -> None:
        """Give every parameter its saved AdamW step count. A unit's state (one AdamW call)
        has one count, so its parameters must agree."""
        for _, st in self._unit_states():
            counts = {steps[n] for n in st.names}
            if len(counts) > 1:
                raise IncompatibleCheckpointError(
                    f"parameters {list(st.names)} share one optimizer unit here but were saved "
                    f"with different step counts {sorted(counts)}: load into an optimizer "
                    f"whose units do not mix them (param_groups or bucket_bytes)")
            st.step = counts.pop()

    def hparams(self) -> List[dict]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]

    def set_hparams(self, groups: List[dict]) -> None:
        for g, saved in zip(self.opt.param_groups, groups):
            for k, v in saved.items():
                g[k] = tuple(v) if isinstance(g.get(k), tuple) and isinstance(v, list) else v

    def model_entries(self) -> List[ModelEntry]:
        """Every key of ``module.state_dict()``, in order."""
        entries, first_key = [], {}
        schedule = getattr(self.opt, "schedule", None)   # stage 3: parameters are sharded
        keys_only = (schedule.sharded_state_dict_keys() if schedule is not None
                     else contextlib.nullcontext())
        with keys_only:   # the sharded parameters' values come from the shards, not from here
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
        opt = self.opt
        return {"num_steps": opt._num_steps, "overflow_skips": opt._overflow_skips,
                "loss_scaler": opt.scaler.state_dict() if opt.scaler is not None else None}

    def set_scalars(self, saved: Dict[str, object]) -> None:
        """Restore the counters; the loss scale only where both sides scale (fp16)."""
        opt = self.opt
        opt._num_steps = int(saved["num_steps"])
        opt._overflow_skips = int(saved["overflow_skips"])
        if opt.scaler is not None and saved.get("loss_scaler") is not None:
            opt.scaler.load_state_dict(saved["loss_scaler"])

    @torch.no_grad()
    def finish_load(self) -> None:
        """The states hold the checkpoint's values: let the update strategy rebuild each
        unit's compute shard from its master (rounded to param_dtype; its own tensors are
        passed, so nothing is copied twice), then the gather policy publish it (collective)."""
        handles = []
        for u, st in self._unit_states():
            self.opt.shard_update.load_state(u, st.step, *self._tensors(st))
            handles.append(u.gather.publish(self.comm))
        for u in self.frozen_units:  # their shards were written: drop a stale gathered copy
            handles.append(u.gather.publish(self.comm))
        self._staged.clear()
        for h in handles:
            h.wait()
