"""Bytes per rank and traffic per step for each rung of the ZeRO ladder: pure arithmetic.

[Note: memory model]
Ψ parameters, N ranks, p = bytes of the compute copy (``param_dtype``, fp32 when None),
r = bytes of the gradient reduction (``reduce_dtype``, fp32 when None), g = bytes of the kept
gradient shard (``grad_shard_dtype``: fp32 when None, as ``ZeroOptimizer`` accumulates reduced
gradients in fp32), AdamW with two fp32 states (8 bytes per parameter). With a ``param_dtype``
narrower than fp32 a rank also holds an fp32 master copy (4 bytes); in pure fp32 the parameter
is its own master (DESIGN.md's table). B = elements of the largest bucket
(``bucket_bytes / r``, at most Ψ, at least the largest tensor of a given model; with
``bucket_bytes=None`` the optimizer's default, sized from Ψ by ``buckets.auto_bucket_bytes``),
G = number of param groups, U = elements of stage 3's largest unit (a block; see
``unit_plan.py``), root = elements of its root unit (embeddings, final norm, head).

    kind              stage 0 (DDP)   stage 1        stage 2        stage 3
    params            pΨ              pΨ             pΨ             pΨ/N
    grads             pΨ              pΨ             gΨ/N           gΨ/N
    master            4Ψ (mixed)      4Ψ/N           4Ψ/N           4Ψ/N
    optimizer_states  8Ψ              8Ψ/N           8Ψ/N           8Ψ/N
    buffers           0 (2rB if r≠p)  2rB (pooled)   (1 + G)rB      (1 + G)rU in backward
    transient         0               rΨ/N           0              p·(root + 2 U)

Which kind is sharded at which stage, the transient memory and the number of reduce buffers
come from the stage registry (``policy.py``: ``StagePolicy`` fields, ``num_reduce_buffers``),
the same entries the optimizer and its gradient strategies are built from.

``model_states_bytes`` (params + grads + master + optimizer_states) is the ZeRO paper's
quantity: with p = r = g = 2 and mixed precision (K = 12) it is 16Ψ, 4Ψ + 12Ψ/N,
2Ψ + 14Ψ/N and 16Ψ/N. ``buffers`` are the reduce buffers at the step's peak; stages 1-2 hold
them between steps too, stage 3 only while gradients are in flight (``held_buffers_bytes``:
0, so after backward and between steps stage 3 holds its formula and nothing else, as FSDP2
does). They are two
bucket-sized reduce buffers
(one filling, one reducing), plus, from stage 2, one per extra param group (its partly filled
bucket may wait for another group's), never more than there are buckets (a model that fits in
one bucket per group needs one buffer per group, counted as max(ceil(Ψ/B), G)); stage 1 needs them only when the gradient must be cast or
pre-divided before reduction (r != p, or fp16), else it reduce-scatters its flat gradient in
place. ``transient`` memory lives only inside a step: stage 1's reduced gradient shards during
``step()``, stage 3's gathered units (the layer computing and the one prefetched).
``device_bytes`` counts both (the peak that must fit: ``stats()["step_peak_bytes"]``
measures it); ``held_device_bytes`` counts what is held between steps (what
``ZeroOptimizer.stats()["memory_bytes"]`` measures). Data parallel means DDP with
``gradient_as_bucket_view=True``: its buckets are the gradients, so no buffer is counted, unless
an explicit ``reduce_dtype`` differs from the gradients' (a comm hook casting each bucket: two
bucket buffers, as at stage 1).

[Note: frozen parameters in the estimate]
Ψ counts every parameter; F of them are frozen (``requires_grad=False``: a module's are
counted, or ``frozen_numel=`` with a count), T = Ψ − F trainable. Gradients, master, optimizer
states, reduce buffers and the reduce-scatter scale with T only. Frozen parameters add to
``params``: whole at stages 0-2 (f·F, f = the frozen parameters' own bytes: a module's
measured, ``frozen_dtype`` with a count, fp32 by default), sharded at stage 3 (f₃·F/N, where
f₃ = p with a ``param_dtype`` narrower than fp32, which stage 3 casts floating frozen parameters
to, else f: see [Note: frozen parameters at stage 3] in ``units.py``); stage 3 gathers them with
their unit (the transient and the all-gathers count them, at p per element), and with
``offload_params`` their shards live in host RAM (or, with NVMe, in files) too.

Offload moves the fp32 work off the device (ZeRO-Offload / ZeRO-Infinity), as
``ZeroOptimizer``'s update engine places it (``state/engine.py``): with ``"cpu"``
the master, optimizer states and the gradient shard live in host RAM, plus two compute-dtype
staging sub-groups in mixed precision; with ``"nvme"`` the states and, by default, the master
live on disk (each swap file adds one 4096-byte header and pads to 4096 bytes, ignored here),
the gradient shard stays on the device, and host RAM holds the slot arena, at most the
configured budget (``nvme_buffer_bytes``; smaller when the largest unit shard is), plus the
master when ``nvme_master=False``. At stage 3 the parameter shard stays on the device unless
``offload_params=True`` moves it beside the state: into host RAM with ``"cpu"``
(``param_offload.py``: then CPU offload needs no staging, the update writes the host shard,
and in pure fp32 no master of its own, the shard is the master), into files with ``"nvme"``
(``param_nvme.py``: host RAM adds two bounces of the largest unit shard, at most
``nvme_param_buffer_bytes``, and in pure fp32
with a host master every slot of the arena stages its output).

[Note: traffic model]
Bytes this rank sends per step, ring convention (a reduce-scatter or all-gather of B bytes sends
B·(N−1)/N; an all-reduce sends twice that): stages 1-2 reduce-scatter the gradients and
all-gather the parameters ((r + p)·Ψ·(N−1)/N: the paper's 2Ψ), stage 3 gathers the parameters
twice, once per direction ((r + 2p)·Ψ·(N−1)/N: 3Ψ). Stage 0 all-reduces the gradients in
``reduce_dtype`` when one is given (2·r·Ψ·(N−1)/N: the like-for-like row ``plan`` shows), else
in their own dtype, as DDP does by default (2·p·Ψ·(N−1)/N).
With the quantized collectives (``ZeroOptimizer(quantize_grads=, quantize_weights=)``, see
``zkernels/comm/quantized.py``) an element costs its code plus its share of an fp32 scale per
``quantize_block`` elements instead of its dtype's bytes: ``bits/8 + 4/block`` (int8 1.0156,
int4 0.5156 at block 256) for the gradient all-to-all (replacing r), and for stage 3's gathers
(replacing p; a secondary shard's backward gather stays exact, in p). The cross-group
all-reduce of hybrid sharding stays in r. The scales are counted per element (a chunk's last
partial block is not rounded up), so small units come out a little under the meter.
Offload adds host<->device copies (gradient shard down, updated shard up; with
``offload_params`` the shard comes up at every gather instead: twice per step) and, for nvme,
the read and write of master and states.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Union

import torch

from .buckets import auto_bucket_bytes
from .offload_config import (DEFAULT_NVME_BUFFER_BYTES, DEFAULT_NVME_PARAM_BUFFER_BYTES,
                             DEFAULT_SUB_GROUP_NUMEL, IO_ALIGN, NUM_PARAM_BOUNCES,
                             nvme_arena_bytes, nvme_sub_group_numel, param_bounce_bytes)
from .policy import (NUM_REDUCE_BUFFERS, STAGES, check_reshard_after_forward, offload_policy,
                     stage_policy)
from .unit_plan import gathered_peak_numel, plan_units

ADAM_STATE_BYTES = 8        # exp_avg + exp_avg_sq, fp32
MASTER_BYTES = 4            # fp32 master copy of a narrower compute dtype

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


def rung_name(stage: int, offload: Optional[str], offload_params: bool = False) -> str:
    """Human name of a rung, as ``plan`` prints it: 'data parallel', 'stage 2', 'stage 3 +
    cpu offload', 'stage 3 + cpu offload + params on host' (``offload_params``; with NVMe
    '... + params on disk'), ..."""
    base = "data parallel" if stage == 0 else f"stage {stage}"
    name = base if offload is None else f"{base} + {offload} offload"
    if not offload_params:
        return name
    return name + (" + params on disk" if offload == "nvme" else " + params on host")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank of one rung (see [Note: memory model]) and bytes sent per step.

    Attributes:
        stage, offload, num_params, world_size: the rung and the model it was computed for
            (``num_params`` counts every parameter, frozen ones included).
        params_bytes, grads_bytes, master_bytes, optimizer_states_bytes, buffers_bytes,
        transient_bytes: bytes per rank of each kind, wherever they live.
        device_bytes, host_bytes, disk_bytes: peak totals per rank by location.
        comm_bytes: bytes this rank sends per step over the process group.
        host_device_bytes: bytes copied between host and device per step (offload).
        disk_io_bytes: bytes read plus written on disk per step (nvme offload).
        offload_params: stage 3's parameter shards are in host RAM too.
        frozen_numel: how many of ``num_params`` are frozen (no gradient, no state; see
            [Note: frozen parameters in the estimate]).
        by_location: ``{"device": {kind: bytes}, "host": {...}, "disk": {...}}``: where each
            kind lives (the device's ``transient`` included; the host's ``staging`` is the
            offload strategy's staging buffers or NVMe slot arena, which ``stats()`` counts
            as host ``buffers``). Left out of comparisons and hashing.
        shard_size: hybrid sharding's K (None: the states are sharded over all N ranks).
        comm_across_groups_bytes: the part of ``comm_bytes`` sent across shard groups (the
            all-reduce of the gradient shard; 0 without hybrid sharding).
        quantize_weights, quantize_grads: the quantized collectives counted in ``comm_bytes``
            (None: exact).
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
    transient_bytes: int
    device_bytes: int
    host_bytes: int
    disk_bytes: int
    comm_bytes: int
    host_device_bytes: int
    disk_io_bytes: int
    offload_params: bool = False
    frozen_numel: int = 0
    by_location: Dict[str, Dict[str, int]] = field(default_factory=dict, compare=False)
    shard_size: Optional[int] = None
    comm_across_groups_bytes: int = 0
    quantize_weights: Optional[str] = None
    quantize_grads: Optional[str] = None

    @property
    def trainable_numel(self) -> int:
        """Parameters with a gradient and optimizer state: ``num_params - frozen_numel``."""
        return self.num_params - self.frozen_numel

    @property
    def comm_within_group_bytes(self) -> int:
        """The part of ``comm_bytes`` sent within the shard group (all of it, unless
        hybrid)."""
        return self.comm_bytes - self.comm_across_groups_bytes

    @property
    def model_states_bytes(self) -> int:
        """params + grads + master + optimizer_states: the ZeRO paper's quantity."""
        return self.params_bytes + self.grads_bytes + self.master_bytes + \
            self.optimizer_states_bytes

    @property
    def gathered_peak_bytes(self) -> int:
        """Stage 3's gathered units at their peak (0 at the other stages)."""
        return self.transient_bytes if stage_policy(self.stage).shards_params else 0

    @property
    def held_buffers_bytes(self) -> int:
        """Reduce-buffer bytes held between steps and after backward: ``buffers_bytes`` at
        stages 0-2, 0 at stage 3 (its buffers live only while gradients are in flight)."""
        return self.buffers_bytes if stage_policy(self.stage).holds_reduce_buffers else 0

    @property
    def held_device_bytes(self) -> int:
        """Device bytes held between steps: the peak (``device_bytes``) less the transient
        memory and the reduce buffers not held between steps. Stages 2-3 hold the same after
        backward, before ``step()`` (stage 1 holds its reduced shards then too)."""
        return self.device_bytes - self.transient_bytes - \
            (self.buffers_bytes - self.held_buffers_bytes)

    @property
    def name(self) -> str:
        """'stage 3 + cpu offload', ..., with the quantized collectives: '... + int8 weights
        + int4 grads'."""
        return rung_name(self.stage, self.offload, self.offload_params) + "".join(
            f" + {fmt} {what}" for fmt, what in ((self.quantize_weights, "weights"),
                                                 (self.quantize_grads, "grads")) if fmt)

    def comm_seconds(self, link_gbps: float) -> float:
        """Seconds per step to send ``comm_bytes`` at ``link_gbps`` (see :func:`comm_seconds`)."""
        return comm_seconds(self.comm_bytes, link_gbps)


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
    """Parameters of the largest unit stage 3 gathers (``unit_plan.plan_units``' default
    units: the blocks and the root unit)."""
    return max((sum(p.numel() for p in s.params) for s in plan_units(model)), default=0)


def _stage3_units(model: torch.nn.Module):
    """(elements gathered at once, largest unit, number of units) for the default units."""
    specs = [s for s in plan_units(model) if s.params]
    sizes = [sum(p.numel() for p in s.params) for s in specs]
    return gathered_peak_numel(model), max(sizes, default=0), len(sizes)


def _frozen_split(model_or_num_params, num_params: int, frozen_numel, frozen_dtype,
                  pdt: torch.dtype):
    """``(F, whole bytes at stages 0-2, bytes over all stage-3 shards)`` of the frozen
    parameters (see [Note: frozen parameters in the estimate])."""
    fdt = parse_dtype(frozen_dtype, "frozen_dtype")
    mixed = pdt != torch.float32
    if isinstance(model_or_num_params, torch.nn.Module):
        if frozen_numel is not None or fdt is not None:
            raise ValueError("frozen_numel and frozen_dtype apply to a parameter count; a "
                             "module's frozen parameters are counted from requires_grad")
        frozen = [p for p in model_or_num_params.parameters() if not p.requires_grad]
        whole = sum(p.numel() * p.element_size() for p in frozen)
        sharded = sum(p.numel() * (pdt.itemsize if mixed and p.is_floating_point()
                                   else p.element_size()) for p in frozen)
        return sum(p.numel() for p in frozen), whole, sharded
    if frozen_numel is None:
        if fdt is not None:
            raise ValueError("frozen_dtype applies only with frozen_numel (the frozen "
                             "parameters' count)")
        return 0, 0, 0
    if isinstance(frozen_numel, bool) or not isinstance(frozen_numel, (int, float)) \
            or int(frozen_numel) != frozen_numel or not 0 <= frozen_numel <= num_params:
        raise ValueError(f"frozen_numel must be a whole number in [0, num_params = "
                         f"{num_params}], got {frozen_numel!r}")
    f = int(frozen_numel)
    fb = (fdt or torch.float32).itemsize
    return f, fb * f, (pdt.itemsize if mixed else fb) * f


def _div(numer: int, n: int) -> int:
    return -(-numer // n)   # a shard rounds up: every rank holds the same padded length


def _largest_tensor_numel(model) -> int:
    return max((p.numel() for p in model.parameters() if p.requires_grad), default=0) \
        if isinstance(model, torch.nn.Module) else 0


def estimate_memory(model_or_num_params: Union[torch.nn.Module, int, float], world_size: int,
                    stage: int, param_dtype=None, reduce_dtype=None,
                    offload: Optional[str] = None, bucket_bytes: Optional[int] = None,
                    max_unit_numel: Optional[int] = None, grad_shard_dtype=None,
                    max_tensor_numel: Optional[int] = None,
                    num_param_groups: int = 1,
                    nvme_buffer_bytes: int = DEFAULT_NVME_BUFFER_BYTES,
                    nvme_master: bool = True,
                    nvme_param_buffer_bytes: int = DEFAULT_NVME_PARAM_BUFFER_BYTES,
                    sub_group_numel: int = DEFAULT_SUB_GROUP_NUMEL,
                    offload_params: bool = False, frozen_numel: Optional[int] = None,
                    frozen_dtype=None, shard_size: Optional[int] = None,
                    secondary_size: Optional[int] = None, quantize_weights: Optional[str] = None,
                    quantize_grads: Optional[str] = None,
                    quantize_block: int = 256) -> MemoryEstimate:
    """Bytes per rank, by kind and location, for training with AdamW on one rung.

    Args:
        model_or_num_params: an ``nn.Module`` (its distinct parameters are counted, those with
            ``requires_grad=False`` as frozen) or Ψ (every parameter, frozen ones included).
        world_size: N, ranks sharing the states (>= 1).
        stage: 0 (plain data parallel: DDP + AdamW), 1, 2 or 3.
        param_dtype: compute dtype of the parameters (None: fp32, no master copy).
        reduce_dtype: dtype gradients are reduced in (None: fp32; at stage 0, the
            gradients' own dtype, as DDP reduces them).
        offload: None, "cpu" or "nvme" (stages 2-3 only).
        bucket_bytes: reduce bucket size (0: count no buffers, model states only; None, the
            optimizer's default: sized from the model, see [Note: buckets sized from the
            model] in ``buckets.py``).
        max_unit_numel: parameters of the largest unit gathered at stage 3 (two are counted
            gathered at once); default, when a module is given: its stage-3 units
            (``unit_plan.py``), counted as ``ZeroOptimizer`` gathers them: the root unit plus
            two of the largest block, and one reduce buffer per unit instead of per bucket;
            else 0 (not counted).
        grad_shard_dtype: dtype of the gradient shard kept at stages 2-3 (None: fp32, as
            ``ZeroOptimizer`` keeps it; the ZeRO paper keeps it in fp16).
        max_tensor_numel: elements of the largest parameter (a tensor larger than a bucket
            gets a bucket of its own); default: from the model when a module is given, else 0.
        num_param_groups: optimizer param groups; from stage 2 on, each group beyond the first
            may keep one partly filled bucket waiting, so it adds one reduce buffer.
        nvme_buffer_bytes, nvme_master, nvme_param_buffer_bytes, sub_group_numel: as in
            :class:`~zkernels.zero.planning.offload_config.OffloadConfig` (the NVMe host budget, master
            on disk, the parameter bounces' budget, the CPU offload sub-group).
        offload_params: stage 3 with offload: the parameter shards in host RAM too (in files
            with NVMe).
        frozen_numel: with a count Ψ, how many of them are frozen (default 0): e.g. a LoRA
            over a 7B base, ``estimate_memory(7e9 + 4e6, ..., frozen_numel=7e9)``; see
            [Note: frozen parameters in the estimate]. A module counts its own.
        frozen_dtype: with ``frozen_numel``, the frozen parameters' dtype (default fp32).
        shard_size: hybrid sharding (``ZeroOptimizer(shard_size=K)``): the states are
            sharded over groups of K ranks (K divides N) and replicated across the N/K
            groups: every byte per rank is the formula with N replaced by K, the traffic
            within the group too, plus an all-reduce of the gradient shard (Ψ/K elements in
            the reduce dtype) across the N/K groups (stages 1-3; stage 0 shards nothing).
        secondary_size: stage 3 with ``reshard_after_forward=R`` (an int): each unit's
            backward gather runs within R ranks, p·Ψ·(R-1)/R instead of p·Ψ·(K-1)/K, and the
            secondary chunks (p·Ψ/R at the end of forward) add to the transient bytes (see
            [Note: secondary shards] in ``parameters/secondary.py``).
        quantize_weights, quantize_grads, quantize_block: as ``ZeroOptimizer`` takes them
            (stage 3 for weights, stages 1-3 for gradients): the traffic counts codes plus
            scales (see [Note: traffic model]); memory is unchanged (the codes are transient
            and small beside the buffers they mirror).

    Returns:
        A :class:`MemoryEstimate`; see [Note: memory model] and [Note: traffic model].
    """
    num_params = count_params(model_or_num_params)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    policy = stage_policy(stage)
    off = offload_policy(offload)
    if stage < off.min_stage:
        allowed = " or ".join(str(s) for s in STAGES if s >= off.min_stage)
        raise ValueError(f"offload={offload!r} needs stage {allowed}, got stage {stage}")
    if not isinstance(offload_params, bool):
        raise TypeError(f"offload_params must be a bool, got {type(offload_params).__name__}")
    if offload_params and (not policy.shards_params or offload is None):
        raise ValueError(f"offload_params=True needs stage 3 with offload='cpu' or 'nvme', "
                         f"got stage={stage}, offload={offload!r}")
    if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or
                                     not isinstance(bucket_bytes, int) or bucket_bytes < 0):
        raise ValueError(f"bucket_bytes must be None or an int >= 0, got {bucket_bytes!r}")
    pdt = parse_dtype(param_dtype, "param_dtype") or torch.float32
    rdt = parse_dtype(reduce_dtype, "reduce_dtype") or torch.float32
    gdt = parse_dtype(grad_shard_dtype, "grad_shard_dtype") or torch.float32
    p, r, g = pdt.itemsize, rdt.itemsize, gdt.itemsize
    # Everything below scales with the trainable parameters; frozen ones are added to params.
    n_psi, big_n = num_params, world_size
    # Hybrid sharding: the formulas below see the shard group's K ranks.
    groups = _num_groups(shard_size, world_size) if stage != 0 else 1
    if stage == 0:
        _num_groups(shard_size, world_size)   # checked all the same
    big_n = world_size // groups
    n_frozen, frozen_whole, frozen_sharded = _frozen_split(
        model_or_num_params, num_params, frozen_numel, frozen_dtype, pdt)
    n_psi = num_params - n_frozen
    if bucket_bytes is None:
        bucket_bytes = auto_bucket_bytes(n_psi, rdt, policy.uses_reduce_pool(pdt, rdt))[1]
    mixed = pdt != torch.float32

    # Stage 3 with a model: its units (unit_plan.py) say what is gathered at once (the root
    # and two blocks: the prefetch bound) and size the reduce buffers (one unit each).
    units3 = None
    if policy.shards_params and max_unit_numel is None \
            and isinstance(model_or_num_params, torch.nn.Module):
        units3 = _stage3_units(model_or_num_params)
    if max_unit_numel is None:
        max_unit_numel = largest_unit_numel(model_or_num_params) \
            if isinstance(model_or_num_params, torch.nn.Module) else 0
    shard = _div(n_psi, big_n)
    # The largest bucket: bucket_bytes of reduce dtype, a lone tensor larger than that, never
    # more than the whole model.
    if max_tensor_numel is None:
        max_tensor_numel = _largest_tensor_numel(model_or_num_params)
    bucket_numel = 0 if bucket_bytes == 0 else min(n_psi, max(bucket_bytes // r,
                                                              max_tensor_numel))
    frozen_shard = _div(frozen_sharded, big_n)
    if isinstance(num_param_groups, bool) or not isinstance(num_param_groups, int) \
            or num_param_groups < 1:
        raise ValueError(f"num_param_groups must be an int >= 1, got {num_param_groups!r}")
    # Buckets never mix groups, so there are at least as many buckets as groups.
    num_buckets = max(-(-n_psi // bucket_numel), num_param_groups) if bucket_numel \
        else NUM_REDUCE_BUFFERS + num_param_groups
    if units3 is not None:  # stage 3 reduces one unit (per group) at a time
        bucket_numel, num_buckets = units3[1], max(units3[2], num_param_groups)
    pool = policy.num_reduce_buffers(num_buckets, num_param_groups) * r * bucket_numel
    if stage == 0:
        kinds = dict(params=p * n_psi + frozen_whole, grads=p * n_psi,
                     master=MASTER_BYTES * n_psi if mixed else 0,
                     optimizer_states=ADAM_STATE_BYTES * n_psi, transient=0,
                     # a reduction in another dtype casts each bucket into a buffer first
                     buffers=pool if reduce_dtype is not None and rdt != pdt else 0)
    else:
        transient = {"none": 0, "reduced_grad_shard": r * shard,
                     "gathered_units": p * (units3[0] if units3 is not None
                                            else 2 * max_unit_numel)}[policy.transient]
        kinds = dict(params=p * shard + frozen_shard if policy.shards_params
                     else p * n_psi + frozen_whole,
                     grads=g * shard if policy.shards_grads else p * n_psi,
                     master=MASTER_BYTES * shard if mixed else 0,
                     optimizer_states=ADAM_STATE_BYTES * shard,
                     buffers=pool if policy.uses_reduce_pool(pdt, rdt) else 0,
                     transient=transient)
    if offload is not None and not mixed and not (offload_params and offload == "cpu"):
        # Pure fp32 offload: the device parameter can no longer be the master (the update
        # runs elsewhere), so the host or disk holds an fp32 master shard of its own (with
        # CPU offload_params the host master is the host parameter shard itself).
        kinds["master"] = MASTER_BYTES * shard
    device = dict(kinds)
    host, disk = {}, {}
    unit_shard = _div(bucket_numel, big_n) if bucket_numel else shard  # the largest
    if offload_params and offload == "nvme":
        # Parameter files, read through two bounces of the largest unit shard within their
        # budget (param_nvme.py; a parameter count without units: the whole shard).
        disk["params"] = device.pop("params")
        host["bounces"] = NUM_PARAM_BOUNCES * (   # + each one's alignment slack
            param_bounce_bytes(nvme_param_buffer_bytes, p * unit_shard) + IO_ALIGN)
    elif offload_params:
        host["params"] = device.pop("params")
    if offload == "cpu":
        for k in ("master", "optimizer_states", "grads"):
            host[k] = device.pop(k)
        # Two staging sub-groups of compute-dtype results on their way to the device (none
        # when the update writes host parameter shards).
        host["staging"] = 2 * p * min(sub_group_numel, shard) if mixed and not offload_params \
            else 0
    elif offload == "nvme":
        on_disk = ("master",) if nvme_master else ()
        for k in on_disk + ("optimizer_states",):
            disk[k] = device.pop(k)
        if not nvme_master:
            host["master"] = device.pop("master")
        # The slot arena: sub-groups of the largest unit shard, capped by the budget (aligned
        # to a parameter file's blocks too).
        kinds_in_slot = len(on_disk) + 2
        cb = p if mixed or (offload_params and not nvme_master) else 0
        host["staging"] = nvme_arena_bytes(nvme_sub_group_numel(
            nvme_buffer_bytes, kinds_in_slot, cb, unit_shard,
            file_bytes=p if offload_params else 0), kinds_in_slot, cb)

    rq, pq = quantized_element_bytes(stage, quantize_weights, quantize_grads, quantize_block)
    rq, pq = rq or r, pq or p
    frac = (big_n - 1) / big_n
    if stage == 0:      # DDP all-reduces in reduce_dtype if given, else in the grads' dtype
        comm = 2 * (r if reduce_dtype is not None else p) * n_psi * frac
    else:               # one reduce-scatter, one or two all-gathers (stage 3: frozen too)
        gathered = n_psi + (n_frozen if policy.shards_params else 0)
        comm = (rq * n_psi + policy.gathers_per_step * pq * gathered) * frac
    if secondary_size is not None:
        check_reshard_after_forward(secondary_size, big_n, policy.shards_params)
        # the backward gather runs within R ranks, exact (quantized.py's Note)
        comm -= gathered * (pq * frac - p * (secondary_size - 1) / secondary_size)
        kinds["transient"] += p * _div(gathered, secondary_size)
        device["transient"] = kinds["transient"]
    # Hybrid: the reduced gradient shard is all-reduced across the groups (ring: 2(G-1)/G).
    across = 2 * r * shard * (groups - 1) / groups
    comm += across
    h2d = 0 if offload is None else g * shard + \
        (policy.gathers_per_step * (p * shard + frozen_shard) if offload_params
         else p * shard)
    # NVMe: state read and written once per step; parameter files written by the update and
    # read by every gather.
    disk_io = 0 if offload != "nvme" else 2 * (sum(disk.values()) - disk.get("params", 0)) + \
        (1 + policy.gathers_per_step) * disk.get("params", 0)
    return MemoryEstimate(
        stage=stage, offload=offload, num_params=num_params, world_size=world_size,
        params_bytes=kinds["params"], grads_bytes=kinds["grads"], master_bytes=kinds["master"],
        optimizer_states_bytes=kinds["optimizer_states"], buffers_bytes=kinds["buffers"],
        transient_bytes=kinds["transient"], device_bytes=sum(device.values()),
        host_bytes=sum(host.values()), disk_bytes=sum(disk.values()),
        comm_bytes=int(round(comm)), host_device_bytes=h2d, disk_io_bytes=disk_io,
        offload_params=offload_params, frozen_numel=n_frozen,
        by_location={"device": device, "host": host, "disk": disk},
        shard_size=None if shard_size is None else big_n,
        comm_across_groups_bytes=int(round(across)),
        quantize_weights=quantize_weights, quantize_grads=quantize_grads)


def quantized_element_bytes(stage: int, quantize_weights, quantize_grads,
                            quantize_block: int = 256):
    """``(gradient bytes per element or None, gathered-weight bytes per element or None)``
    sent by the quantized collectives: ``bits/8 + 4/quantize_block`` (None: not quantized).

    Raises:
        ValueError: an unknown format, a bad block, weights below stage 3 or anything at
            stage 0 (the message names the option).
    """
    from ...comm.quantized import GRAD_FORMATS, WEIGHT_FORMATS, _bits, check_block_size
    g = None if quantize_grads is None else _bits(quantize_grads, GRAD_FORMATS,
                                                  "quantize_grads")
    w = None if quantize_weights is None else _bits(quantize_weights, WEIGHT_FORMATS,
                                                    "quantize_weights")
    if g is None and w is None:
        return None, None
    check_block_size(quantize_block, "quantize_block")
    if stage == 0:
        raise ValueError("quantize_grads / quantize_weights apply to ZeRO stages 1-3, not to "
                         "stage 0 (data parallel)")
    if w is not None and not stage_policy(stage).shards_params:
        raise ValueError(f"quantize_weights={quantize_weights!r} applies to stage 3, got "
                         f"stage {stage}")
    per_scale = 4 / quantize_block
    return (None if g is None else g / 8 + per_scale), (None if w is None else w / 8 + per_scale)


def comm_seconds(comm_bytes: int, link_gbps: float) -> float:
    """Seconds to send ``comm_bytes`` over a link of ``link_gbps`` gigabits per second (the
    bandwidth term only: no latency, no overlap with compute)."""
    if isinstance(link_gbps, bool) or not isinstance(link_gbps, (int, float)) or \
            not link_gbps > 0:
        raise ValueError(f"link_gbps must be a number > 0, got {link_gbps!r}")
    return comm_bytes * 8 / (link_gbps * 1e9)


def _num_groups(shard_size, world_size: int) -> int:
    """N/K, the number of shard groups (1 without hybrid sharding).

    Raises:
        TypeError, ValueError: ``shard_size`` is not an int >= 1 dividing ``world_size``.
    """
    from ...comm.hybrid import check_shard_size
    k = check_shard_size(shard_size, world_size)
    return 1 if k is None else world_size // k
