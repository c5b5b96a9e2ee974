"""Bytes per rank and traffic per step for each rung of the ZeRO ladder: pure arithmetic.

[Note: memory model]
Ψ parameters, N ranks, p = bytes of the compute copy (``param_dtype``, fp32 when None),
r = bytes of the reduced gradient (``reduce_dtype``, fp32 when None), Adam with two fp32
states (8 bytes per parameter). With a ``param_dtype`` narrower than fp32 a rank also holds an
fp32 master copy (4 bytes); in pure fp32 the parameter is its own master (DESIGN.md's table).

    kind              stage 0 (DDP)   stage 1        stage 2        stage 3
    params            pΨ              pΨ             pΨ             pΨ/N
    grads             pΨ              pΨ             rΨ/N           rΨ/N
    master            4Ψ (mixed)      4Ψ/N           4Ψ/N           4Ψ/N
    optimizer_states  8Ψ              8Ψ/N           8Ψ/N           8Ψ/N
    buffers           0               rΨ/N + bucket  bucket         bucket
    gathered_peak     -               -              -              2·p·(largest unit)

``model_states_bytes`` (params + grads + master + optimizer_states) is the ZeRO paper's
quantity: with p = r = 2 and mixed precision (K = 12) it is 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N and
16Ψ/N. At stage 1 the reduced gradient shard (rΨ/N) is a buffer: the paper reduce-scatters in
place into the fp16 gradient; we keep a separate shard so that the fp32 sum does not round
through the compute dtype. Data parallel means DDP with ``gradient_as_bucket_view=True``: its
buckets are the gradients, so no buffer is counted. ``buffers`` adds ``bucket_bytes`` for the one bucket being reduced
(and, at stage 1, the shard). At stage 3 each gathered unit (a layer) is live while it computes
and the next one is prefetched: ``gathered_peak`` = 2 units in the compute dtype.

Offload moves the fp32 work off the device (ZeRO-Offload / ZeRO-Infinity): with ``"cpu"`` the
master, optimizer states and the reduced gradient shard live in host RAM (and at stage 3 the
parameter shard too); with ``"nvme"`` master, states (and at stage 3 the parameter shard) live
on disk, the gradient shard and one staging bucket in host RAM.

[Note: traffic model]
Bytes this rank sends per step, ring convention (a reduce-scatter or all-gather of B bytes sends
B·(N−1)/N; an all-reduce sends twice that): stage 0 all-reduces the gradients (2·rΨ·(N−1)/N),
stages 1-2 reduce-scatter the gradients and all-gather the parameters ((r + p)·Ψ·(N−1)/N: the
paper's 2Ψ), stage 3 gathers the parameters twice, once per direction ((r + 2p)·Ψ·(N−1)/N: 3Ψ).
Offload adds host<->device copies (gradient shard down, updated shard up) and, for nvme, the
read and write of master and states.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

ADAM_STATE_BYTES = 8        # exp_avg + exp_avg_sq, fp32
MASTER_BYTES = 4            # fp32 master copy of a narrower compute dtype
RUNGS: Tuple[Tuple[int, Optional[str]], ...] = ((1, None), (2, None), (3, None),
                                                (3, "cpu"), (3, "nvme"))

_DTYPE_NAMES = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
}


def parse_dtype(value, name: str) -> Optional[torch.dtype]:
    """``None``, a floating ``torch.dtype`` or one of fp32/bf16/fp16 (and long names) -> dtype."""
    if value is None or isinstance(value, torch.dtype):
        if isinstance(value, torch.dtype) and not value.is_floating_point:
            raise ValueError(f"{name} must be a floating dtype, got {value}")
        return value
    if isinstance(value, str) and value.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[value.lower()]
    raise ValueError(f"{name} must be None, a torch floating dtype or one of "
                     f"{sorted(_DTYPE_NAMES)}, got {value!r}")


def rung_name(stage: int, offload: Optional[str]) -> str:
    """Human name of a rung: 'data parallel', 'stage 2', 'stage 3 + cpu offload', ..."""
    base = "data parallel" if stage == 0 else f"stage {stage}"
    return base if offload is None else f"{base} + {offload} offload"


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank of one rung (see [Note: memory model]) and bytes sent per step.

    Attributes:
        stage, offload, num_params, world_size: the rung and the model it was computed for.
        params_bytes, grads_bytes, master_bytes, optimizer_states_bytes, buffers_bytes,
        gathered_peak_bytes: bytes per rank of each kind, wherever they live.
        device_bytes, host_bytes, disk_bytes: totals per rank by location.
        model_states_bytes: params + grads + master + optimizer_states (the paper's quantity).
        comm_bytes: bytes this rank sends per step over the process group.
        host_device_bytes: bytes copied between host and device per step (offload).
        disk_io_bytes: bytes read plus written on disk per step (nvme offload).
    """

    stage: int
    offload: Optional[str]
    num_params: int
    world_size: int
    params_bytes: int
    grads_bytes: int
    master_bytes: int
    optimizer_states_bytes: int
    buffers_bytes: int
    gathered_peak_bytes: int
    device_bytes: int
    host_bytes: int
    disk_bytes: int
    comm_bytes: int
    host_device_bytes: int
    disk_io_bytes: int

    @property
    def model_states_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.master_bytes + \
            self.optimizer_states_bytes

    @property
    def name(self) -> str:
        return rung_name(self.stage, self.offload)


def count_params(model_or_num_params) -> int:
    """Distinct parameters of an ``nn.Module`` (tied weights counted once), or the number."""
    if isinstance(model_or_num_params, torch.nn.Module):
        return sum(p.numel() for p in model_or_num_params.parameters())
    if isinstance(model_or_num_params, bool) or not isinstance(model_or_num_params,
                                                                (int, float)):
        raise TypeError("model_or_num_params must be an nn.Module or a number of parameters, "
                        f"got {type(model_or_num_params).__name__}")
    n = int(model_or_num_params)
    if n != model_or_num_params or n < 0:
        raise ValueError(f"model_or_num_params must be a whole number >= 0, got "
                         f"{model_or_num_params}")
    return n


def largest_unit_numel(model: torch.nn.Module) -> int:
    """Parameters of the largest unit stage 3 gathers at once: each element of a ModuleList /
    Sequential is a unit (a transformer block), every other child module is one unit."""
    best, seen = 0, set()

    def visit(mod: torch.nn.Module) -> None:
        nonlocal best
        for child in mod.children():
            if isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)):
                visit(child)
                continue
            numel = sum(p.numel() for p in child.parameters() if id(p) not in seen)
            seen.update(id(p) for p in child.parameters())
            best = max(best, numel)
    visit(model)
    own = sum(p.numel() for p in model.parameters(recurse=False))
    return max(best, own)


def _div(numer: int, n: int) -> int:
    return -(-numer // n)   # a shard rounds up: every rank holds the same padded length


def estimate_memory(model_or_num_params: Union[torch.nn.Module, int, float], world_size: int,
                    stage: int, param_dtype=None, reduce_dtype=None,
                    offload: Optional[str] = None, bucket_bytes: int = 25 * 2**20,
                    max_unit_numel: Optional[int] = None) -> MemoryEstimate:
    """Bytes per rank, by kind and location, for training with AdamW on one rung.

    Args:
        model_or_num_params: an ``nn.Module`` (its distinct parameters are counted) or Ψ.
        world_size: N, ranks sharing the states (>= 1).
        stage: 0 (plain data parallel: DDP + AdamW), 1, 2 or 3.
        param_dtype: compute dtype of the parameters (None: fp32, no master copy).
        reduce_dtype: dtype gradients are reduced and kept in once sharded (None: fp32).
        offload: None, "cpu" or "nvme" (stages 2-3 only).
        bucket_bytes: size of the gradient bucket in flight (0 to count model states only).
        max_unit_numel: parameters of the largest unit gathered at stage 3; default: the
            model's largest block when a module is given, else 0 (not counted).

    Returns:
        A :class:`MemoryEstimate`; see [Note: memory model] and [Note: traffic model].
    """
    num_params = count_params(model_or_num_params)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if offload not in (None, "cpu", "nvme"):
        raise ValueError(f"offload must be None, 'cpu' or 'nvme', got {offload!r}")
    if offload is not None and stage < 2:
        raise ValueError(f"offload={offload!r} needs stage 2 or 3, got stage {stage}")
    if not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise ValueError(f"bucket_bytes must be an int >= 0, got {bucket_bytes!r}")
    pdt = parse_dtype(param_dtype, "param_dtype") or torch.float32
    rdt = parse_dtype(reduce_dtype, "reduce_dtype") or torch.float32
    p, r = pdt.itemsize, rdt.itemsize
    n_psi, big_n = num_params, world_size
    mixed = pdt != torch.float32

    if max_unit_numel is None:
        max_unit_numel = largest_unit_numel(model_or_num_params) \
            if isinstance(model_or_num_params, torch.nn.Module) else 0
    shard = _div(n_psi, big_n)
    # The bucket never exceeds the gradients it carries.
    bucket = min(bucket_bytes, n_psi * r)
    if stage == 0:
        kinds = dict(params=p * n_psi, grads=p * n_psi,
                     master=MASTER_BYTES * n_psi if mixed else 0,
                     optimizer_states=ADAM_STATE_BYTES * n_psi, buffers=0, gathered=0)
    else:
        kinds = dict(params=p * n_psi if stage < 3 else p * shard,
                     grads=p * n_psi if stage == 1 else r * shard,
                     master=MASTER_BYTES * shard if mixed else 0,
                     optimizer_states=ADAM_STATE_BYTES * shard,
                     buffers=bucket + (r * shard if stage == 1 else 0),
                     gathered=2 * p * max_unit_numel if stage == 3 else 0)
    device = dict(kinds)
    host, disk = {}, {}
    if offload == "cpu":
        for k in ("master", "optimizer_states", "grads") + (("params",) if stage == 3 else ()):
            host[k] = device.pop(k)
    elif offload == "nvme":
        for k in ("master", "optimizer_states") + (("params",) if stage == 3 else ()):
            disk[k] = device.pop(k)
        host["grads"] = device.pop("grads")
        host["buffers"] = bucket          # staging buffer between disk and the update

    frac = (big_n - 1) / big_n
    if stage == 0:
        comm = 2 * r * n_psi * frac
    elif stage < 3:
        comm = (r + p) * n_psi * frac
    else:
        comm = (r + 2 * p) * n_psi * frac
    h2d = 0 if offload is None else r * shard + p * shard
    disk_io = 0 if offload != "nvme" else 2 * (kinds["master"] + kinds["optimizer_states"])
    return MemoryEstimate(
        stage=stage, offload=offload, num_params=n_psi, world_size=big_n,
        params_bytes=kinds["params"], grads_bytes=kinds["grads"], master_bytes=kinds["master"],
        optimizer_states_bytes=kinds["optimizer_states"], buffers_bytes=kinds["buffers"],
        gathered_peak_bytes=kinds["gathered"], device_bytes=sum(device.values()),
        host_bytes=sum(host.values()), disk_bytes=sum(disk.values()),
        comm_bytes=int(round(comm)), host_device_bytes=h2d, disk_io_bytes=disk_io)


class NoRungFitsError(RuntimeError):
    """Even the last rung of the ladder needs more memory than the budget."""


def _gb(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.3g} GB"


def choose_rung(num_params: int, world_size: int, budget_bytes: int, *, headroom: float = 0.10,
                param_dtype=None, reduce_dtype=None, bucket_bytes: int = 25 * 2**20,
                max_unit_numel: Optional[int] = None, host_budget_bytes: Optional[int] = None,
                disk_budget_bytes: Optional[int] = None,
                rungs: Tuple[Tuple[int, Optional[str]], ...] = RUNGS,
                ) -> Tuple[Tuple[int, Optional[str]], MemoryEstimate, str]:
    """Lowest rung whose device bytes per rank fit ``budget_bytes * (1 - headroom)``.

    The headroom is left for what the estimate does not count: activations, the allocator's
    fragmentation, the framework's workspace. Activations are the caller's business: a model
    whose activations are large needs a larger headroom or a smaller budget.

    Args:
        num_params: Ψ (or an nn.Module). world_size: N ranks.
        budget_bytes: device memory available to one rank for model states and buffers.
        headroom: fraction of ``budget_bytes`` kept free, in [0, 1).
        param_dtype, reduce_dtype, bucket_bytes, max_unit_numel: as in :func:`estimate_memory`.
        host_budget_bytes, disk_budget_bytes: when given, offload rungs must also fit there.
        rungs: ``(stage, offload)`` pairs to try, lowest first.

    Returns:
        ``((stage, offload), estimate, reason)``: the rung, its estimate, and one sentence
        saying why it was taken (what it needs, what was available, why lower rungs did not fit).

    Raises:
        NoRungFitsError: no rung fits; the message says what the last rung needs.
    """
    if not isinstance(budget_bytes, (int, float)) or budget_bytes < 0:
        raise ValueError(f"budget_bytes must be a number >= 0, got {budget_bytes!r}")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom!r}")
    if not rungs:
        raise ValueError("rungs must name at least one (stage, offload) pair")
    num_params = count_params(num_params)
    usable = budget_bytes * (1 - headroom)
    where = f"{_gb(usable)} usable of {_gb(budget_bytes)} " \
            f"({headroom:.0%} headroom for activations and fragmentation)"
    rejected = []
    est = None
    for stage, offload in rungs:
        est = estimate_memory(num_params, world_size, stage, param_dtype=param_dtype,
                              reduce_dtype=reduce_dtype, offload=offload,
                              bucket_bytes=bucket_bytes, max_unit_numel=max_unit_numel)
        misses = []
        if est.device_bytes > usable:
            misses.append(f"{_gb(est.device_bytes)} on the device")
        if host_budget_bytes is not None and est.host_bytes > host_budget_bytes:
            misses.append(f"{_gb(est.host_bytes)} of host RAM > {_gb(host_budget_bytes)}")
        if disk_budget_bytes is not None and est.disk_bytes > disk_budget_bytes:
            misses.append(f"{_gb(est.disk_bytes)} of disk > {_gb(disk_budget_bytes)}")
        if not misses:
            lower = f"; lower rungs need {', '.join(rejected)}" if rejected else ""
            reason = (f"{est.name} is the lowest rung that fits: it needs "
                      f"{_gb(est.device_bytes)} per rank on the device for {num_params:,} "
                      f"params on {world_size} ranks, {where}{lower}")
            return (stage, offload), est, reason
        rejected.append(f"{est.name}: {' and '.join(misses)}")
    raise NoRungFitsError(
        f"no rung of the ladder fits {num_params:,} params on {world_size} ranks in "
        f"{where}: {'; '.join(rejected)}. Use more ranks, a narrower param_dtype, or a "
        f"larger memory budget")
