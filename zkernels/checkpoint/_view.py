"""The one place that knows how a ``ZeroOptimizer`` keeps its state: the checkpoint's view.

[Note: the checkpoint adapter]
Everything else in ``zkernels.checkpoint`` (file format, manifest, atomic publish, resharded
reads, consolidation) speaks only in terms of this module's objects: named parameters with
their full shape, and *pieces*: a contiguous element range ``[start, end)`` of one flattened
parameter held by this rank, with 1-D fp32 tensors for its master values and both AdamW
moments. Any way of sharding (buckets today; parameter units and shard states, stage 3's
sharded parameters, state offloaded to host RAM or NVMe later) is a new body for
:meth:`OptimizerView.pieces` and :meth:`OptimizerView.finish_load`, nothing more.

Contract of :meth:`pieces`: a piece's tensors are valid until the generator advances (an
offloaded state may stage them in and write them back between pieces); the saver only reads
them, the loader only writes them. Pieces of one rank never overlap, and over all ranks the
pieces of a parameter tile ``[0, numel)`` exactly (the saver checks it).

This body: today's ``zkernels/zero/buckets.py``. A bucket's parameters are the tensors of its
``FlatLayout``; ``tensor_slices_in_shard(rank)`` gives, for every parameter that overlaps this
rank's shard, its start in the parameter and in the shard; ``master``/``exp_avg``/``exp_avg_sq``
are [shard_numel] fp32 (in pure fp32 the master is a view of the compute buffer).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from .. import ops
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
        kind: ``"param"`` (a trainable parameter: its value is the master), ``"frozen"``
            (a parameter with requires_grad=False), ``"buffer"`` or ``"alias"`` (the same
            tensor as an earlier key, e.g. tied weights).
        of: for ``"param"``, the trainable parameter's name; for ``"alias"``, the earlier key.
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
        if not hasattr(opt, "buckets") or not hasattr(opt, "comm"):
            raise TypeError(f"opt must be a zkernels.ZeroOptimizer, got {type(opt).__name__}")
        module = getattr(opt, "module", None)
        if not isinstance(module, torch.nn.Module):
            raise TypeError("opt has no module: zkernels.checkpoint needs the ZeroOptimizer "
                            "the model was built with (opt.module)")
        self.opt = opt
        self.module = module
        self._names: Dict[int, str] = {id(p): n for n, p in module.named_parameters()}
        self.params: Dict[str, ParamInfo] = {}
        for gi, g in enumerate(opt.param_groups):
            for p in g["params"]:
                name = self._names[id(p)]
                self.params[name] = ParamInfo(name, tuple(p.shape), gi)
        # Registration order, the order state_dict() and the consolidated export use.
        order = {n: i for i, (n, _) in enumerate(module.named_parameters())}
        self.params = dict(sorted(self.params.items(), key=lambda kv: order[kv[0]]))
        self.group_names: List[List[str]] = [[self._names[id(p)] for p in g["params"]]
                                             for g in opt.param_groups]
        # Unmetered: checkpoint traffic is not a training step's.
        self.comm = getattr(opt.comm, "inner", opt.comm)
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.device = opt.buckets[0].compute.device

    def describe(self) -> Dict[str, object]:
        """How this optimizer runs (recorded in the manifest, for people)."""
        return {"world_size": self.world_size, "stage": self.opt.stage,
                "param_dtype": str(self.opt.precision.param_dtype).replace("torch.", ""),
                "offload": None}

    def pieces(self) -> Iterator[ShardPiece]:
        for b in self.opt.buckets:
            for i, in_tensor, in_shard, n in b.layout.tensor_slices_in_shard(b.rank):
                yield ShardPiece(self._names[id(b.params[i])], in_tensor, in_tensor + n, b.step,
                                 {f: getattr(b, f)[in_shard:in_shard + n] for f in FIELDS})

    def piece_ranges(self) -> List[Tuple[str, int, int, int]]:
        """``(name, start, end, step)`` of every piece :meth:`pieces` yields, in that order,
        without touching the tensors (the saver lays out its file from this first)."""
        return [(self._names[id(b.params[i])], s, s + n, b.step) for b in self.opt.buckets
                for i, s, _, n in b.layout.tensor_slices_in_shard(b.rank)]

    def set_steps(self, steps: Dict[str, int]) -> None:
        """Give every parameter its saved AdamW step count. A bucket (one AdamW call) has one
        count, so its parameters must agree."""
        for b in self.opt.buckets:
            names = [self._names[id(p)] for p in b.params]
            counts = {steps[n] for n in names}
            if len(counts) > 1:
                raise IncompatibleCheckpointError(
                    f"parameters {names} share one optimizer bucket here but were saved with "
                    f"different step counts {sorted(counts)}: load into an optimizer whose "
                    f"buckets do not mix them (param_groups or bucket_bytes)")
            b.step = counts.pop()

    def hparams(self) -> List[dict]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]

    def set_hparams(self, groups: List[dict]) -> None:
        for g, saved in zip(self.opt.param_groups, groups):
            for k, v in saved.items():
                g[k] = tuple(v) if isinstance(g.get(k), tuple) and isinstance(v, list) else v

    def model_entries(self) -> List[ModelEntry]:
        """Every key of ``module.state_dict()``, in order."""
        entries, first_key = [], {}
        for key, t in self.module.state_dict(keep_vars=True).items():
            if id(t) in self._names and self._names[id(t)] in self.params:
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
        """Rebuild the compute parameters from the restored master shards: round them to
        param_dtype, then all-gather each bucket (collective)."""
        handles = []
        for b in self.opt.buckets:
            if self.opt.precision.has_master:
                ops.cast(b.master, out=b.compute_shard)
            handles.append(self.comm.all_gather(b.compute, b.compute_shard))
        for h in handles:
            h.wait()
