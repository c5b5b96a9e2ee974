"""Bytes per rank while a model is built (on the meta device), loaded, trained and saved:
the start-up and the save beside the training peak of :func:`estimate_memory`.

[Note: memory while building, loading and saving]
Letters as in [Note: memory model] (``estimate.py``); m = bytes per element of the model as
it is built (a meta model's own dtype: fp32 unless it is a bf16/fp16 model), f = bytes per
element in the files read (``file_dtype``; default m), U_i = elements of unit i (stage 3: the
units of ``unit_plan.plan_units``, built in backward order, the root last; stages 1-2: the
buckets), S = what a rank holds once built: what the training estimate holds between steps
(params, master, optimizer states, offload's staging, stages 1-2's reduce buffers and
gradients, CPU offload's host gradient shards; in memory, so NVMe's files are not), less
stage 3's device gradient shards, which the first backward allocates ([Note: device
gradient shards allocated lazily] in ``state/grad_sink.py``).
What the code holds, and so what is counted:

- **build** (``ZeroOptimizer(meta_model, device=...)``, ``parameters/build.py``). Stage 3:
  unit i is materialized whole in m (``materialized``: m·U_i), flattened into one fp32 buffer
  and its shard cloned (``flat_copy``: 4·U_i + 4·U_i/N) while the units built before it hold
  their states (``states``: S·(elements built so far)/T). The peak is the largest of these
  over the build order, or S itself once every unit is built (for a parameter count: S
  less the largest unit's share, plus that unit's cost). Stages 1-2 materialize the whole
  model first (mΨ) and then flatten bucket by bucket (4·B, the bucket's fp32 buffer, which
  becomes the compute copy), with the states.
- **load** (``zk.checkpoint.load_pretrained``): every state S, plus the read buffer (the rows
  of one file tensor covering one piece of this rank's shard, at most the largest tensor's
  shard plus two rows, in f), one unit's fp32 shard copied as its state is written back
  (``unit_copy``: 4·U/N) and the file pages this rank maps (``file_pages``: its share of the
  largest file, at most f·Ψ/N: read through ``safe_open``'s memory map, they count in RSS
  until the file closes, and the loader keeps one file open at a time; see [Note: measuring
  peak RSS honestly] in ``zkernels/bench/peak_rss.py``).
  Stages 1-2 hold their whole compute copy (pΨ) too, and then publish every bucket at once
  (``publish``: pΨ, the all-gathers in flight together, each staged by gloo through a buffer
  of its size; an in-place NCCL all-gather needs none, so there this overcounts).
- **train**: :func:`estimate_memory`'s peak (``device_bytes + host_bytes``), by kind.
- **save** (``zk.checkpoint.save_pretrained``): what training holds between steps
  (``held_device_bytes`` + host bytes), plus one unit's (bucket's) fp32 masters all-gathered
  (``gathered_unit``: 4·U, padded to N), plus on rank 0 the largest tensor cast to the saved
  dtype (``cast``: d·largest tensor, only when ``save_dtype`` differs from fp32). The file is
  written with ``write()``: its pages are page cache, not the process's RSS.

Not counted: the allocator's and the framework's own overhead (a few tens of MiB per process
on CPU: the benchmark's bound leaves 128 MiB for it), activations (train), and the NaN check's
one byte per element of the largest tensor (build). Offload places the states as the training
estimate does; every phase's bytes here are per rank, wherever they live (on a CPU run: RSS).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Union

import torch

from .buckets import auto_bucket_bytes
from .config import parse_dtype
from .estimate import MemoryEstimate, estimate_memory, largest_unit_numel
from .policy import STAGES
from .unit_plan import plan_units

PHASES = ("build", "load", "train", "save")
FP32 = 4


@dataclass(frozen=True)
class PhaseEstimate:
    """Bytes per rank by kind in each phase (see [Note: memory while building, loading and
    saving]).

    Attributes:
        training: the :class:`MemoryEstimate` of the same rung.
        by_phase: ``{"build": {kind: bytes}, "load": ..., "train": ..., "save": ...}``.
    """

    training: MemoryEstimate
    by_phase: Dict[str, Dict[str, int]] = field(default_factory=dict)

    def peak_bytes(self, phase: str) -> int:
        """The peak of ``phase`` ("build", "load", "train" or "save")."""
        if phase not in self.by_phase:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        return sum(self.by_phase[phase].values())

    @property
    def build_peak_bytes(self) -> int:
        """The peak while building and loading (the larger of the two)."""
        return max(self.peak_bytes("build"), self.peak_bytes("load"))

    @property
    def train_peak_bytes(self) -> int:
        return self.peak_bytes("train")


def _unit_sizes(model, stage: int):
    """Stage 3: ``[(elements, bytes as built)]`` per unit in build order (blocks backward,
    the root last); None for a count."""
    if not isinstance(model, torch.nn.Module) or not STAGES[stage].shards_params:
        return None
    specs = [s for s in plan_units(model) if s.params or s.frozen]
    order = specs[:-1][::-1] + specs[-1:]
    return [(sum(p.numel() for p in s.params), sum(p.numel() * p.element_size()
                                                   for p in list(s.params) + list(s.frozen)))
            for s in order]


def _model_bytes(model, model_dtype) -> int:
    mdt = parse_dtype(model_dtype, "model_dtype")
    if mdt is not None:
        return mdt.itemsize
    if isinstance(model, torch.nn.Module):
        ps = [p for p in model.parameters() if p.requires_grad]
        return ps[0].element_size() if ps else FP32
    return FP32


def estimate_phases(model_or_num_params: Union[torch.nn.Module, int, float], world_size: int,
                    stage=None, *, model_dtype=None, file_dtype=None, save_dtype=None,
                    file_bytes: Optional[int] = None, **estimate_kwargs) -> PhaseEstimate:
    """Bytes per rank while building on the meta device, loading Hugging Face files
    (``zk.checkpoint.load_pretrained``), training and saving (``save_pretrained``).

    Args:
        model_or_num_params, world_size, stage: as :func:`estimate_memory` (a meta-device
            module is fine: only shapes are read).
        model_dtype: the dtype the model is built in (default: a module's own, else fp32).
        file_dtype: the dtype of the tensors in the files loaded (default: ``model_dtype``).
        save_dtype: ``save_pretrained(dtype=)`` (None: the fp32 masters as they are).
        file_bytes: bytes of the largest file loaded (a sharded checkpoint's largest shard;
            default: the whole model in ``file_dtype``, one file).
        **estimate_kwargs: anything else :func:`estimate_memory` takes (``config``,
            ``param_dtype``, ``offload``, ``max_unit_numel``, ...).

    Returns:
        a :class:`PhaseEstimate`.
    """
    est = estimate_memory(model_or_num_params, world_size, stage, **estimate_kwargs)
    if est.stage == 0:
        raise ValueError("estimate_phases: stage must be 1, 2 or 3 (a meta-device build and "
                         "load_pretrained/save_pretrained need a ZeroOptimizer)")
    m = _model_bytes(model_or_num_params, model_dtype)
    fdt = parse_dtype(file_dtype, "file_dtype")
    f = fdt.itemsize if fdt is not None else m
    sdt = parse_dtype(save_dtype, "save_dtype")
    n = est.shard_size or world_size
    t = est.trainable_numel
    psi = est.num_params
    # What a rank holds once built, in memory (device and host; NVMe's files are not): what
    # it holds between steps (stage 3's reduce buffers are not held), less stage 3's device
    # gradient shards, which the first backward allocates.
    states = est.held_device_bytes + est.host_bytes - \
        (est.by_location["device"].get("grads", 0) if STAGES[est.stage].shards_params else 0)
    max_tensor = _largest_tensor(model_or_num_params, estimate_kwargs)
    unit = _unit_numel(est, model_or_num_params, estimate_kwargs)
    build = _build(est, model_or_num_params, states, m, n, t, unit)
    load = dict(states=states,
                read_buffer=f * (min(max_tensor, _ceil(unit, n)) + 2 * _row(max_tensor)),
                unit_copy=FP32 * _ceil(unit, n),
                publish=0 if STAGES[est.stage].shards_params else est.params_bytes,
                file_pages=_ceil(min(f * psi, file_bytes if file_bytes is not None
                                     else f * psi), n))
    train = {}
    for kinds in est.by_location.values():
        for k, v in kinds.items():
            train[k] = train.get(k, 0) + v
    held = est.held_device_bytes + est.host_bytes
    save = dict(held=held, gathered_unit=FP32 * _ceil(unit, n) * n,
                cast=0 if sdt is None or sdt == torch.float32 else sdt.itemsize * max_tensor)
    return PhaseEstimate(training=est, by_phase=dict(build=build, load=load, train=train,
                                                     save=save))


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _row(max_tensor: int) -> int:
    """Elements of one row of the largest tensor, taken as square (a read covers at most one
    extra row at each end of its piece)."""
    return int(max_tensor ** 0.5) + 1


def _largest_tensor(model, kwargs) -> int:
    if kwargs.get("max_tensor_numel") is not None:
        return int(kwargs["max_tensor_numel"])
    if isinstance(model, torch.nn.Module):
        return max((p.numel() for p in model.parameters()), default=0)
    return int(kwargs.get("max_unit_numel") or 0)


def _unit_numel(est: MemoryEstimate, model, kwargs) -> int:
    """The largest unit (stage 3) or bucket (stages 1-2) a rank flattens or gathers whole."""
    if kwargs.get("max_unit_numel") is not None:
        return int(kwargs["max_unit_numel"])
    if STAGES[est.stage].shards_params:   # a count without layer sizes: not counted
        return largest_unit_numel(model) if isinstance(model, torch.nn.Module) else 0
    # Stages 1-2: a bucket of the bytes the estimate was given, else the optimizer's default.
    bb = kwargs.get("bucket_bytes")
    if bb is None:
        rdt = parse_dtype(kwargs.get("reduce_dtype"), "reduce_dtype") or torch.float32
        bb = auto_bucket_bytes(est.trainable_numel, rdt, True)[1]
    return min(est.trainable_numel, max(bb // FP32, _largest_tensor(model, kwargs)))


def _build(est: MemoryEstimate, model, states: int, m: int, n: int, t: int,
           unit: int) -> Dict[str, int]:
    """The build phase's kinds at its peak (see the Note)."""
    if not STAGES[est.stage].shards_params:
        # The whole model materialized in m, then one bucket's fp32 buffer at a time; the
        # states (the replicated compute copy is the buckets themselves).
        shard_states = states - est.params_bytes
        mixed = est.master_bytes > 0 and est.offload is None
        return dict(states=shard_states, materialized=m * est.num_params,
                    flat_copy=FP32 * unit + (est.params_bytes // max(est.num_params, 1)
                                             if mixed else 0) * unit)
    per_elem = states / max(t, 1)
    sizes = _unit_sizes(model, est.stage)
    if sizes is None:   # a count: every other unit's states, then the largest unit
        sizes = [(t - unit, None), (unit, m * unit)]
    # Each unit at its worst (materialized and flattened on top of the units built before it),
    # and the end, where every state exists.
    best, done = dict(states=states, materialized=0, flat_copy=0), 0
    for numel, built_bytes in sizes:
        if built_bytes is not None:
            cand = dict(states=int(per_elem * done), materialized=built_bytes,
                        flat_copy=FP32 * (numel + _ceil(numel, n)))
            if sum(cand.values()) > sum(best.values()):
                best = cand
        done += numel
    return best
