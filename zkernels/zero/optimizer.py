"""``ZeroOptimizer``: ZeRO stage 1/2/3 AdamW as a ``torch.optim.Optimizer``.

The class is thin glue ([Note: parameters and state] in ``units.py``): the stage's
:class:`~zkernels.zero.planning.policy.StagePolicy` (``policy.py``) says what is sharded; the
parameter side (``parameters/build.py``) builds the flat units, the engine
(``state/engine.py``) their state records, the gradient strategy (``grad_reducers.py``) their
buckets; a :class:`~zkernels.zero.unit.ZeroUnit` holds one unit's three (``unit.py``: what
happens to unit k). ``step()`` reduces, folds 1/N, the loss scale and the clip coefficient into
one divisor (``clip.py``), then loops over the units: each updates its state and publishes its
parameters. Every op goes through one :class:`~zkernels.ops.OpSet` (``ops_backend=``).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Union

import torch
import torch.nn as nn

from .. import ops as _ops
from ..comm import VolumeMeter, make_metered_comm
from ..comm.hybrid import HybridComm
from ..comm.quantized import Quantization
from .state import state_dict as _state
from .planning.auto import resolve_rung
from .gradients.clip import StepScale, check_max_grad_norm
from .gradients.grad_reducers import make_grad_reducer
from .gradients.nonfinite import NonFiniteGradientError, check_policy
from .gradients.presence import check_unused_grads
from .gradients.precision import MixedPrecision, make_loss_scaler
from .parameters.build import build_parameter_side
from .parameters.groups import FrozenAtBuild, build_param_groups, resolve_param_dtype
from .parameters.load_hooks import ModelLoadHooks
from .parameters.meta_init import agree_seed, check_meta_args
from .parameters.param_wait import ParamGatherWaiter
from .parameters.secondary import attach_secondary_shards
from .parameters.stage3 import GatherSchedule
from .planning.config import ZeroConfig, resolve_stage
from .planning.state_format import group_formats, split_group_formats
from .planning.policy import STAGES, check_parameter_schedule
from .stats import memory_by_location
from .unit import ZeroUnit
from .config_keywords import FROM_CONFIG, read_keywords
from .state.placement import check_offload_dir, make_engine


def _ops_for(device: torch.device, ops_backend: Optional[str]):
    """The :class:`~zkernels.ops.OpSet` every op goes through (``ops_backend=``)."""
    try:
        return _ops.for_device(device, ops_backend, arg_name="ops_backend")
    except RuntimeError as exc:
        raise RuntimeError(f"ops_backend={ops_backend!r}: {exc}") from exc


class ZeroOptimizer(torch.optim.Optimizer):
    """AdamW (or an element-wise ``torch.optim`` class: ``optimizer=``) with optimizer states
    (stage 1), gradients (stage 2) and parameters (stage 3) sharded across ranks.

    Args:
        model: the module to train; its trainable parameters become views of flat buffers
            (and, with ``param_dtype``, change dtype). Frozen parameters stay as they are at
            stages 1-2; stage 3 shards them with their unit (no gradient, no state). Stages
            2-3 install gradient hooks on them; stage 3 also installs forward hooks on its
            units, and between uses a parameter has no storage (read it inside
            ``opt.gathered()``).
        config: None or the run's :class:`~zkernels.ZeroConfig`, the base the keywords
            below override (a keyword naming one of its fields wins; the result is checked
            as a whole): see [Note: config-first constructor] in ``config_keywords.py``.
        stage, param_dtype, and through ``**overrides`` reduce_dtype, offload, offload_dir,
        offload_config, offload_params, bucket_bytes, shard_size, reshard_after_forward,
        quantize_weights, quantize_grads, quantize_block, state_dtype, state_block_size,
        master_dtype: the ZeroConfig's fields by their flat names (``planning/config.py``'s
            ``KEYWORDS``; each is documented on its part there). ``stage`` and
            ``param_dtype`` left out (``FROM_CONFIG``) take the config's value. Default:
            stage 1, pure fp32, no offload.
            A model whose trainable parameters are all bf16 (or all fp16) computes in that
            dtype when ``param_dtype`` is None, with fp32 master shards widened unit by unit
            (see [Note: low-precision models] in ``parameters/groups.py``).
        **overrides: those fields, the run options below (``config_keywords.RUN_OPTIONS``)
            and the optimizer's hyperparameters; a name that is none of these raises
            ``TypeError`` naming the closest one.
        lr, weight_decay, and through ``**overrides`` betas, eps: AdamW hyperparameters
            (defaults for every group; None: 1e-3, (0.9, 0.999), 1e-8, 0.0); with a torch
            class, those given go to it.

        Through ``**overrides`` (run options, then hyperparameters):
        param_groups: optional torch-style groups, e.g. ``[{"params": [...],
            "weight_decay": 0.0}, ...]``; every trainable parameter must be in one. A group's
            ``"optimizer"`` key gives it its own optimizer (its class's defaults apply), a
            ``"state_dtype"`` key its own AdamW state format (``planning/state_format.py``).
        optimizer: ``"adamw"`` (default: the fused AdamW), or an element-wise
            ``torch.optim.Optimizer`` subclass (``torch.optim.SGD``, ...) or its lower-case
            name (``"sgd"``), run on this rank's shard; see [Note: optimizer rules] in
            ``planning/optimizer_spec.py`` for what is refused and why.
        elementwise: declare a class not in ``optimizer_spec.ELEMENTWISE`` element-wise.
        other hyperparameters: the optimizer's own (``momentum=0.9``, ...; a definition's,
            such as AdEMAMix's ``alpha``), checked by it.
        max_grad_norm (named): clip the global gradient norm (across all shards) to this.
        process_group: the data-parallel group (default: the world; none initialized: one
            rank), or a ``DeviceMesh`` (1-D: its group; 2-D: as ``mesh``).
        mesh: a 2-D ``torch.distributed.device_mesh.DeviceMesh`` (dim 0 replicate, dim 1
            shard), as ``fully_shard(mesh=...)`` takes it: hybrid sharding over its groups.
        loss_scale: a :class:`~zkernels.zero.gradients.precision.LossScaleConfig` for fp16's
            dynamic loss scaling (default one).
        memory_budget_bytes: with ``stage="auto"``, the bytes per rank to fit in (default:
            measured free device memory less 10% headroom).
        comm_backend: ``"auto"`` or ``"torch"`` (torch.distributed, CUDA included), or
            ``"nccl"`` (opt-in: the native NCCL engine, CUDA buffers, where ``_C_nccl`` is
            built); see ``zkernels.comm.make_comm``.
        nonfinite: what a step with an inf/NaN gradient does outside fp16's loss scaling:
            ``"skip"`` it on every rank (counted in ``stats()["overflow_skips"]``, logged at
            WARNING) or ``"raise"`` :class:`~zkernels.zero.gradients.nonfinite.NonFiniteGradientError`
            on every rank; see [Note: non-finite gradients outside fp16].
        unused_grads: what a parameter without a gradient this step (unused, never used,
            ``requires_grad`` off) gets: ``"skip"`` (torch.optim's semantics: no update, no
            weight decay, its step count stays) or ``"zero"`` (DDP with
            ``find_unused_parameters``: a zero-gradient update); see [Note: unused
            parameters] in ``gradients/presence.py``.
        timeout: None (the process group's timeout), or a ``datetime.timedelta`` or seconds:
            a collective not done within it (a rank died, raised or is stuck) raises
            ``zkernels.comm.CollectiveError`` naming it instead of waiting on.
        ops_backend: None (``ZKERNELS_BACKEND`` as set at construction, else the best backend
            per op) or ``"reference"``, ``"triton"``, ``"cpp"``: the fused ops' backend, chosen
            once here (see [Note: ops chosen once] in ``zkernels/ops/opset.py``).
        units: stage 3: None (one unit per transformer block: the children of a ModuleList /
            Sequential of one repeated class; the rest is the root unit) or a list of module
            classes and/or submodules; see [Note: stage-3 units] in ``unit_plan.py``.
        check_paths: stage 3: before each all-gather, check that every rank gathers the same
            unit and raise naming it otherwise ([Note: divergent paths] in ``stage3.py``).
        overlap_param_gather: False (default): ``step()`` returns with the parameters
            all-gathered, a complete step. True (stages 1-2): ``step()`` returns with the
            all-gathers in flight and the next forward waits for each unit's gather when the
            first module owning its parameters runs; code that reads parameters between steps
            outside a module's forward or ``state_dict()`` calls :meth:`wait_params` first
            (see [Note: lazy parameter gathers] in ``param_wait.py``).
        device: a model with tensors on the 'meta' device (built under
            ``torch.device("meta")``) is materialized here (``torch.device("cuda", rank)`` or
            ``"cpu"``) unit by unit: at stage 3 each unit's full parameters exist only while it
            is sharded; stages 1-2 keep them (replicated) and only the fp32 state is born
            sharded. Required for a meta model; None otherwise (parameters on a device are
            taken as they are). See [Note: meta-device build] in ``parameters/meta_init.py``.
        param_init: meta models: None (a transformers model's ``_init_weights(module)``,
            else each module's ``reset_parameters()``) or ``param_init(module)`` called on
            each module that had meta tensors. The values do not depend on the world size.

    Attributes:
        config: the :class:`~zkernels.ZeroConfig` it runs (with "auto": the rung chosen).
        policy: the stage's :class:`~zkernels.zero.planning.policy.StagePolicy`.
        ops: the :class:`~zkernels.ops.OpSet` every op goes through.
        units: the :class:`~zkernels.zero.parameters.units.FlatParamUnit` list, in launch order.
        zero_units: each unit's :class:`~zkernels.zero.unit.ZeroUnit` (its step, its state in
            and out), by index.
        frozen_units: stage 3: the frozen parameters' flat units (gathered with their unit,
            no state; see [Note: frozen parameters at stage 3] in ``units.py``); else empty.
        shard_update: the update engine (``state/engine.py``), placed by ``placement.py``;
            its ``states`` are the per-unit
            :class:`~zkernels.zero.state.shard_state.ShardState` records.
        offload: the offload kind (None, "cpu", "nvme"), read from the engine's placement.
        reducer: the gradient strategy.
        schedule: stage 3's :class:`~zkernels.zero.parameters.stage3.GatherSchedule` (None below).
    """

    def __init__(self, model: nn.Module, config: Optional[ZeroConfig] = None, *,
                 stage: Union[int, str] = FROM_CONFIG, lr: Optional[float] = None,
                 weight_decay: Optional[float] = None,
                 param_dtype: Optional[torch.dtype] = FROM_CONFIG,
                 max_grad_norm: Optional[float] = None, **overrides) -> None:
        # Each line is one decision, made by the module that owns it.
        kw = read_keywords(config, overrides, stage=stage,
                           param_dtype=param_dtype)                     # config_keywords.py
        cfg, optimizer_kwargs, o = kw.config, kw.optimizer_kwargs, kw.options
        betas, eps, param_groups = o["betas"], o["eps"], o["param_groups"]
        optimizer, elementwise, loss_scale = o["optimizer"], o["elementwise"], o["loss_scale"]
        process_group, mesh, timeout = o["process_group"], o["mesh"], o["timeout"]
        comm_backend, ops_backend = o["comm_backend"], o["ops_backend"]
        memory_budget_bytes, nonfinite = o["memory_budget_bytes"], o["nonfinite"]
        unused_grads, units, check_paths = o["unused_grads"], o["units"], o["check_paths"]
        overlap_param_gather, device, param_init = (o["overlap_param_gather"], o["device"],
                                                    o["param_init"])
        if resolve_stage(cfg.stage) in (1, 2) and units is not None:
            raise ValueError(f"units= and reshard_after_forward= apply only to stage=3 (the "
                             f"stages that shard parameters), got stage={cfg.stage}")
        check_offload_dir(cfg.offload)                                  # state/placement.py
        meta_device = check_meta_args(model, device, param_init)        # parameters/meta_init
        param_groups, state_keys = split_group_formats(param_groups)   # planning/state_format
        groups, defaults, self.optimizer_specs = build_param_groups(
            model, param_groups, lr, betas, eps, weight_decay, optimizer, optimizer_kwargs,
            elementwise)                                                # parameters/groups.py
        self.state_formats = group_formats(self.optimizer_specs, state_keys,
                                           cfg.state.state_dtype, cfg.state.block_size)
        self._frozen = FrozenAtBuild(model)
        # A bf16 / fp16 model computes in its own dtype ([Note: low-precision models]).
        cfg = cfg.with_param_dtype(resolve_param_dtype(
            [p for g in groups for p in g["params"]],
            {id(p): n for n, p in model.named_parameters()},
            cfg.precision.param_dtype))                                 # parameters/groups.py
        self.max_grad_norm = check_max_grad_norm(max_grad_norm)         # gradients/clip.py
        self.precision = MixedPrecision.build(cfg.precision.param_dtype,
                                              cfg.precision.reduce_dtype)  # gradients/precision
        self.scaler = make_loss_scaler(self.precision, loss_scale)
        self.nonfinite = check_policy(nonfinite)                        # gradients/nonfinite
        self.unused_grads = check_unused_grads(unused_grads)            # gradients/presence
        device = meta_device or next(p for g in groups for p in g["params"]).device
        self.ops = _ops_for(device, ops_backend)                        # zkernels.ops
        # Hybrid sharding: the comm is the shard group's (K ranks), see [Note: hybrid
        # sharding is a group shape] in zkernels/comm/hybrid.py.
        self.meter = VolumeMeter()
        q = cfg.quantization
        quant = Quantization.build(q.grads, q.weights, q.block, comm_backend,
                                   device)                              # comm/quantized.py
        # ZeRO++'s qgZ: reduce-scatters quantized, every other collective exact (one comm for
        # all, so hybrid sharding's cross-group all-reduces launch on any next collective).
        self.comm = quant.grad_comm(make_metered_comm(
            process_group, device, comm_backend, timeout, self.meter,
            shard_size=cfg.sharding.shard_size, mesh=mesh), self.ops)
        self.quantize_grads, self.quantize_weights = quant.grads, quant.weights
        self.quantize_block = quant.block
        # The rung: as asked, or stage="auto"'s choice (planning/auto.py).
        self.config = cfg = resolve_rung(
            cfg, param_groups=groups, world_size=self.comm.world_size,
            memory_budget_bytes=memory_budget_bytes, process_group=process_group, model=model,
            specs=self.optimizer_specs)
        self.stage, self.policy = cfg.stage, STAGES[cfg.stage]
        self.offload_params = cfg.offload.params
        reshard_after_forward = check_parameter_schedule(
            self.policy, cfg.sharding.reshard_after_forward, self.comm.world_size,
            self.offload_params, overlap_param_gather, model)           # planning/policy.py
        self._constructing = True
        super().__init__(groups, defaults)
        self._constructing = False
        # Where the state lives (state/placement.py), then the units that feed it
        # (parameters/build.py); a failure closes the engine's threads and files at once.
        self.shard_update, storage = make_engine(
            cfg.offload.kind, ops=self.ops, device=device, ops_backend=ops_backend,
            offload_dir=cfg.offload.dir, rank=self.comm.rank, world_size=self.comm.world_size,
            offload_config=cfg.offload.config, offload_params=self.offload_params,
            specs=self.optimizer_specs, formats=self.state_formats,
            master_dtype=cfg.state.master_dtype)
        try:
            # A meta model is materialized unit by unit as it is sharded ([Note: meta-device
            # build] in parameters/meta_init.py), from one seed every rank agrees on.
            seed = agree_seed(self.comm, device) if meta_device is not None else None
            self.units, self.frozen_units, gather_units = build_parameter_side(
                self.policy, model, self.param_groups, self.precision.param_dtype,
                self.precision.reduce_dtype, self.comm.world_size, self.comm.rank, self.ops,
                self.shard_update, storage, units=units, bucket_bytes=cfg.buckets.bucket_bytes,
                device=meta_device, param_init=param_init, seed=seed)
            if self.shard_update.resumed:
                self.shard_update.adopt(len(self.units))
        except BaseException:
            self.shard_update.close()
            raise
        if self.shard_update.matrix is not None:   # [Note: whole matrices on owners]
            self.shard_update.matrix.checkpoint_comm = self.checkpoint_comm
        if self.shard_update.resumed:
            # The engine adopted a kept state and rewrote this rank's compute shards from its
            # master: every rank's copy of the full parameters must follow (collective at
            # stages 1-2; at stage 3 publish only drops a stale gathered copy).
            with torch.no_grad():
                self.publish(self.units)
        self._step_scale = StepScale(self.comm, self.shard_update.grad_ops, self.nonfinite,
                                     device, self.units, model)          # gradients/clip.py
        self.reducer = make_grad_reducer(                               # gradients/
            self.policy, self.units, self.comm, self.precision, self.ops,
            grad_sink=self.shard_update.grad_sink)
        self.schedule: Optional[GatherSchedule] = None
        if self.policy.shards_params:                                   # parameters/stage3.py
            # Each unit hooks its parameters and calls its flats' gradient buckets; ZeRO++'s
            # qwZ quantizes the schedule's gathers ([Note: quantized all-gather]).
            self.schedule = GatherSchedule(gather_units, quant.gather_comm(self.comm, self.ops),
                                           reshard_after_forward, check_paths=check_paths,
                                           grad_buckets=self.reducer.buckets,
                                           on_end_backward=self.reducer.end_backward)
            if not isinstance(reshard_after_forward, bool):             # parameters/secondary
                attach_secondary_shards(self.units, self.comm, reshard_after_forward, device,
                                        comm_backend, timeout, self.meter)
        self.zero_units = [ZeroUnit(f, b, self.shard_update, self.param_groups[f.group_index])
                           for f, b in zip(self.units, self.reducer.buckets)]  # unit.py
        self._param_waiter = ParamGatherWaiter(model, self.units) if overlap_param_gather \
            else None                                                   # parameters/param_wait
        self.module = model  # zkernels.checkpoint names parameters and buffers through it
        ModelLoadHooks(self, model)   # model.load_state_dict reaches the shards (load_hooks.py)
        self._model_params = list(model.parameters())
        self._num_steps = 0
        self._overflow_skips = 0
        self._step_was_skipped = False
        self._last_grad_norm: Optional[float] = None
        self._scaled_backward = False
        self._gather_stats = None
        self._buffer_peak = 0

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
        """Clear gradients, as ``torch.optim.Optimizer.zero_grad`` documents: the reduced
        shards are forgotten, and a full ``param.grad`` still held (stages 2-3 free them in
        backward, so only inside ``no_sync`` is one held) becomes None, or zeros with
        ``set_to_none=False``. Stage 1 zeroes its flat buffers either way (``param.grad``
        stays a view of them: backward accumulates straight into the bucket layout)."""
        if not isinstance(set_to_none, bool):
            raise TypeError(f"zero_grad(set_to_none=...) must be a bool, got "
                            f"{type(set_to_none).__name__}")
        self.reducer.zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], torch.Tensor]] = None):
        """Reduce gradients, clip, update this rank's shards, all-gather the parameters.
        Collective: every rank calls it. A step with an inf/NaN gradient on any rank (fp16)
        changes nothing on every rank and halves the loss scale."""
        self._frozen.check()   # before any collective: every rank raises alike
        loss = None
        self._last_grad_norm = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.scaler is not None and not self._scaled_backward:
            raise RuntimeError("param_dtype=torch.float16 uses dynamic loss scaling: call "
                               "opt.backward(loss) instead of loss.backward() before step()")
        if self.schedule is not None:
            self.schedule.check_step()
        self.wait_params()  # the update writes the shards a gather may still be reading
        shards, divisor = self.reducer.finish()
        try:
            grad_scale, skip, self._last_grad_norm = self._step_scale(
                shards, divisor, self.scaler.scale if self.scaler else None,
                self.max_grad_norm, self._num_steps + 1)
        except NonFiniteGradientError:  # counted as a skipped step, then raised
            self._overflow_skips, self._num_steps = self._overflow_skips + 1, self._num_steps + 1
            self._close_step()
            raise
        self._step_was_skipped = skip
        if skip:
            self._overflow_skips += 1
        else:
            self._update(shards, grad_scale, self._live())
        if self.scaler is not None:
            self.scaler.update(skip)
        self._scaled_backward = False
        self._num_steps += 1
        self._close_step()
        return loss

    def _close_step(self) -> None:
        self.meter.close_step()
        self._gather_stats = self.schedule.close_step() if self.schedule is not None else None
        self._buffer_peak = self.reducer.take_buffer_peak()

    def _live(self):
        """Per unit, which parameters have a gradient on some rank (None: all), or None for
        every unit with ``unused_grads="zero"`` ([Note: unused parameters]). Collective."""
        if self.unused_grads == "zero":
            return [None] * len(self.units)
        comm = self.comm
        if isinstance(comm.inner, HybridComm):  # replicas too: metered as all ranks
            self.meter.record("all_reduce", self.reducer.presence.nbytes,
                              comm.inner.world.world_size, "within_group")
            comm = comm.inner.world
        return self.reducer.presence.agree(comm, self.units[0].device)

    def _update(self, shards, grad_scale, live) -> None:
        handles = []
        if self.shard_update.matrix is not None:   # whole matrices, on their owners first
            self.shard_update.matrix.step(self.comm, self.meter, shards, grad_scale, live,
                                          self.param_groups)
        for u in [self.zero_units[f.index] for f in self.shard_update.update_order(self.units)]:
            # Its all-gather runs while the next unit updates.
            h = u.step(shards[u.index], grad_scale, live[u.index], self.comm)
            if self._param_waiter is not None:
                self._param_waiter.add(u.index, h)
            else:
                handles.append(h)
        self.shard_update.finish_step()
        for h in handles:
            h.wait()

    @property
    def offload(self) -> Optional[str]:
        """The offload kind (None, "cpu", "nvme"): the update engine's placement."""
        placement = self.shard_update.placement
        return None if placement == "device" else placement

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last ``step()`` changed nothing because a gradient was inf or NaN (fp16's
        loss scaling, or ``nonfinite="skip"``). Accelerate's optimizers carry the same name, and
        ``transformers.Trainer`` reads it to hold the LR schedule back on a skipped step."""
        return self._step_was_skipped

    @property
    def last_grad_norm(self) -> Optional[float]:
        """The global gradient norm (every shard, before clipping) of the last ``step()``; None
        before the first step and after a step skipped on an inf/NaN gradient. What
        ``clip_grad_norm_`` returns over the full gradients, read from the all-reduce every step
        makes anyway."""
        return self._last_grad_norm

    @contextlib.contextmanager
    def gathered(self, module: Optional[nn.Module] = None) -> Iterator[None]:
        """Full parameters inside the block, for evaluation, generation or export: at stage 3
        every unit holding a parameter of ``module`` (default: the whole model) is gathered on
        entry and freed on exit (forwards inside gather nothing again); at stages 1-2 the
        parameters are always full and this does nothing. Collective at stage 3: every rank
        enters it. Writes to the gathered parameters are not kept (the shards are the state).

        Raises:
            ValueError: ``module`` is not part of the model.
        """
        if module is not None and not any(m is module for m in self.module.modules()):
            raise ValueError(f"gathered(module=...): the {type(module).__name__} given is not "
                             f"a submodule of the optimizer's model")
        if self.schedule is None:
            self.wait_params()  # overlap_param_gather: the last step's gathers land first
            yield
            return
        ids = None if module is None else {id(p) for p in module.parameters()}
        units = [u for u in self.schedule.units
                 if u.flats and (ids is None or (u.param_ids | u.frozen_ids) & ids)]
        with self.schedule.gathered(units):
            yield

    def wait_params(self) -> None:
        """Wait for the parameter all-gathers still in flight (``overlap_param_gather=True``;
        a no-op otherwise or when none is): afterwards every parameter holds the last step's
        values."""
        if self._param_waiter is not None:
            self._param_waiter.wait_all()

    def close(self, keep_files: bool = False):
        """Release what the update engine holds outside the device: the copy thread or
        stream, the NVMe files and their folder (idempotent; also runs when the optimizer is
        garbage collected). The optimizer cannot step afterwards.

        Args:
            keep_files: NVMe offload only: keep the run folder (with a manifest) for
                ``OffloadConfig(resume_dir=...)`` (with ``nvme_master``; refused by name
                for Muon and Adafactor, whose shard masters live in host RAM).

        Returns:
            the kept folder (NVMe with ``keep_files``), else None.
        """
        return self.shard_update.close(keep_files=keep_files)

    def state_dict(self) -> dict:
        """This rank's optimizer state (see ``zkernels/zero/state/state_dict.py``)."""
        self.wait_params()
        return _state.state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a state from :meth:`state_dict` (same world size). Collective."""
        self.wait_params()
        _state.load_state_dict(self, state_dict)

    # -- the checkpoint view ([Note: the declared checkpoint view] in checkpoint_view.py) --

    @property
    def checkpoint_comm(self):
        """The shard group's collectives, unmetered (checkpoint traffic is not a step's)."""
        return self.comm.inner

    @property
    def checkpoint_world(self):
        """Every rank's collectives, unmetered (hybrid sharding: more than the shard group)."""
        comm = self.comm.inner
        return comm.world if isinstance(comm, HybridComm) else comm

    @property
    def replica_rank(self) -> int:
        """This rank's replica (hybrid sharding's group index; 0 otherwise)."""
        comm = self.comm.inner
        return comm.replica_rank if isinstance(comm, HybridComm) else 0

    @property
    def param_dtype(self) -> torch.dtype:
        return self.precision.param_dtype

    @property
    def optimizer_names(self):
        """Each param group's optimizer: "adamw" (the fused AdamW) or the torch class name."""
        return [s.name for s in self.optimizer_specs]

    def publish(self, units) -> None:
        """Every rank's parameters follow these units' shards (collective, unmetered)."""
        for h in [u.gather.publish(self.checkpoint_comm) for u in units]:
            h.wait()

    def counters(self) -> dict:
        return {"num_steps": self._num_steps, "overflow_skips": self._overflow_skips,
                "loss_scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_counters(self, saved: dict) -> None:
        self._num_steps = int(saved["num_steps"])
        self._overflow_skips = int(saved["overflow_skips"])
        if self.scaler is not None and saved.get("loss_scaler") is not None:
            self.scaler.load_state_dict(saved["loss_scaler"])

    def sharded_state_dict_keys(self):
        """Stage 3: ``module.state_dict()`` lists the sharded parameters without gathering
        them (the caller reads their values from the shards); a no-op below stage 3."""
        if self.schedule is None:
            return contextlib.nullcontext()
        return self.schedule.sharded_state_dict_keys()

    def stats(self) -> dict:
        """Step counters, bytes this rank sent in the last step, bytes it holds by kind.

        Returns:
            ``{"step": step() calls, "overflow_skips": skipped steps, "loss_scale": float or
            None, "comm_bytes": {"reduce_scatter", "all_gather", "all_reduce", "total",
            "within_group", "across_groups"},
            "memory_bytes": {"params", "grads", "master", "optimizer_states", "buffers",
            "total"}, "step_peak_bytes": {"buffers", "gathered_params", "total"},
            "memory_location_bytes": {"device", "host", "disk"},
            "memory_bytes_by_location": {"device", "host", "disk": {kind: bytes, "total"}},
            "offload": None or
            {"kind", "device", "host", "disk", "update_s", "host_to_device_bytes",
            "device_to_host_bytes", "disk_read_bytes", "disk_write_bytes", ...}}``.
            ``comm_bytes`` counts the bytes really sent: with ``quantize_grads`` the
            ``reduce_scatter`` bytes are the all-to-all's codes plus scales, with
            ``quantize_weights`` stage 3's ``all_gather`` bytes too ([Note: ring volume]).
            ``comm_bytes``' ``within_group`` and ``across_groups`` split its total by where
            it went (hybrid sharding: the cross-group all-reduces; otherwise all within).
            ``memory_bytes`` counts each kind wherever it lives (device, host RAM or disk);
            ``memory_location_bytes`` splits the total by location: host RAM is what the
            offload strategy allocated there, disk the measured sizes of its files;
            ``memory_bytes_by_location`` gives each kind in each place. The offload
            entry adds the last step's transfers: bytes each way, the offloaded update's
            host time, and how much of the gradient copies was hidden behind backward; NVMe
            adds the disk bytes and I/O time (``disk_io_s``, ``io_exposed_s``,
            ``disk_io_hidden_s``); ``offload_params`` the parameter shards brought in at the
            gathers (``param_host_to_device_bytes``, ``_s``, ``_exposed_s``, ``_hidden_s``;
            on NVMe also ``param_disk_read_bytes``, ``param_disk_read_s``, the reads the
            gathers waited for, ``param_disk_write_bytes``, the update's writes, and
            ``param_bounce_bytes``, the host bounces they pass through).
            Memory is measured from the storages held: params are the flat
            compute buffers (and the frozen parameters: whole at stages 1-2, their shards at
            stage 3); grads the stage-1 flat gradient
            buffers or the stage-2 fp32 gradient shards (plus any full gradient still held,
            e.g. inside ``no_sync``); master the fp32 master shards (0 in pure fp32);
            buffers the pooled reduce buffers held now (stage 3 holds them only while
            gradients are in flight, so 0 once backward has returned and between steps:
            [Note: reduce buffers end with backward]; called between backward and ``step()``,
            ``memory_bytes`` is what the rank holds after backward, 16Ψ/N in fp32 at stage 3).
            ``step_peak_bytes`` is the last step's peak beside that: the most reduce-buffer
            bytes held at once and stage 3's most gathered parameter bytes at once (0 below
            stage 3), and ``total``, what is held now plus what lived only inside the step
            (the peak ``estimate_memory``'s ``device_bytes`` predicts; stage 1's reduced
            shards during ``step()`` are not measured). Stage 2 keeps its gradient shard in fp32
            whatever the reduce dtype, so bf16 stage 2 holds 2Ψ + 16Ψ/N, not the paper's
            2Ψ + 14Ψ/N (docs/design.md#by-kind).
        """
        grads = list(self.reducer.held_grads()) + [p.grad for p in self._model_params]
        upd = self.shard_update
        held = upd.held()
        device = {"params": [t for u in self.units + self.frozen_units for t in u.gather.held()]
                  + self._model_params,
                  "grads": grads, "master": held["master"],
                  "optimizer_states": held["optimizer_states"],
                  "buffers": self.reducer.held_buffers()}
        mem, where, split = memory_by_location(device, upd.held_host(), upd.disk_bytes())
        offload = None
        if self.offload is not None:
            offload = {"kind": self.offload, **where, **upd.last_step}
        gathered = self._gather_stats["peak_gathered_bytes"] if self._gather_stats else 0
        transient = max(0, self._buffer_peak - mem["buffers"]) + gathered
        peak = {"buffers": self._buffer_peak, "gathered_params": gathered,
                "total": mem["total"] + transient}
        out = {"step": self._num_steps, "overflow_skips": self._overflow_skips,
               "loss_scale": self.scaler.scale if self.scaler is not None else None,
               "comm_bytes": {**self.meter.last_step(), **self.meter.last_step_scopes()},
               "memory_bytes": mem, "step_peak_bytes": peak,
               "memory_location_bytes": where, "memory_bytes_by_location": split,
               "offload": offload}
        if self.schedule is not None:
            last = self._gather_stats or {"all_gathers": 0, "peak_gathered_bytes": 0}
            out["gather"] = {**last, "gathered_bytes": self.schedule.live_bytes(),
                             "limit_bytes": self.schedule.limit_bytes,
                             "units": [u.name for u in self.schedule.units if u.flats],
                             "reshard_after_forward": (self.schedule.reshard_to or
                                                       self.schedule.reshard_after_forward)}
        return out

