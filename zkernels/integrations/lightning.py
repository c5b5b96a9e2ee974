"""Lightning's ``Trainer`` at any ZeRO rung: :class:`ZeroStrategy`.

    from zkernels.integrations.lightning import ZeroStrategy

    trainer = lightning.Trainer(strategy=ZeroStrategy(stage=3), accelerator="cpu", devices=2,
                                precision="bf16-mixed", accumulate_grad_batches=2,
                                gradient_clip_val=1.0)
    trainer.fit(module)                  # configure_optimizers: AdamW, SGD, ... (torch.optim)

Needs ``lightning`` (``pip install zkernels[lightning]``); importing this module without it
raises ImportError saying so. ``ZeroStrategy(stage=..., **options)`` takes
:class:`~zkernels.ZeroOptimizer`'s arguments besides those Lightning owns (see
[Note: what ZeroStrategy takes from Lightning]).

[Note: what ZeroStrategy takes from Lightning]
It subclasses ``DDPStrategy`` as Lightning's own ``DeepSpeedStrategy`` does: the same
launchers, cluster environments, process group and distributed sampler; what changes:
- No DDP wrapper. ``setup`` runs ``configure_optimizers``, reads the optimizer it returns
  and builds a ZeroOptimizer over the LightningModule in its place (the model's parameters
  become views of flat buffers, sharded at stage 3). One optimizer: a ``torch.optim.AdamW``
  (or ``Adam`` without L2 weight decay: the same update) whose groups the fused AdamW
  computes runs as it (each group's ``lr``, ``betas``, ``eps`` and ``weight_decay`` carry
  over); any other ``torch.optim`` class (SGD, Adam with L2 decay, AdamW with ``amsgrad``,
  RMSprop, ...) runs itself on the shards with each group's keywords (ZeroOptimizer's
  ``optimizer=<class>``; element-wise classes only, others refused by name; declare one of
  your own with ``ZeroStrategy(elementwise=True)``). Any other key a scheduler put in a group
  (``initial_lr``, ...) carries over.
- LR schedulers from ``configure_optimizers`` keep working: each is re-pointed at the
  ZeroOptimizer (it sets ``param_groups[i]["lr"]``, which ``step()`` reads).
- ``gradient_clip_val`` with ``gradient_clip_algorithm="norm"`` is ``max_grad_norm``: the
  global norm across shards, clipped inside ``step()``; ``"value"`` is refused (as
  DeepSpeedStrategy refuses it).
- ``accumulate_grad_batches``: Lightning runs the micro-steps before the last under
  ``block_backward_sync``, which is ``opt.no_sync()`` here; Lightning scales the loss.
- Precision (``Trainer(precision=...)``) becomes :class:`ZeroPrecision`: "32-true" (the
  default) trains in fp32; "bf16-mixed" and "16-mixed" are ``param_dtype`` bf16 / fp16 with
  fp32 master shards, as DeepSpeed reads them: the model's parameters are bf16/fp16 (no
  autocast, floating inputs cast to that dtype) and "16-mixed" scales the loss dynamically
  (``opt.backward``; ``loss_scale=LossScaleConfig(...)`` tunes it). "-true" half precision
  (no fp32 master) and "64-true" are refused by name. Backward is ``opt.backward(loss)``,
  so an overridden ``LightningModule.backward`` is not called (as under DeepSpeed).
- Checkpoints (``trainer.save_checkpoint``, ``ModelCheckpoint``) are ``zkernels.checkpoint``
  folders at the checkpoint's path (each rank writes its shards; "epoch=0-step=4.ckpt" is a
  folder), Lightning's own state (loops, callbacks, LR schedulers, hyper-parameters) stored
  in it as ``model_extra`` (nothing is pickled). ``trainer.fit(ckpt_path=folder)`` restores
  masters, moments, step counts and the loss scale, at any world size and stage. Such a
  folder holds no ``state_dict`` for ``LightningModule.load_from_checkpoint``: consolidate
  it (``python -m zkernels checkpoint consolidate``) for the weights. ``save_weights_only``
  still saves the optimizer state (the shards are the weights).
- ``validate``/``test``/``predict`` outside ``fit`` run the model as it is (no optimizer,
  no sharding); loading a ZeroStrategy checkpoint there is refused.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
from typing import Any, Callable, Dict, Mapping, Optional

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities import GradClipAlgorithmType
except ImportError as exc:   # lightning is an extra: say which one
    raise ImportError("zkernels.integrations.lightning needs lightning: pip install "
                      "'zkernels[lightning]' (or pip install lightning)") from exc

from .. import checkpoint as zk_checkpoint
from ..zero import ZeroOptimizer
from ..zero.config_keywords import KEYWORDS as ZERO_KEYWORDS
from ..zero.planning.config import CONFIG_KWARGS, ZeroConfig
from ..zero.planning.optimizer_spec import resolve_optimizer

LIGHTNING_STATE = "lightning"   # the model_extra key holding Lightning's checkpoint dict
_PRECISIONS = {"32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
_PRECISION_ALIASES = {"32": "32-true", 32: "32-true", "bf16": "bf16-mixed",
                      "16": "16-mixed", 16: "16-mixed"}
# ZeroOptimizer arguments that Lightning owns (see the Note above), and where they come from.
_OWNED = {"model": "the LightningModule", "lr": "configure_optimizers",
          "optimizer": "configure_optimizers",
          "betas": "configure_optimizers", "eps": "configure_optimizers",
          "weight_decay": "configure_optimizers", "param_groups": "configure_optimizers",
          "max_grad_norm": "Trainer(gradient_clip_val=...)",
          "param_dtype": "Trainer(precision=...)", "process_group": "the strategy's world",
          "config": "ZeroStrategy's keywords"}
_ZERO_KWARGS = sorted(ZERO_KEYWORDS - {"stage"})
# torch.optim.Adam(W) group keys and the values ZeroOptimizer's update matches.
_MUST_BE = {"amsgrad": False, "maximize": False, "capturable": False, "differentiable": False}
_IGNORED = ("foreach", "fused", "params", "decoupled_weight_decay")   # no effect on the math
_HPARAMS = ("lr", "betas", "eps", "weight_decay")


def _fused_adamw_fits(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is an AdamW (or an Adam without L2 decay) whose every group
    the fused AdamW computes: then that runs (its speed, bytes and checkpoints)."""
    kind = type(optimizer)
    if kind not in (torch.optim.AdamW, torch.optim.Adam):
        return False
    for g in optimizer.param_groups:
        if any(bool(g.get(key, want)) != want for key, want in _MUST_BE.items()):
            return False
        decoupled = kind is torch.optim.AdamW or g.get("decoupled_weight_decay", False)
        if not decoupled and g["weight_decay"] != 0:
            return False
    return True


def class_keys(cls: type) -> set:
    """The keywords ``cls.__init__`` takes besides ``params``: a torch class's group keys."""
    return {n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "params")}


def zero_param_groups(optimizer: torch.optim.Optimizer, elementwise: bool = False) -> list:
    """``optimizer``'s param groups as ZeroOptimizer ``param_groups`` (hyper-parameters and
    the keys a scheduler added). An AdamW (or Adam without L2 decay) the fused update computes
    runs as the fused AdamW; any other ``torch.optim`` class runs itself on the shards: each
    group gets ``"optimizer": <class>`` and the group's keywords (ZeroOptimizer takes an
    element-wise class: [docs/training.md](optimizers); ``elementwise`` declares one of
    your own).

    Raises:
        TypeError: not a ``torch.optim.Optimizer``.
        ValueError: a class ZeroOptimizer refuses (LBFGS, SparseAdam, a class not known to be
            element-wise ...), naming it and why; a tensor ``lr``.
    """
    kind = type(optimizer)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"ZeroStrategy: configure_optimizers must return a torch.optim."
                        f"Optimizer, got {kind.__module__}.{kind.__name__}")
    fused = _fused_adamw_fits(optimizer)
    if not fused:   # the class's own checks, by name, before any rank builds anything
        resolve_optimizer(kind, {}, elementwise=elementwise, where="ZeroStrategy: ")
    groups = []
    for i, g in enumerate(optimizer.param_groups):
        if isinstance(g["lr"], torch.Tensor):
            raise ValueError(f"ZeroStrategy: param_groups[{i}] has a tensor lr; give a float")
        if fused:
            group = {k: v for k, v in g.items() if k not in _MUST_BE and k not in _IGNORED}
            group["betas"] = tuple(g["betas"])
        else:
            group = {k: v for k, v in g.items() if k != "params"}
            group["optimizer"] = kind
        group["params"] = list(g["params"])
        groups.append(group)
    return groups


def _group_keys(group: dict) -> tuple:
    """The keys of a :func:`zero_param_groups` group that ZeroOptimizer takes; the others
    (``initial_lr`` and what else a scheduler keeps) are set on its groups afterwards."""
    cls = group.get("optimizer")
    if cls is None:
        return _HPARAMS + ("params",)
    return tuple(sorted(class_keys(cls))) + ("params", "optimizer")


def _track_step_for_scheduler(opt: ZeroOptimizer) -> None:
    """What ``torch.optim.lr_scheduler.LRScheduler.__init__`` does to the optimizer it is
    built on (mark ``step`` wrapped, note each call), so a scheduler re-pointed at ``opt``
    does not warn that ``step()`` was overridden or never called."""
    if hasattr(opt.step, "_wrapped_by_lr_sched"):
        return
    step = opt.step

    @functools.wraps(step)
    def wrapper(*args, **kwargs):
        opt._opt_called = True
        return step(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    opt.step = wrapper


class ZeroPrecision(Precision):
    """Lightning's precision setting as a ZeroOptimizer's ``param_dtype`` (see [Note: what
    ZeroStrategy takes from Lightning]): no autocast, no GradScaler; backward is
    ``opt.backward`` (fp16's loss scale) and clipping is the optimizer's.

    Args:
        precision: "32-true", "bf16-mixed" or "16-mixed".
    """

    def __init__(self, precision: str = "32-true") -> None:
        precision = _PRECISION_ALIASES.get(precision, precision)
        if precision not in _PRECISIONS:
            raise ValueError(f"ZeroStrategy: precision={precision!r} is not supported; use one of "
                             f"{sorted(_PRECISIONS)} (bf16/fp16 compute with fp32 master shards; "
                             f"'-true' half precision has no fp32 master)")
        self.precision = precision

    @property
    def param_dtype(self) -> Optional[torch.dtype]:
        return _PRECISIONS[self.precision]

    def convert_input(self, data: Any) -> Any:
        dtype = self.param_dtype
        if dtype is None:
            return data
        from lightning.fabric.utilities.apply_func import apply_to_collection
        return apply_to_collection(data, torch.Tensor, lambda t: t.to(dtype)
                                   if torch.is_floating_point(t) else t)

    def backward(self, tensor: torch.Tensor, model: "pl.LightningModule", optimizer,
                 *args: Any, **kwargs: Any) -> None:
        zero_optimizer(model.trainer.strategy).backward(tensor, *args, **kwargs)

    def optimizer_step(self, optimizer, model: "pl.LightningModule", closure: Callable[[], Any],
                       **kwargs: Any) -> Any:
        closure_result = closure()
        self._after_closure(model, optimizer)
        if model.automatic_optimization and closure_result is None:
            raise ValueError("ZeroStrategy: training_step returned None (skip the backward): "
                             "every rank must take part in every step's collectives")
        return optimizer.step(**kwargs)

    def clip_gradients(self, optimizer, clip_val=0.0,
                       gradient_clip_algorithm=GradClipAlgorithmType.NORM) -> None:
        if not clip_val or clip_val <= 0:
            return
        if gradient_clip_algorithm is not None and GradClipAlgorithmType(
                gradient_clip_algorithm) != GradClipAlgorithmType.NORM:
            raise ValueError(f"ZeroStrategy clips by the global gradient norm only: "
                             f"gradient_clip_algorithm={gradient_clip_algorithm!r} is not "
                             f"supported")
        opt = getattr(optimizer, "_optimizer", optimizer)
        if not isinstance(opt, ZeroOptimizer) or opt.max_grad_norm != float(clip_val):
            raise ValueError(f"ZeroStrategy clips inside opt.step() with Trainer's "
                             f"gradient_clip_val; clip_gradients(clip_val={clip_val!r}) asks "
                             f"another norm: set Trainer(gradient_clip_val=...)")


def zero_optimizer(strategy: "ZeroStrategy") -> ZeroOptimizer:
    """The ZeroOptimizer ``strategy`` built in ``setup``.

    Raises:
        RuntimeError: none yet (outside ``trainer.fit``)."""
    opt = getattr(strategy, "zero", None)
    if opt is None:
        raise RuntimeError("ZeroStrategy builds its ZeroOptimizer in trainer.fit's setup; "
                           "there is none outside fit")
    return opt


class ZeroStrategy(DDPStrategy):
    """Lightning strategy training with a :class:`~zkernels.ZeroOptimizer` at any stage
    (see [Note: what ZeroStrategy takes from Lightning]).

    Args:
        stage: 1, 2, 3 or "auto", as ``ZeroOptimizer``'s.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        process_group_backend, timeout, start_method: ``DDPStrategy``'s.
        **zero_options: ZeroOptimizer's other arguments (``offload``, ``offload_dir``,
            ``offload_params``, ``bucket_bytes``, ``reduce_dtype``, ``units``,
            ``reshard_after_forward``, ``loss_scale``, ...).

    Raises:
        ValueError: an option Lightning owns (``lr``, ``max_grad_norm``, ``param_dtype``,
            ...: named with where it comes from) or that ZeroOptimizer does not take, or an
            invalid combination (ZeroConfig's checks, at construction).
    """

    strategy_name = "zkernels_zero"

    def __init__(self, stage=1, accelerator=None, parallel_devices=None,
                 cluster_environment=None, checkpoint_io=None, precision_plugin=None,
                 process_group_backend: Optional[str] = None, timeout=None,
                 start_method: str = "popen", **zero_options: Any) -> None:
        owned = sorted(k for k in zero_options if k in _OWNED)
        if owned:
            raise ValueError(f"ZeroStrategy: {owned} come from Lightning: "
                             f"{', '.join(f'{k} from {_OWNED[k]}' for k in owned)}")
        unknown = sorted(k for k in zero_options if k not in _ZERO_KWARGS)
        if unknown:
            raise ValueError(f"ZeroStrategy: {unknown} are not ZeroOptimizer arguments")
        # ZeroConfig's checks now, not inside fit on every rank.
        ZeroConfig.from_kwargs(stage=stage, **{k: v for k, v in zero_options.items()
                                               if k in CONFIG_KWARGS})
        kwargs = {} if timeout is None else {"timeout": timeout}
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin,
                         process_group_backend=process_group_backend,
                         start_method=start_method, **kwargs)
        self.stage = stage
        self.zero_options = dict(zero_options)
        self.zero: Optional[ZeroOptimizer] = None

    # -- precision: Lightning's connector sets a MixedPrecision / Precision; ours replaces it

    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else ZeroPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        if plugin is None or isinstance(plugin, ZeroPrecision):
            self._precision_plugin = plugin
        elif type(plugin) is Precision:
            self._precision_plugin = ZeroPrecision("32-true")
        elif type(plugin) is MixedPrecision:
            self._precision_plugin = ZeroPrecision(plugin.precision)
        else:
            raise ValueError(f"ZeroStrategy: precision plugin {type(plugin).__name__} "
                             f"(precision={getattr(plugin, 'precision', None)!r}) is not "
                             f"supported; use Trainer(precision=...) with one of "
                             f"{sorted(_PRECISIONS)}")

    # -- setup -------------------------------------------------------------------------------

    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)      # configure_optimizers: the AdamW, schedulers
            self._build_zero(trainer)
        self.setup_precision_plugin()

    def _build_zero(self, trainer: "pl.Trainer") -> None:
        if len(self.optimizers) != 1:
            raise ValueError(f"ZeroStrategy trains one optimizer; configure_optimizers returned "
                             f"{len(self.optimizers)}")
        source = self.optimizers[0]
        groups = zero_param_groups(source, self.zero_options.get("elementwise", False))
        clip, algo = trainer.gradient_clip_val, trainer.gradient_clip_algorithm
        if clip and algo is not None and GradClipAlgorithmType(algo) != \
                GradClipAlgorithmType.NORM:   # Lightning's default (None) is the norm
            raise ValueError(f"ZeroStrategy clips by the global gradient norm only: "
                             f"Trainer(gradient_clip_algorithm="
                             f"{GradClipAlgorithmType(algo).value!r}) is not supported")
        precision = self.precision_plugin
        extra = {g_key: [g.get(g_key) if g_key not in _group_keys(g) else None for g in groups]
                 for g_key in sorted({k for g in groups for k in g if k not in _group_keys(g)})}
        opt = ZeroOptimizer(
            self.lightning_module, stage=self.stage,
            param_groups=[{k: g[k] for k in _group_keys(g) if k in g} for g in groups],
            max_grad_norm=float(clip) if clip else None,
            param_dtype=precision.param_dtype, **self.zero_options)
        for key, values in extra.items():   # initial_lr and whatever else a scheduler keeps
            for g, v in zip(opt.param_groups, values):
                if v is not None:
                    g[key] = v
        for config in self.lr_scheduler_configs:
            sched = config.scheduler
            if getattr(sched, "optimizer", None) is not source:
                raise ValueError("ZeroStrategy: an LR scheduler from configure_optimizers is "
                                 "not built on the optimizer it returned")
            sched.optimizer = opt
        _track_step_for_scheduler(opt)
        self.zero = opt
        self.optimizers = [opt]

    # -- steps: through the module's __call__, so stage 3's hooks on it gather its own unit --

    def _redirected(self, name: str, context, *args: Any, **kwargs: Any) -> Any:
        # As DDPStrategy runs a step through DDP's forward: Lightning's _ForwardRedirection
        # makes module(*args) run module.<name>, so the forward hooks ZeroOptimizer put on
        # the LightningModule (the root unit at stage 3) fire around the step.
        module = self.lightning_module
        with context():
            return self._forward_redirection(module, module, name, *args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._redirected("training_step", self.precision_plugin.train_step_context,
                                *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._redirected("validation_step", self.precision_plugin.val_step_context,
                                *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._redirected("test_step", self.precision_plugin.test_step_context,
                                *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._redirected("predict_step", self.precision_plugin.predict_step_context,
                                *args, **kwargs)

    def _setup_model(self, model):
        return model    # no DDP: the ZeroOptimizer reduces the gradients

    def configure_ddp(self) -> None:
        pass

    @contextlib.contextmanager
    def block_backward_sync(self):
        """Accumulation micro-steps: backward without communication (``opt.no_sync()``)."""
        if self.zero is None:
            yield None
            return
        with self.zero.no_sync():
            yield None

    def teardown(self) -> None:
        super().teardown()
        if self.zero is not None:
            self.zero.close()
            self.zero = None

    # -- checkpoints: zkernels.checkpoint folders ----------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True     # the optimizer must exist to load into

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False    # zkernels.checkpoint.load restored it

    def lightning_module_state_dict(self) -> Dict[str, Any]:
        return {}       # the weights are the checkpoint's shards

    def optimizer_state(self, optimizer) -> Dict[str, torch.Tensor]:
        return {}

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath, storage_options=None) -> None:
        """Write the ``zkernels.checkpoint`` folder ``filepath`` (collective: every rank)."""
        if storage_options is not None:
            raise TypeError("ZeroStrategy.save_checkpoint: storage_options is not supported "
                            "(zkernels.checkpoint writes the folder, not a CheckpointIO)")
        filepath = os.fspath(self.broadcast(filepath))
        state = {k: v for k, v in checkpoint.items() if k not in ("state_dict",
                                                                    "optimizer_states")}
        zk_checkpoint.save(zero_optimizer(self), filepath,
                           model_extra={LIGHTNING_STATE: _plain(state, "checkpoint")})

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> Dict[str, Any]:
        """Restore the folder into the ZeroOptimizer; return Lightning's state."""
        path = os.fspath(self.broadcast(checkpoint_path))
        if self.zero is None:
            raise ValueError(f"ZeroStrategy loads {path} into its ZeroOptimizer: pass it as "
                             f"trainer.fit(ckpt_path=...); for the weights alone consolidate "
                             f"it (python -m zkernels checkpoint consolidate)")
        extra = zk_checkpoint.load(self.zero, path)
        if not isinstance(extra, dict) or LIGHTNING_STATE not in extra:
            raise ValueError(f"{path} is a zkernels checkpoint that ZeroStrategy did not write "
                             f"(no Lightning state in it)")
        return extra[LIGHTNING_STATE]

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass    # loaded with the optimizer in load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass


def _plain(value: Any, where: str) -> Any:
    """Lightning's checkpoint dict as plain containers (``AttributeDict`` hyper-parameters
    become dicts) for ``zkernels.checkpoint``'s ``model_extra``."""
    if isinstance(value, Mapping):
        return {k: _plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(v, f"{where}[{i}]") for i, v in enumerate(value))
    if isinstance(value, list):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    return value
