"""Bytes per rank and traffic per step for each rung of the ZeRO ladder: pure arithmetic.

[Note: memory model]
Ψ parameters, N ranks, p = bytes of the compute copy (``param_dtype``, fp32 when None),
r = bytes of the gradient reduction (``reduce_dtype``, fp32 when None), g = bytes of the kept
gradient shard (``grad_shard_dtype``: fp32 when None, as ``ZeroOptimizer`` accumulates reduced
gradients in fp32), AdamW with two fp32 states (8 bytes per parameter). With a ``param_dtype``
narrower than fp32 a rank also holds an fp32 master copy (4 bytes); in pure fp32 the parameter
is its own master (docs/design.md#pure-fp32). B = elements of the largest bucket
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
does). They are two bucket-sized reduce buffers (one filling, one reducing), plus, from stage
2, one per extra param group (its partly filled bucket may wait for another group's), never
more than there are buckets (a model that fits in one bucket per group needs one buffer per
group, counted as max(ceil(Ψ/B), G)); stage 1 needs them only when the gradient must be cast
or pre-divided before reduction (r != p, or fp16), else it reduce-scatters its flat gradient
in place. ``transient`` memory lives only inside a step: stage 1's reduced gradient shards during
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
``ZeroOptimizer``'s update engine places it (``state/engine.py``): with ``"cpu"`` the master,
optimizer states and the gradient shard live in host RAM, plus two compute-dtype staging
sub-groups in mixed precision; with ``"nvme"`` the states and, by default, the master live on
disk (each swap file adds one 4096-byte header and pads to 4096 bytes, ignored here), low-bit
moments (``state_dtype``) at their size on disk and in the slots, the gradient shard stays on
the device, and host RAM holds the slot arena, at most the configured budget
(``nvme_buffer_bytes``; smaller when the largest unit shard is), plus the master when
``nvme_master=False``. At stage 3 the parameter shard stays on the device unless
``offload_params=True`` moves it beside the state: into host RAM with ``"cpu"``
(``param_offload.py``: then CPU offload needs no staging, the update writes the host shard, and
in pure fp32 no master of its own, the shard is the master), into files with ``"nvme"``
(``param_nvme.py``: host RAM adds two bounces of the largest unit shard, at most
``nvme_param_buffer_bytes``, and in pure fp32 with a host master every slot of the arena stages
its output). An element-wise class or the fused Lion/SGD on NVMe has no arena: its state (and
master, with ``nvme_master``) is in files and host ``staging`` holds one unit's state, master
and gradient shard ([Note: rule state on NVMe] in ``state/rule_swap.py``).

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
A whole-matrix class (Muon, Adafactor) adds its owners' two exchanges within the shard group
(``comm_matrix_bytes``: the gradient pieces to the owners, the updated master pieces back),
exact against the meter when the model and its param groups are given ([Note: the matrix
exchanges in the estimate] in ``matrix_plan.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, Optional, Sequence, Tuple, Union

import torch

from .buckets import auto_bucket_bytes
from .config import QuantizeConfig, ZeroConfig, parse_dtype
from .matrix_plan import balanced_exchange_bytes, matrix_exchange_bytes
from .offload_config import (IO_ALIGN, NUM_PARAM_BOUNCES, OffloadConfig, nvme_arena_bytes,
                             nvme_sub_group_numel, param_bounce_bytes)
from .optimizer_spec import ADAMW_STATE_BYTES, OptimizerSpec, resolve_optimizer
from .policy import NUM_REDUCE_BUFFERS, STAGES, StagePolicy, check_reshard_after_forward
from .state_format import StateFormat, slot_moments, state_bytes
from .unit_plan import gathered_peak_numel, plan_units

ADAM_STATE_BYTES = ADAMW_STATE_BYTES   # exp_avg + exp_avg_sq, fp32
MASTER_BYTES = 4            # fp32 master copy of a narrower compute dtype (master_dtype bf16:
#                             2, or 0 where it is the bf16 parameter shard, [Note: bf16 master])


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
        comm_matrix_bytes: the part of ``comm_bytes`` that a whole-matrix class's owners
            exchange within the shard group (0 without Muon / Adafactor; see [Note: the
            matrix exchanges in the estimate] in ``matrix_plan.py``).
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
    comm_matrix_bytes: int = 0

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
        return self.transient_bytes if STAGES[self.stage].shards_params else 0

    @property
    def held_buffers_bytes(self) -> int:
        """Reduce-buffer bytes held between steps and after backward: ``buffers_bytes`` at
        stages 0-2, 0 at stage 3 (its buffers live only while gradients are in flight)."""
        return self.buffers_bytes if STAGES[self.stage].holds_reduce_buffers else 0

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


_OFFLOAD_KNOBS = ("sub_group_numel", "nvme_buffer_bytes", "nvme_param_buffer_bytes",
                  "nvme_master")


def estimate_config(stage=None, config: Optional[ZeroConfig] = None, **kwargs) -> ZeroConfig:
    """The :class:`ZeroConfig` an estimate reads: ``config`` as given, or one built from
    ``ZeroOptimizer``'s keyword names (``ZeroConfig.from_kwargs``), plus the estimator's own
    spellings: ``secondary_size=R`` for ``reshard_after_forward=R`` and the
    :class:`OffloadConfig` knobs (``sub_group_numel``, ``nvme_buffer_bytes``,
    ``nvme_param_buffer_bytes``, ``nvme_master``) as flat keywords.

    Raises:
        TypeError: ``config`` together with a stage or config keywords, or neither.
    """
    if config is not None:
        if kwargs or stage is not None:
            given = sorted(kwargs) + (["stage"] if stage is not None else [])
            raise TypeError(f"pass config= or the keywords it holds, not both (got config= "
                            f"and {', '.join(given)})")
        return config
    if stage is None:
        raise TypeError("estimate_memory needs stage= (0, 1, 2 or 3) or config=")
    knobs = {k: kwargs.pop(k) for k in _OFFLOAD_KNOBS if k in kwargs}
    secondary = kwargs.pop("secondary_size", None)
    if secondary is not None:
        kwargs["reshard_after_forward"] = secondary
    if knobs and kwargs.get("offload") is not None:
        kwargs["offload_config"] = OffloadConfig(**knobs)
    return ZeroConfig.from_kwargs(stage=stage, **kwargs)


@dataclass(frozen=True)
class _Counts:
    """What an estimate is computed from: the config's rung and the model's sizes (elements
    and bytes per element; see [Note: memory model] for the letters)."""

    policy: StagePolicy
    cfg: ZeroConfig
    p: int                  # compute copy
    r: int                  # gradient reduction
    g: int                  # kept gradient shard
    mixed: bool             # an fp32 master beside a narrower compute copy
    num_params: int         # Ψ, frozen included
    n_psi: int              # T, the trainable ones
    n_frozen: int           # F
    frozen_whole: int       # bytes of the frozen parameters at stages 0-2
    frozen_shard: int       # bytes of this rank's frozen shard at stage 3
    big_n: int              # ranks sharing the states (hybrid: K)
    groups: int             # N/K
    shard: int              # T/K, padded
    num_param_groups: int
    bucket_numel: int       # B (stage 3 with a module: its largest unit)
    num_buckets: int
    gathered: int           # stage 3's elements gathered at once
    state_bytes: int = ADAM_STATE_BYTES   # optimizer state per trainable element
    rule: bool = False      # a torch class or fused Lion/SGD (NVMe: swapped per unit)
    state_format: Optional[StateFormat] = None   # low-bit AdamW moments (state_dtype)
    matrix: bool = False    # a whole-matrix class (NVMe: its shard master in host RAM)
    matrix_comm: float = 0.0   # bytes of the owners' exchanges per step (matrix_plan.py)
    # per param group (param_groups=): (state bytes per element, trainable elements)
    group_states: Tuple[Tuple[int, int], ...] = ()

    @property
    def offload(self) -> Optional[str]:
        return self.cfg.offload.kind

    @property
    def offload_params(self) -> bool:
        return self.cfg.offload.params


def _counts(model, world_size: int, cfg: ZeroConfig, *, grad_shard_dtype, max_unit_numel,
            gathered_numel, max_tensor_numel, num_param_groups, frozen_numel,
            frozen_dtype) -> _Counts:
    num_params = count_params(model)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if isinstance(num_param_groups, bool) or not isinstance(num_param_groups, int) \
            or num_param_groups < 1:
        raise ValueError(f"num_param_groups must be an int >= 1, got {num_param_groups!r}")
    policy = STAGES[cfg.stage]
    pdt = cfg.precision.param_dtype or torch.float32
    rdt = cfg.precision.reduce_dtype or torch.float32
    gdt = parse_dtype(grad_shard_dtype, "grad_shard_dtype") or torch.float32
    # Hybrid sharding: the formulas see the shard group's K ranks (stage 0 shards nothing).
    groups = _num_groups(cfg.sharding.shard_size, world_size)
    groups = 1 if cfg.stage == 0 else groups
    big_n = world_size // groups
    n_frozen, frozen_whole, frozen_sharded = _frozen_split(model, num_params, frozen_numel,
                                                           frozen_dtype, pdt)
    n_psi = num_params - n_frozen
    bucket_bytes = cfg.buckets.bucket_bytes
    if bucket_bytes is None:
        bucket_bytes = auto_bucket_bytes(n_psi, rdt, policy.uses_reduce_pool(pdt, rdt))[1]
    is_module = isinstance(model, torch.nn.Module)
    # Stage 3 with a model: its units (unit_plan.py) say what is gathered at once (the root
    # and two blocks: the prefetch bound) and size the reduce buffers (one unit each).
    units3 = _stage3_units(model) if policy.shards_params and max_unit_numel is None \
        and is_module else None
    if max_unit_numel is None:
        max_unit_numel = largest_unit_numel(model) if is_module else 0
    if gathered_numel is None:
        gathered_numel = units3[0] if units3 is not None else 2 * max_unit_numel
    if max_tensor_numel is None:
        max_tensor_numel = _largest_tensor_numel(model)
    # The largest bucket: bucket_bytes of reduce dtype, a lone tensor larger than that, never
    # more than the whole model. Buckets never mix groups: at least one per group.
    bucket_numel = 0 if bucket_bytes == 0 else min(n_psi, max(bucket_bytes // rdt.itemsize,
                                                              max_tensor_numel))
    num_buckets = max(-(-n_psi // bucket_numel), num_param_groups) if bucket_numel \
        else NUM_REDUCE_BUFFERS + num_param_groups
    if units3 is not None:  # stage 3 reduces one unit (per group) at a time
        bucket_numel, num_buckets = units3[1], max(units3[2], num_param_groups)
    return _Counts(policy, cfg, pdt.itemsize, rdt.itemsize, gdt.itemsize, pdt != torch.float32,
                   num_params, n_psi, n_frozen, frozen_whole, _div(frozen_sharded, big_n),
                   big_n, groups, _div(n_psi, big_n), num_param_groups, bucket_numel,
                   num_buckets, gathered_numel)


def _states(c: _Counts) -> Dict[str, int]:
    """params, grads, master and optimizer_states per rank, wherever they live."""
    pol = c.policy
    per = c.shard if pol.shards_optimizer else c.n_psi
    # Pure fp32 offload: the device parameter can no longer be the master (the update runs
    # elsewhere), so the host or disk holds an fp32 master shard of its own (with CPU
    # offload_params the host master is the host parameter shard itself). A bf16 master ([Note:
    # bf16 master] in state/bf16_master.py) is 2 bytes, and with bf16 parameters it is their shard
    # as fp32's is in pure fp32 (0 where that shard lives beside the step).
    mb = 2 if c.cfg.state.master_dtype == torch.bfloat16 else MASTER_BYTES
    own_master = c.p != mb or c.offload is not None and not (c.offload_params and
                                                             c.offload == "cpu")
    states = c.state_bytes * per if c.state_format is None else state_bytes(per, c.state_format)
    if c.group_states:   # each group's class on its own elements
        states = sum(b * (_div(n, c.big_n) if pol.shards_optimizer else n)
                     for b, n in c.group_states)
    return dict(params=c.p * c.shard + c.frozen_shard if pol.shards_params
                else c.p * c.n_psi + c.frozen_whole,
                grads=c.g * c.shard if pol.shards_grads else c.p * c.n_psi,
                master=mb * per if own_master else 0,
                optimizer_states=states)


def _buffers(c: _Counts) -> int:
    """Reduce-buffer bytes at the step's peak (see [Note: memory model]): the pool's buffers
    of the largest bucket, where the stage reduces through a pool (data parallel only when
    an explicit reduce dtype differs from the gradients', a comm hook casting each bucket)."""
    prec = c.cfg.precision
    pdt, rdt = prec.param_dtype or torch.float32, prec.reduce_dtype or torch.float32
    pooled = c.policy.uses_reduce_pool(pdt, rdt) if c.cfg.stage else \
        prec.reduce_dtype is not None and rdt != pdt
    if not pooled:
        return 0
    return c.policy.num_reduce_buffers(c.num_buckets, c.num_param_groups) * c.r * c.bucket_numel


def _transient(c: _Counts) -> int:
    """Bytes that live only inside a step: stage 1's reduced shards, stage 3's gathered units
    (and, with secondary shards, their chunks from forward to backward)."""
    out = {"none": 0, "reduced_grad_shard": c.r * c.shard,
           "gathered_units": c.p * c.gathered}[c.policy.transient]
    secondary = c.cfg.sharding.secondary_size
    if secondary is not None:
        check_reshard_after_forward(secondary, c.big_n)
        out += c.p * _div(_gathered_numel(c), secondary)
    return out


def _offload_split(c: _Counts, kinds: Dict[str, int]):
    """``(device, host, disk)``: where each kind lives (see the offload paragraph of [Note:
    memory model]); host ``bounces`` and ``staging`` are the offload strategy's buffers."""
    device, host, disk = dict(kinds), {}, {}
    opts, p = c.cfg.offload.options, c.p
    unit_shard = _div(c.bucket_numel, c.big_n) if c.bucket_numel else c.shard  # the largest
    if c.offload_params and c.offload == "nvme":
        # Parameter files, read through two bounces of the largest unit shard within their
        # budget (param_nvme.py; a parameter count without units: the whole shard).
        disk["params"] = device.pop("params")
        host["bounces"] = NUM_PARAM_BOUNCES * (   # + each one's alignment slack
            param_bounce_bytes(opts.nvme_param_buffer_bytes, p * unit_shard) + IO_ALIGN)
    elif c.offload_params:
        host["params"] = device.pop("params")
    if c.offload == "cpu":
        for k in ("master", "optimizer_states", "grads"):
            host[k] = device.pop(k)
        # Two staging sub-groups of compute-dtype results on their way to the device (none
        # when the update writes host parameter shards).
        host["staging"] = 2 * p * min(opts.sub_group_numel, c.shard) \
            if c.mixed and not c.offload_params else 0
    elif c.offload == "nvme" and c.rule:
        # A rule's state (and with nvme_master its master) in files, one unit's read into host RAM
        # for its step with the unit's gradient shard ([Note: rule state on NVMe] in
        # state/rule_swap.py). A whole-matrix class's shard master stays in host RAM ([Note: whole
        # matrices on NVMe] in state/matrix_swap.py; its owners' whole masters count as its state).
        disk["optimizer_states"] = device.pop("optimizer_states")
        master_on_disk = opts.nvme_master and not c.matrix
        (disk if master_on_disk else host)["master"] = device.pop("master")
        read_in = c.state_bytes + (4 if master_on_disk else 0)
        host["staging"] = (read_in + c.g) * unit_shard if read_in else 0
    elif c.offload == "nvme":
        on_disk = ("master",) if opts.nvme_master else ()
        for k in on_disk + ("optimizer_states",):
            disk[k] = device.pop(k)
        if not opts.nvme_master:
            host["master"] = device.pop("master")
        # The slot arena: sub-groups of the largest unit shard, capped by the budget (aligned
        # to a parameter file's blocks too); low-bit moments in the slots as on disk.
        kinds_in_slot = len(on_disk) + 2
        cb = p if c.mixed or (c.offload_params and not opts.nvme_master) else 0
        mb, bs = slot_moments([c.state_format])
        ms = 2 if c.cfg.state.master_dtype == torch.bfloat16 else 4
        host["staging"] = nvme_arena_bytes(nvme_sub_group_numel(
            opts.nvme_buffer_bytes, kinds_in_slot, cb, unit_shard,
            file_bytes=p if c.offload_params else 0, moment_bytes=mb, block_size=bs,
            master_bytes=ms), kinds_in_slot, cb, mb, bs)
    return device, host, disk


def _gathered_numel(c: _Counts) -> int:
    """Elements each parameter all-gather moves over a step (stage 3: frozen ones too)."""
    return c.n_psi + (c.n_frozen if c.policy.shards_params else 0)


def _traffic(c: _Counts, disk: Dict[str, int]):
    """``(comm, across groups, host<->device, disk I/O)`` bytes per step (see [Note: traffic
    model])."""
    pol, p, r, n_psi = c.policy, c.p, c.r, c.n_psi
    rq, pq = quantized_element_bytes(c.cfg.quantization)
    rq, pq = rq or r, pq or p
    frac = (c.big_n - 1) / c.big_n
    gathered = _gathered_numel(c)
    if c.cfg.stage == 0:   # DDP all-reduces in reduce_dtype if given, else in the grads' dtype
        comm = 2 * (r if c.cfg.precision.reduce_dtype is not None else p) * n_psi * frac
    else:                  # one reduce-scatter, one or two all-gathers
        comm = (rq * n_psi + pol.gathers_per_step * pq * gathered) * frac
    secondary = c.cfg.sharding.secondary_size
    if secondary is not None:  # the backward gather runs within R ranks, exact
        comm -= gathered * (pq * frac - p * (secondary - 1) / secondary)
    # Hybrid: the reduced gradient shard is all-reduced across the groups (ring: 2(G-1)/G).
    across = 2 * r * c.shard * (c.groups - 1) / c.groups
    comm += c.matrix_comm   # the owners' exchanges, within the shard group
    h2d = 0 if c.offload is None else c.g * c.shard + (
        pol.gathers_per_step * (p * c.shard + c.frozen_shard) if c.offload_params
        else p * c.shard)
    # NVMe: state read and written once per step; parameter files written by the update and
    # read by every gather.
    files = disk.get("params", 0)
    disk_io = 0 if c.offload != "nvme" else 2 * (sum(disk.values()) - files) + \
        (1 + pol.gathers_per_step) * files
    return comm + across, across, h2d, disk_io


def _model_param_dtype(model, cfg: ZeroConfig) -> ZeroConfig:
    """``cfg`` with ``param_dtype`` None read as a ZeRO stage reads it for a module whose
    trainable parameters are all bf16 or all fp16: that dtype ([Note: low-precision models]
    in ``parameters/groups.py``). Stage 0, a count Ψ, mixed dtypes: ``cfg`` unchanged."""
    if not isinstance(model, torch.nn.Module) or cfg.stage == 0 or \
            cfg.precision.param_dtype is not None:
        return cfg
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    if len(dtypes) != 1 or next(iter(dtypes)) not in (torch.bfloat16, torch.float16):
        return cfg
    return cfg.with_param_dtype(dtypes.pop())


def estimate_memory(model_or_num_params: Union[torch.nn.Module, int, float], world_size: int,
                    stage=None, *, config: Optional[ZeroConfig] = None, grad_shard_dtype=None,
                    max_unit_numel: Optional[int] = None, gathered_numel: Optional[int] = None,
                    max_tensor_numel: Optional[int] = None, num_param_groups: int = 1,
                    frozen_numel: Optional[int] = None, frozen_dtype=None,
                    optimizer="adamw", optimizer_kwargs: Optional[dict] = None,
                    param_groups: Optional[Sequence[dict]] = None,
                    **config_kwargs) -> MemoryEstimate:
    """Bytes per rank, by kind and location, for training with AdamW (or ``optimizer``)
    on one rung.

    Args:
        model_or_num_params: an ``nn.Module`` (its distinct parameters are counted, those with
            ``requires_grad=False`` as frozen) or Ψ (every parameter, frozen ones included).
        world_size: N, ranks sharing the states (>= 1).
        stage: 0 (plain data parallel: DDP + AdamW), 1, 2 or 3; or give ``config``.
        config: a :class:`~zkernels.zero.planning.config.ZeroConfig` with an explicit stage
            (0-3), instead of ``stage`` and the keywords below.
        **config_kwargs: ``ZeroOptimizer``'s keywords that build a config (``param_dtype``,
            ``reduce_dtype``: None is fp32, at stage 0 the gradients' own dtype;
            ``offload``, ``offload_params``, ``bucket_bytes``: 0 counts no buffers;
            ``shard_size``; ``reshard_after_forward`` or ``secondary_size``: an int R;
            ``quantize_weights``, ``quantize_grads``, ``quantize_block``; ``state_dtype``
            and ``state_block_size``: low-bit AdamW moments, 4 bytes per element for bf16,
            2 plus 8 per block of int8, instead of 8), and the
            ``OffloadConfig`` knobs flat (``nvme_buffer_bytes``, ``nvme_master``,
            ``nvme_param_buffer_bytes``, ``sub_group_numel``); see :func:`estimate_config`.
        grad_shard_dtype: dtype of the gradient shard kept at stages 2-3 (None: fp32, as
            ``ZeroOptimizer`` keeps it; the ZeRO paper keeps it in fp16).
        max_unit_numel: parameters of the largest unit gathered at stage 3 (two are counted
            gathered at once); default, when a module is given: its stage-3 units
            (``unit_plan.py``), counted as ``ZeroOptimizer`` gathers them: the root unit plus
            two of the largest block, and one reduce buffer per unit instead of per bucket;
            else 0 (not counted).
        gathered_numel: stage 3's parameters gathered at once (the root unit plus two of the
            largest block), for a parameter count whose layer sizes are known (``plan``
            with a config.json); default: from the module's units, else 2 × max_unit_numel.
        max_tensor_numel: elements of the largest parameter (a tensor larger than a bucket
            gets a bucket of its own); default: from the model when a module is given, else 0.
        num_param_groups: optimizer param groups; from stage 2 on, each group beyond the first
            may keep one partly filled bucket waiting, so it adds one reduce buffer.
        frozen_numel: with a count Ψ, how many of them are frozen (default 0): e.g. a LoRA
            over a 7B base, ``estimate_memory(7e9 + 4e6, ..., frozen_numel=7e9)``; see
            [Note: frozen parameters in the estimate]. A module counts its own.
        frozen_dtype: with ``frozen_numel``, the frozen parameters' dtype (default fp32).
        optimizer, optimizer_kwargs: the optimizer as ``ZeroOptimizer(optimizer=...)`` takes
            it (``"adamw"``, ``"sgd"``, ``torch.optim.Adagrad``, ...) and its hyperparameters
            (``{"momentum": 0.9}``): its state bytes per trainable element replace AdamW's 8
            (``OptimizerSpec.state_bytes``: SGD 4 with momentum, 0 without; Adagrad 4; ...).
            A whole-matrix class (``"muon"``, ``"adafactor"``) also adds its owners'
            exchanges to ``comm_bytes`` (``comm_matrix_bytes``; with a count, the balanced
            layout's figure).
        param_groups: with a module, the groups as ``ZeroOptimizer`` takes them (each
            ``{"params": [...], "optimizer": torch.optim.Muon, ...}``; a group without
            ``"optimizer"`` runs ``optimizer``): each group's state bytes on its own
            elements, the groups' count for the reduce buffers, and the owners' exchanges of
            the matrix groups, counted on the optimizer's own layout and owners (the meter's
            figure: [Note: the matrix exchanges in the estimate] in ``matrix_plan.py``).

    Hybrid sharding replaces N by K in every byte per rank and adds the cross-group
    all-reduce; secondary shards add p·Ψ/R to the transient bytes; quantization changes the
    traffic only.

    Returns:
        A :class:`MemoryEstimate`; see [Note: memory model] and [Note: traffic model].
    """
    cfg = estimate_config(stage, config, **config_kwargs)
    if cfg.stage == "auto":
        raise ValueError("estimate_memory needs an explicit stage (0, 1, 2 or 3), got 'auto' "
                         "(the ladder picks one: zkernels.zero.planning.ladder.choose_rung)")
    cfg = _model_param_dtype(model_or_num_params, cfg)
    spec = optimizer if isinstance(optimizer, OptimizerSpec) else \
        resolve_optimizer(optimizer, dict(optimizer_kwargs or {}), where="estimate_memory: ")
    if param_groups is not None and isinstance(param_groups, (list, tuple)):
        num_param_groups = len(param_groups)
    c = _counts(model_or_num_params, world_size, cfg, grad_shard_dtype=grad_shard_dtype,
                max_unit_numel=max_unit_numel, gathered_numel=gathered_numel,
                max_tensor_numel=max_tensor_numel, num_param_groups=num_param_groups,
                frozen_numel=frozen_numel, frozen_dtype=frozen_dtype)
    c = replace(c, state_bytes=spec.state_bytes(), rule=not spec.fused, matrix=spec.matrix)
    if param_groups is not None:
        c = _with_groups(c, model_or_num_params, param_groups, optimizer, optimizer_kwargs)
    elif spec.matrix:   # one class on every trainable parameter
        c = replace(c, matrix_comm=_matrix_comm(
            c, model_or_num_params, [{"params": _trainable_params(model_or_num_params)}],
            [spec]) if isinstance(model_or_num_params, torch.nn.Module)
            else balanced_exchange_bytes(c.n_psi, c.big_n) if cfg.stage else 0)
    if cfg.state.state_dtype is not None:   # low-bit moments (planning/state_format.py)
        fmt = StateFormat(cfg.state.state_dtype, cfg.state.block_size)
        if spec.definition is not None:   # a fused element-wise rule's low-bit form
            spec.definition.check_form(fmt.name, "estimate_memory: state_dtype")
            c = replace(c, state_bytes=spec.state_bytes(fmt.name))
        elif not spec.fused:
            raise ValueError(f"estimate_memory: state_dtype applies to the fused AdamW only "
                             f"(got optimizer {spec.name})")
        else:
            c = replace(c, state_format=fmt)
    kinds = dict(_states(c), buffers=_buffers(c), transient=_transient(c))
    device, host, disk = _offload_split(c, kinds)
    comm, across, h2d, disk_io = _traffic(c, disk)
    q = cfg.quantization
    return MemoryEstimate(
        stage=cfg.stage, offload=c.offload, num_params=c.num_params, world_size=world_size,
        params_bytes=kinds["params"], grads_bytes=kinds["grads"], master_bytes=kinds["master"],
        optimizer_states_bytes=kinds["optimizer_states"], buffers_bytes=kinds["buffers"],
        transient_bytes=kinds["transient"], device_bytes=sum(device.values()),
        host_bytes=sum(host.values()), disk_bytes=sum(disk.values()),
        comm_bytes=int(round(comm)), host_device_bytes=h2d, disk_io_bytes=disk_io,
        offload_params=c.offload_params, frozen_numel=c.n_frozen,
        by_location={"device": device, "host": host, "disk": disk},
        shard_size=None if cfg.sharding.shard_size is None else c.big_n,
        comm_across_groups_bytes=int(round(across)),
        quantize_weights=q.weights, quantize_grads=q.grads,
        comm_matrix_bytes=int(round(c.matrix_comm)))


def _trainable_params(model: torch.nn.Module):
    return list({id(p): p for p in model.parameters() if p.requires_grad}.values())


def _with_groups(c: _Counts, model, param_groups, optimizer, optimizer_kwargs) -> _Counts:
    """``c`` with ``param_groups``' own optimizers: state bytes per group, the groups'
    count, the largest group's state for NVMe staging and the owners' exchanges."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError("estimate_memory: param_groups needs the model (an nn.Module), not a "
                         "parameter count")
    if isinstance(param_groups, dict) or not all(isinstance(g, dict) and "params" in g
                                                 for g in param_groups):
        raise TypeError("estimate_memory: param_groups must be a list of dicts with "
                        "'params', as ZeroOptimizer takes them")
    groups = [dict(g, params=list(g["params"])) for g in param_groups]
    specs = []
    for i, g in enumerate(groups):
        opt = g.get("optimizer", optimizer)
        hp = {k: v for k, v in g.items() if k not in ("params", "optimizer")} \
            if "optimizer" in g else dict(optimizer_kwargs or {})
        specs.append(resolve_optimizer(opt, {} if isinstance(opt, str) and
                                       opt.lower() == "adamw" else hp,
                                       where=f"estimate_memory: param_groups[{i}]: "))
    numels = [sum(p.numel() for p in {id(p): p for p in g["params"]}.values()) for g in groups]
    return replace(c, group_states=tuple((s.state_bytes(), n) for s, n in zip(specs, numels)),
                   state_bytes=max(s.state_bytes() for s in specs),
                   rule=any(not s.fused for s in specs), matrix=any(s.matrix for s in specs),
                   matrix_comm=_matrix_comm(c, model, groups, specs))


def _matrix_comm(c: _Counts, model, groups, specs) -> int:
    """The owners' exchanges per step on the optimizer's layout (``matrix_plan.py``; data
    parallel runs every class whole on every rank: none)."""
    if c.cfg.stage == 0:
        return 0
    prec = c.cfg.precision
    pdt, rdt = prec.param_dtype or torch.float32, prec.reduce_dtype or torch.float32
    return matrix_exchange_bytes(model, c.big_n, c.cfg.stage, groups, specs,
                                 param_dtype=pdt, reduce_dtype=rdt,
                                 bucket_bytes=c.cfg.buckets.bucket_bytes,
                                 pooled=c.policy.uses_reduce_pool(pdt, rdt))


def quantized_element_bytes(quantization: QuantizeConfig):
    """``(gradient bytes per element or None, gathered-weight bytes per element or None)``
    sent by the quantized collectives: ``bits/8 + 4/block`` (None: not quantized)."""
    from ...comm.quantized import GRAD_FORMATS, WEIGHT_FORMATS
    per_scale = 4 / quantization.block
    return tuple(None if fmt is None else formats[fmt] / 8 + per_scale for fmt, formats in
                 ((quantization.grads, GRAD_FORMATS), (quantization.weights, WEIGHT_FORMATS)))


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
