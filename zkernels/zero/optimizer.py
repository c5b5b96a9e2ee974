"""``ZeroOptimizer``: ZeRO stage 1/2 AdamW as a ``torch.optim.Optimizer``.

The class is thin glue (see [Note: parameters and state] in ``units.py``): the stage's
:class:`~zkernels.zero.policy.StagePolicy` (``policy.py``) says what is sharded; flat parameter
units (``units.py``, cut by ``buckets.py``) own the compute copy through their gather policy;
the update strategy (``update.py``) owns the ShardStates (master, moments) and their
placement; a gradient strategy (``grad_reducers.py``, chosen once from the stage) delivers this
rank's reduced gradient shard per unit; ``clip.py`` folds the 1/N, the loss scale and the clip
coefficient into one divisor; then one fused AdamW per unit shard and each unit's gather
policy's ``publish`` (one all-gather per unit at stages 1-2) rebuild the parameters. Every op
goes through one :class:`~zkernels.ops.OpSet` chosen at construction (``ops_backend=``).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.nn as nn

from .. import ops as _ops
from ..comm import MeteredComm, VolumeMeter, make_comm
from . import state as _state
from .auto import resolve_auto_stage
from .buckets import align_numel, bucket_capacities, plan_buckets
from .clip import grad_scale_and_overflow
from .grad_reducers import make_grad_reducer
from .param_wait import ParamGatherWaiter
from .params import resolve_param_groups
from .policy import OFFLOADS, STAGES, implemented_stages
from .precision import LossScaleConfig, LossScaler, MixedPrecision
from .stats import memory_bytes
from .units import build_replicated_unit, param_names
from .update import DeviceUpdate


def resolve_stage(stage) -> int:
    """An explicit ZeRO stage, one the registry (``policy.STAGES``) marks implemented.
    ``"auto"`` is resolved by the constructor once the world size is known (``auto.py``).

    Raises:
        ValueError: not an implemented stage (the message says when a known stage is not
            available in this version).
    """
    implemented = implemented_stages()
    if isinstance(stage, bool) or stage not in implemented:
        known = (not isinstance(stage, bool) and isinstance(stage, int) and stage in STAGES
                 and stage > 0)
        extra = f" (stage {stage} is not available in this version)" if known else ""
        raise ValueError(f"stage must be one of {implemented} or 'auto', got {stage!r}{extra}")
    return int(stage)


def _check_hparams(where: str, lr, betas, eps, weight_decay) -> None:
    if not float(lr) >= 0.0:
        raise ValueError(f"{where}lr must be >= 0, got {lr}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2
            and all(0.0 <= float(b) < 1.0 for b in betas)):
        raise ValueError(f"{where}betas must be a pair in [0, 1), got {betas!r}")
    if not float(eps) >= 0.0:
        raise ValueError(f"{where}eps must be >= 0, got {eps}")
    if not float(weight_decay) >= 0.0:
        raise ValueError(f"{where}weight_decay must be >= 0, got {weight_decay}")


class ZeroOptimizer(torch.optim.Optimizer):
    """AdamW with optimizer states (stage 1) and gradients (stage 2) sharded across ranks.

    Args:
        model: the module to train; its trainable parameters become views of flat buffers
            (and, with ``param_dtype``, change dtype). Stage 2 installs gradient hooks on them.
        stage: 1, 2 or "auto" (the lowest stage whose estimate fits the device, see
            ``zkernels/zero/auto.py``; logs its choice at INFO).
        lr, betas, eps, weight_decay: AdamW hyperparameters (defaults for every group).
        param_groups: optional torch-style groups, e.g. ``[{"params": [...],
            "weight_decay": 0.0}, ...]``; every trainable parameter must be in one.
        param_dtype: None (pure fp32) or torch.bfloat16 / torch.float16 for the compute copy;
            the fp32 master shard lives with the optimizer.
        reduce_dtype: dtype of the gradient reduction (default fp32).
        offload, offload_dir: must be None (offload comes with a later issue).
        bucket_bytes: reduce-buffer bytes per bucket; a larger parameter gets its own bucket.
            None (default): sized from the model: where buckets cost reduce buffers (stage 2),
            a small first bucket then buckets of about 1/6 of the model; where they do not
            (stage 1 reducing in place), DDP's 1 MiB then 25 MiB (see [Note: buckets sized
            from the model] in ``buckets.py``).
        max_grad_norm: clip the global gradient norm (across all shards) to this.
        process_group: the data-parallel group (default: the world; none initialized: one
            rank).
        loss_scale: :class:`LossScaleConfig` for fp16's dynamic loss scaling (default one).
        memory_budget_bytes: with ``stage="auto"``, the bytes per rank to fit in (default:
            measured free device memory less 10% headroom).
        comm_backend: ``"auto"`` (the native NCCL engine for CUDA buffers where it is built,
            torch.distributed otherwise), ``"torch"`` or ``"nccl"``; see
            ``zkernels.comm.make_comm``.
        ops_backend: None (``ZKERNELS_BACKEND`` as set at construction, else the best backend
            per op) or ``"reference"``, ``"triton"``, ``"cpp"``: the fused ops' backend, chosen
            once here (see [Note: ops chosen once] in ``zkernels/ops/opset.py``).
        overlap_param_gather: False (default): ``step()`` returns with the parameters
            all-gathered, a complete step. True (stages 1-2): ``step()`` returns with the
            all-gathers in flight and the next forward waits for each unit's gather when the
            first module owning its parameters runs; code that reads parameters between steps
            outside a module's forward or ``state_dict()`` calls :meth:`wait_params` first
            (see [Note: lazy parameter gathers] in ``param_wait.py``).

    Attributes:
        policy: the stage's :class:`~zkernels.zero.policy.StagePolicy`.
        ops: the :class:`~zkernels.ops.OpSet` every op goes through.
        units: the :class:`~zkernels.zero.units.FlatParamUnit` list, in launch order.
        shard_update: the update strategy (:class:`~zkernels.zero.update.DeviceUpdate`); its
            ``states`` are the per-unit :class:`~zkernels.zero.shard_state.ShardState`.
        reducer: the gradient strategy.
    """

    def __init__(self, model: nn.Module, stage=1, lr: float = 1e-3,
                 betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, param_groups: Optional[Sequence[dict]] = None,
                 param_dtype: Optional[torch.dtype] = None,
                 reduce_dtype: Optional[torch.dtype] = None, offload=None, offload_dir=None,
                 bucket_bytes: Optional[int] = None, max_grad_norm: Optional[float] = None,
                 process_group=None, loss_scale: Optional[LossScaleConfig] = None,
                 memory_budget_bytes: Optional[int] = None, comm_backend: str = "auto",
                 ops_backend: Optional[str] = None, overlap_param_gather: bool = False) -> None:
        # The registry (policy.OFFLOADS) says which kinds run; an offload strategy plugs in as
        # the update strategy (update.py) when its kind is flipped to implemented.
        if offload is not None and not (isinstance(offload, str) and offload in OFFLOADS
                                        and OFFLOADS[offload].implemented):
            raise NotImplementedError(f"offload={offload!r} is not supported yet (CPU/NVMe "
                                      f"offload comes with a later issue): pass offload=None")
        if offload_dir is not None:
            raise NotImplementedError(f"offload_dir={offload_dir!r} is not supported yet "
                                      f"(offload comes with a later issue): pass None")
        auto = isinstance(stage, str) and stage == "auto"
        if memory_budget_bytes is not None and not auto:
            raise ValueError(f"memory_budget_bytes applies only to stage='auto', got "
                             f"stage={stage!r}")
        self.stage = None if auto else resolve_stage(stage)
        _check_hparams("", lr, betas, eps, weight_decay)
        if max_grad_norm is not None and not float(max_grad_norm) > 0.0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
        self.precision = MixedPrecision.build(param_dtype, reduce_dtype)
        if loss_scale is not None and not self.precision.needs_loss_scaling:
            raise ValueError("loss_scale applies only to param_dtype=torch.float16")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        groups = resolve_param_groups(model, param_groups, defaults)
        for i, g in enumerate(groups):
            _check_hparams(f"param_groups[{i}]: ", g["lr"], g["betas"], g["eps"],
                           g["weight_decay"])
        device = groups[0]["params"][0].device
        try:
            self.ops = _ops.for_device(device, ops_backend, arg_name="ops_backend")
        except RuntimeError as exc:
            raise RuntimeError(f"ops_backend={ops_backend!r}: {exc}") from exc
        self.meter = VolumeMeter()
        self.comm = MeteredComm(make_comm(process_group, device, comm_backend), self.meter)
        n = self.comm.world_size
        if auto:
            self.stage = resolve_auto_stage(
                [p for g in groups for p in g["params"]], world_size=n,
                param_dtype=param_dtype, reduce_dtype=reduce_dtype, bucket_bytes=bucket_bytes,
                memory_budget_bytes=memory_budget_bytes, group=process_group,
                num_param_groups=len(groups))
        self.policy = STAGES[self.stage]
        align = align_numel(self.precision.param_dtype, self.precision.reduce_dtype,
                            torch.float32)
        num_trainable = sum(p.numel() for p in {id(p): p for g in groups
                                                for p in g["params"]}.values())
        first_capacity, capacity = bucket_capacities(
            bucket_bytes, num_trainable, self.precision.reduce_dtype, n, align,
            pooled=self.policy.uses_reduce_pool(self.precision.param_dtype,
                                                self.precision.reduce_dtype))
        self._constructing = True
        super().__init__(groups, defaults)
        self._constructing = False
        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        ordered = [(group_of[id(p)], p) for p in model.parameters() if id(p) in group_of]
        names = param_names(model)
        self.shard_update = DeviceUpdate(self.ops)
        self.units = []
        for i, (gi, ps, lay) in enumerate(plan_buckets(ordered, capacity, n, align,
                                                       first_capacity)):
            unit, initial_master = build_replicated_unit(
                i, gi, ps, names, lay, self.comm.rank, self.precision.param_dtype, self.ops)
            self.shard_update.init_state(unit, initial_master)
            self.units.append(unit)
            del initial_master  # the full fp32 copy goes before the next unit is built
        self.reducer = make_grad_reducer(self.policy, self.units, self.comm, self.precision,
                                         self.ops)
        if not isinstance(overlap_param_gather, bool):
            raise TypeError(f"overlap_param_gather must be a bool, got "
                            f"{type(overlap_param_gather).__name__}")
        if overlap_param_gather and self.policy.shards_params:
            raise ValueError(f"overlap_param_gather applies to stages 1-2 (stage "
                             f"{self.stage} gathers each unit before its forward anyway)")
        self._param_waiter = ParamGatherWaiter(model, self.units) if overlap_param_gather \
            else None
        self.scaler = (LossScaler(loss_scale or LossScaleConfig())
                       if self.precision.needs_loss_scaling else None)
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self._model_params = list(model.parameters())
        self._num_steps = 0
        self._overflow_skips = 0
        self._scaled_backward = False

    def add_param_group(self, param_group: dict) -> None:
        if not getattr(self, "_constructing", False):
            raise RuntimeError("ZeroOptimizer lays out its units at construction: pass every "
                               "param group to the constructor (param_groups=...)")
        super().add_param_group(param_group)

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``loss.backward()``, multiplied by the loss scale first when fp16 needs one."""
        if self.scaler is not None:
            loss = loss * self.scaler.scale
            self._scaled_backward = True
        loss.backward(**kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside skip communication (see
        [Note: gradient accumulation] in grad_reducers.py)."""
        previous, self.reducer.sync = self.reducer.sync, False
        try:
            yield
        finally:
            self.reducer.sync = previous

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients. Stage 1 zeroes its flat buffers (``param.grad`` stays a view of
        them whatever ``set_to_none`` says); stage 2 sets ``param.grad`` to None."""
        self.reducer.zero_grad()

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], torch.Tensor]] = None):
        """Reduce gradients, clip, update this rank's shards, all-gather the parameters.
        Collective: every rank calls it. A step with an inf/NaN gradient on any rank (fp16)
        changes nothing on every rank and halves the loss scale."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.scaler is not None and not self._scaled_backward:
            raise RuntimeError("param_dtype=torch.float16 uses dynamic loss scaling: call "
                               "opt.backward(loss) instead of loss.backward() before step()")
        self.wait_params()  # the update writes the shards a gather may still be reading
        shards, divisor = self.reducer.finish()
        grad_scale, skip = grad_scale_and_overflow(
            shards, self.comm, divisor, self.scaler.scale if self.scaler else None,
            self.max_grad_norm, self.ops)
        if skip:
            self._overflow_skips += 1
        else:
            self._update(shards, grad_scale)
        if self.scaler is not None:
            self.scaler.update(skip)
        self._scaled_backward = False
        self._num_steps += 1
        self.meter.close_step()
        return loss

    def _update(self, shards, grad_scale) -> None:
        # Forward order (units are in backward order), so the gathers land in the order the
        # next forward needs them (see [Note: lazy parameter gathers] in param_wait.py).
        handles = []
        for u in reversed(self.units):
            self.shard_update.update(u, shards[u.index], self.param_groups[u.group_index],
                                     grad_scale)
            # Gather this unit while the next one updates.
            h = u.gather.publish(self.comm)
            if self._param_waiter is not None:
                self._param_waiter.add(u.index, h)
            else:
                handles.append(h)
        for h in handles:
            h.wait()

    def wait_params(self) -> None:
        """Wait for the parameter all-gathers still in flight (``overlap_param_gather=True``;
        a no-op otherwise or when none is): afterwards every parameter holds the last step's
        values."""
        if self._param_waiter is not None:
            self._param_waiter.wait_all()

    def state_dict(self) -> dict:
        """This rank's optimizer state (see ``zkernels/zero/state.py``)."""
        self.wait_params()
        return _state.state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a state from :meth:`state_dict` (same world size). Collective."""
        self.wait_params()
        _state.load_state_dict(self, state_dict)

    def stats(self) -> dict:
        """Step counters, bytes this rank sent in the last step, bytes it holds by kind.

        Returns:
            ``{"step": step() calls, "overflow_skips": skipped steps, "loss_scale": float or
            None, "comm_bytes": {"reduce_scatter", "all_gather", "all_reduce", "total"},
            "memory_bytes": {"params", "grads", "master", "optimizer_states", "buffers",
            "total"}}``. Memory is measured from the storages held: params are the flat
            compute buffers (and any frozen parameters); grads the stage-1 flat gradient
            buffers or the stage-2 fp32 gradient shards (plus any full gradient still held,
            e.g. inside ``no_sync``); master the fp32 master shards (0 in pure fp32);
            buffers the pooled reduce buffers. Stage 2 keeps its gradient shard in fp32
            whatever the reduce dtype, so bf16 stage 2 holds 2Ψ + 16Ψ/N, not DESIGN.md's
            2Ψ + 14Ψ/N.
        """
        grads = list(self.reducer.held_grads()) + [p.grad for p in self._model_params]
        held = self.shard_update.held()
        mem = memory_bytes({
            "params": self._model_params,
            "grads": grads,
            "master": held["master"],
            "optimizer_states": held["optimizer_states"],
            "buffers": self.reducer.held_buffers(),
        })
        return {"step": self._num_steps, "overflow_skips": self._overflow_skips,
                "loss_scale": self.scaler.scale if self.scaler is not None else None,
                "comm_bytes": self.meter.last_step(), "memory_bytes": mem}
