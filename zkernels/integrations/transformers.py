"""``transformers.Trainer`` at any ZeRO rung: :class:`ZeroTrainer`, a drop-in subclass.

    from zkernels.integrations.transformers import ZeroTrainer

    trainer = ZeroTrainer(model=model, args=training_args, train_dataset=ds,
                          zero_config={"stage": 3, "offload": "cpu", "offload_params": True})
    trainer.train()                     # torchrun --nproc-per-node N train.py
    trainer.save_model("out")           # AutoModelForCausalLM.from_pretrained("out") loads it

Everything else is ``Trainer``'s and means what it means there. As with DeepSpeed's
integration, the optimizer's hyper-parameters come from ``TrainingArguments``
(``learning_rate``, ``adam_beta1``/``adam_beta2``, ``adam_epsilon``, ``weight_decay`` with
Trainer's no-decay group for biases and norms, ``max_grad_norm`` clipped by the global norm
across shards, ``bf16``/``fp16`` as the compute dtype with an fp32 master and, for fp16,
dynamic loss scaling), the LR schedule is Trainer's own over the optimizer's param groups,
and ``zero_config`` holds the rest of :class:`~zkernels.ZeroOptimizer`'s arguments (a dict,
or a path to a JSON file of one): ``stage``, ``offload``, ``offload_dir``, ``offload_params``,
``bucket_bytes``, ``reduce_dtype`` ("bf16", ...), ``units``, ``reshard_after_forward``, ...

[Note: what ZeroTrainer changes in Trainer]
- No DDP. Under torchrun Accelerate wraps a trainable model in ``DistributedDataParallel``,
  whose all-reduce of every gradient would undo the sharding. :meth:`create_optimizer` builds
  the ZeroOptimizer and marks the model and the optimizer as already prepared (Accelerate's
  own guard against wrapping twice), so ``accelerator.prepare`` hands both back unchanged,
  and ``_wrap_model`` never applies ``nn.DataParallel``. Accelerate still shards the data
  loader across ranks, as under DDP.
- Precision is the optimizer's: ``bf16``/``fp16`` become ``param_dtype`` (as DeepSpeed reads
  them), and Accelerate's autocast and GradScaler are off. Backward goes through
  ``opt.backward(loss)``, which applies fp16's loss scale; ``Trainer.training_step`` calls
  ``self.accelerator.backward``, so this trainer's accelerator gets that one method replaced.
- Gradient accumulation: the micro-steps before the last of each optimizer step run inside
  ``opt.no_sync()`` (Trainer asks DDP the same through ``accelerator.no_sync``), so gradients
  are reduced once per optimizer step; the loss is normalized by Trainer as with DDP.
- Gradients live in the optimizer (stage 1's flat buffers, stage 2/3's reduced shards), so
  ``model.zero_grad()``, which Trainer calls after each step, does not clear them: a callback
  calls ``opt.zero_grad()`` right after ``opt.step()`` (``on_optimizer_step``).
- Clipping happens inside ``opt.step()`` over the global norm of every shard; Trainer's own
  ``clip_grad_norm_`` over ``model.parameters()`` would see only local or missing gradients,
  so it is skipped, and the ``grad_norm`` logged is the optimizer's (``opt.last_grad_norm``:
  the pre-clip global norm, what ``clip_grad_norm_`` returns under DDP). A step skipped on an
  inf/NaN gradient (``opt.step_was_skipped``) holds the LR schedule back, as Accelerate does
  for fp16.
- Checkpoints (``save_steps``): ``checkpoint-N/zero/`` is a ``zkernels.checkpoint`` folder
  (each rank writes its shards; loads at any world size and stage), beside Trainer's
  ``scheduler.pt``, RNG states and ``trainer_state.json``, and the consolidated weights of
  :meth:`save_model`. ``resume_from_checkpoint`` restores the zkernels checkpoint into the
  new optimizer (parameters, masters, moments, step counts, loss scale, frozen parameters
  and buffers), whatever world size and stage it was saved with.
- ``load_best_model_at_end`` loads the best checkpoint's ``zero/`` folder (optimizer state
  included, as DeepSpeed's integration loads its engine checkpoint). ``evaluate``/``predict``
  run the model as it is: at stage 3 forward gathers each unit, so every rank evaluates (as
  Trainer does under torchrun anyway).
- :meth:`save_model` writes through :func:`zkernels.checkpoint.save_pretrained` (safetensors
  shards + index + config, streamed one unit at a time, rank 0 writing), into a folder that
  may hold other files. Collective: every rank calls it (Trainer does at each checkpoint).
- ``TrainingArguments(deepspeed=...)``: transformers' DeepSpeed set-up is undone and the
  config read by zkernels (see [Note: taking TrainingArguments.deepspeed away from
  transformers] in ``_hf_deepspeed.py``).
- A model on the meta device is materialized by the ZeroOptimizer on ``args.device``, one
  unit at a time; ``pretrained=`` loads a Hugging Face folder into the shards
  (:func:`zkernels.checkpoint.load_pretrained`) right after the optimizer is built.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any, Dict, Optional, Union

import torch
from torch import nn
from transformers import Trainer, TrainerCallback

from .. import checkpoint as zk_checkpoint
from . import _hf_deepspeed
from ..zero import LossScaleConfig, OffloadConfig, ZeroConfig, ZeroOptimizer
from ..zero.parameters.meta_init import has_meta
from ..zero.planning.config import CONFIG_KWARGS, parse_dtype

logger = logging.getLogger(__name__)

ZERO_CHECKPOINT_DIR = "zero"    # checkpoint-N/zero: the zkernels.checkpoint folder
SCHEDULER_NAME = "scheduler.pt"  # Trainer's file name for the LR scheduler's state
TRAINING_ARGS_NAME = "training_args.bin"   # Trainer's file name for the arguments
# ZeroOptimizer arguments that TrainingArguments or Trainer own (see the module docstring).
_FROM_ARGS = {"lr": "learning_rate", "betas": "adam_beta1 / adam_beta2", "eps": "adam_epsilon",
              "weight_decay": "weight_decay", "max_grad_norm": "max_grad_norm",
              "param_dtype": "bf16 / fp16", "param_groups": "weight_decay (Trainer's groups)"}
# The Trainer methods ZeroTrainer overrides; a Trainer without one would run its own version
# inline (clipping local gradients, wrapping in DDP) and train wrongly rather than fail.
_TRAINER_HOOKS = ("create_accelerator_and_postprocess", "_build_accelerator_args",
                  "create_optimizer", "create_scheduler", "_move_model_to_device",
                  "_wrap_model", "training_step", "_clip_grad_norm", "_get_grad_norm",
                  "_save_optimizer_and_scheduler", "_load_from_checkpoint",
                  "_load_optimizer_and_scheduler", "_load_best_model",
                  "_maybe_log_save_evaluate")
_ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf")
# TrainingArguments.optim choices that run a torch.optim class on the shards: the class and
# its keywords are Trainer's own (``Trainer.get_optimizer_cls_and_kwargs``: lr, optim_args).
_TORCH_OPTIMS = ("sgd", "adagrad", "rmsprop")
# ... and those that run a fused op: Lion in fp32 state (Trainer's bitsandbytes Lion with
# betas (adam_beta1, adam_beta2)) is zkernels' fused Lion. Not mapped (refused by name):
# the 8-bit and paged variants (other state), and "adafactor", Trainer's
# transformers.optimization.Adafactor, whose update (no parameter-scale step, update
# clipping) is not torch.optim.Adafactor's: pass optimizer=torch.optim.Adafactor in
# zero_config's param groups to run that one.
_FUSED_OPTIMS = {"lion_32bit": "lion"}


def _transformers_version() -> str:
    import transformers
    return transformers.__version__


def read_zero_config(zero_config: Union[None, str, os.PathLike, Dict[str, Any]]) -> Dict[str, Any]:
    """``zero_config`` as ZeroOptimizer keyword arguments.

    Args:
        zero_config: None (ZeroOptimizer's defaults: stage 1), a dict, or the path of a JSON
            file holding one. ``reduce_dtype`` may be a name ("bf16", "fp32", ...),
            ``offload_config`` and ``loss_scale`` dicts of their dataclasses' fields.

    Raises:
        ValueError: a key that ``TrainingArguments`` owns, or a bad dtype name.
        TypeError: ``zero_config`` is not one of the above.
    """
    if zero_config is None:
        return {}
    if isinstance(zero_config, (str, os.PathLike)):
        with open(zero_config) as f:
            zero_config = json.load(f)
    if not isinstance(zero_config, dict):
        raise TypeError(f"zero_config must be None, a dict of ZeroOptimizer arguments or the "
                        f"path of a JSON file of one, got {type(zero_config).__name__}")
    cfg = dict(zero_config)
    owned = sorted(k for k in cfg if k in _FROM_ARGS)
    if owned:
        raise ValueError(f"zero_config sets {owned}: ZeroTrainer takes "
                         f"{', '.join(_FROM_ARGS[k] for k in owned)} from TrainingArguments")
    if isinstance(cfg.get("offload_config"), dict):
        cfg["offload_config"] = OffloadConfig(**cfg["offload_config"])
    if isinstance(cfg.get("loss_scale"), dict):
        cfg["loss_scale"] = LossScaleConfig(**cfg["loss_scale"])
    if "reduce_dtype" in cfg:   # how the keys combine is ZeroConfig's check (optimizer_kwargs)
        cfg["reduce_dtype"] = parse_dtype(cfg["reduce_dtype"], "zero_config['reduce_dtype']")
    return cfg


def optimizer_kwargs(args, zero_config: Dict[str, Any]) -> Dict[str, Any]:
    """ZeroOptimizer keyword arguments (param groups aside) from ``TrainingArguments`` and the
    parsed ``zero_config``: its ZeroConfig keys (and the compute dtype) as one ``config``.

    Raises:
        ValueError: ``args.optim`` is neither an AdamW (the fused sharded AdamW) nor one of
            ``_TORCH_OPTIMS`` (the torch class on the shards).
    """
    optim = str(getattr(args.optim, "value", args.optim))
    known = _ADAMW + tuple(_TORCH_OPTIMS) + tuple(_FUSED_OPTIMS)
    if optim not in known:
        raise ValueError(f"ZeroTrainer updates with zkernels' sharded AdamW, fused Lion or a "
                         f"torch.optim class on the shards: TrainingArguments.optim must be "
                         f"one of {known}, got {optim!r}")
    param_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
    max_norm = args.max_grad_norm
    config = ZeroConfig.from_kwargs(param_dtype=param_dtype, **{
        k: v for k, v in zero_config.items() if k in CONFIG_KWARGS})
    hparams = dict(lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                   eps=args.adam_epsilon, weight_decay=args.weight_decay)
    if optim in _TORCH_OPTIMS:   # weight decay per group (create_optimizer's groups)
        from transformers import Trainer
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
        hparams = dict(optimizer=cls, weight_decay=args.weight_decay, **kwargs)
    if optim in _FUSED_OPTIMS:
        hparams = dict(optimizer=_FUSED_OPTIMS[optim], lr=args.learning_rate,
                       betas=(args.adam_beta1, args.adam_beta2), weight_decay=args.weight_decay)
    return dict(**hparams, max_grad_norm=float(max_norm) if max_norm and max_norm > 0 else None,
                config=config, **{k: v for k, v in zero_config.items()
                                  if k not in CONFIG_KWARGS})


def _state_dict_refs(model: nn.Module) -> Dict[str, torch.Tensor]:
    """``model.state_dict(keep_vars=True)``'s keys and tensors (parameters and persistent
    buffers under every name of every module), without calling it."""
    refs = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{name}." if name else ""
        for n, p in mod._parameters.items():
            if p is not None:
                refs[prefix + n] = p
        for n, b in mod._buffers.items():
            if b is not None and n not in mod._non_persistent_buffers_set:
                refs[prefix + n] = b
    return refs


@torch.no_grad()
def full_state_dict(opt: ZeroOptimizer, keep: bool = True) -> Optional[Dict[str, torch.Tensor]]:
    """The model's ``state_dict()`` with full parameters, copied to the CPU. Collective at
    stage 3 (every rank gathers each unit in turn, so a rank holds one unit beyond its
    shards at a time); tied keys share one tensor.

    Args:
        opt: the ZeroOptimizer that owns the model.
        keep: whether this rank copies and returns the weights (False: it only takes part in
            the gathers, and returns None).
    """
    model = opt.module
    # key -> the Parameter or buffer itself; at stage 3 model.state_dict() refuses to run on
    # sharded parameters, so its keys are listed the way it lists them.
    refs = _state_dict_refs(model) if opt.schedule is not None else \
        model.state_dict(keep_vars=True)
    copies: Dict[int, torch.Tensor] = {}

    def copy(t: torch.Tensor) -> None:
        if keep and id(t) not in copies:
            copies[id(t)] = t.detach().to("cpu", copy=True).contiguous()

    if opt.schedule is None:
        opt.wait_params()
    else:
        for unit in opt.schedule.units:
            if not unit.flats:
                continue
            held = {id(p) for f in unit.flats for p in f.params}   # frozen ones included
            with opt.schedule.gathered([unit]):
                for t in refs.values():
                    if id(t) in held:
                        copy(t)
    for t in refs.values():
        # Stages 1-2: every parameter. Stage 3: the buffers, and any parameter no unit holds
        # (one zkernels leaves unsharded, e.g. frozen where it does not shard those): full.
        copy(t)
    if not keep:
        return None
    return {k: copies[id(t)] for k, t in refs.items()}


class _ZeroGrad(TrainerCallback):
    """``opt.zero_grad()`` after every optimizer step (see [Note: what ZeroTrainer changes in
    Trainer])."""

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if isinstance(optimizer, ZeroOptimizer):
            optimizer.zero_grad()


class ZeroTrainer(Trainer):
    max_shard_size = "50GB"   # save_model's file size, transformers 5's save_pretrained default
    save_dtype = None         # save_model: fp32 masters; torch.bfloat16 (or "bf16") to cast

    """``transformers.Trainer`` whose optimizer is a :class:`~zkernels.ZeroOptimizer`: any
    rung (stage 1/2/3, CPU or NVMe offload) with the model unwrapped. See the module
    docstring and [Note: what ZeroTrainer changes in Trainer].

    Args:
        *args, **kwargs: ``Trainer``'s. ``optimizers=(opt, scheduler)`` may pass a
            ZeroOptimizer built over ``model`` (``zero_config`` then does not apply); any
            other optimizer raises TypeError.
        zero_config: ZeroOptimizer arguments besides those ``TrainingArguments`` set: a dict
            or the path of a JSON file of one (see :func:`read_zero_config`); default stage 1.
            A DeepSpeed config (dict or path) is read as ``TrainingArguments(deepspeed=)``.
        pretrained: a Hugging Face model folder (or one ``.safetensors``) loaded into the
            shards once the optimizer is built; the model may be on the meta device.

    Raises:
        ValueError: FSDP (or Accelerate's DeepSpeed) is enabled too, both ``deepspeed`` and
            ``zero_config`` are given, a key of the DeepSpeed config cannot be honoured, or one
            process drives several GPUs
            (``nn.DataParallel``: launch one process per GPU with torchrun instead).
        TypeError: ``optimizers`` holds something other than a ZeroOptimizer.
    """

    def __init__(self, *args, zero_config=None, pretrained=None, **kwargs) -> None:
        missing = [m for m in _TRAINER_HOOKS if not callable(getattr(Trainer, m, None))]
        if missing:
            raise RuntimeError(f"ZeroTrainer needs a transformers.Trainer with {missing} "
                               f"(transformers 5; tested with 5.24), found transformers "
                               f"{_transformers_version()}: without them Trainer would clip "
                               f"and wrap the model itself")
        # [Note: taking TrainingArguments.deepspeed away from transformers]
        args = list(args)
        in_kwargs = "args" in kwargs or len(args) < 2
        targs = kwargs.get("args") if in_kwargs else args[1]
        targs, ds_config = _hf_deepspeed.detach_deepspeed(targs)
        if in_kwargs:
            kwargs["args"] = targs
        else:
            args[1] = targs
        if ds_config is None and _hf_deepspeed.is_deepspeed_config(
                _hf_deepspeed.load_json_or_dict(zero_config)):
            ds_config, zero_config = zero_config, None   # a DeepSpeed config as zero_config
        elif ds_config is not None and zero_config is not None:
            raise ValueError("ZeroTrainer got both TrainingArguments(deepspeed=...) and "
                             "zero_config: give one (the DeepSpeed config is read as "
                             "zero_config)")
        self.deepspeed_config = ds_config
        self.pretrained = None if pretrained is None else os.fspath(pretrained)
        self._pretrained_into: Optional[ZeroOptimizer] = None   # the optimizer it went into
        _hf_deepspeed.check_not_deepspeed_partitioned(
            kwargs.get("model", args[0] if args else None))
        self.zero_config = read_zero_config(zero_config)
        super().__init__(*args, **kwargs)
        if ds_config is not None:   # refuse what we cannot honour, by name, before training
            _hf_deepspeed.read(ds_config, self.args, self.model, None)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError("ZeroTrainer shards with zkernels: leave TrainingArguments' "
                             "deepspeed and fsdp unset")
        if self.args.n_gpu > 1:
            raise ValueError(f"ZeroTrainer runs one device per process, this process sees "
                             f"{self.args.n_gpu} GPUs: launch with torchrun --nproc-per-node")
        if self.optimizer is not None:
            self._check_optimizer(self.optimizer, self.model)
        self.add_callback(_ZeroGrad)

    @staticmethod
    def _check_optimizer(opt, model) -> None:
        if not isinstance(opt, ZeroOptimizer):
            raise TypeError(f"ZeroTrainer's optimizer must be a zkernels.ZeroOptimizer (or "
                            f"None: built from TrainingArguments and zero_config), got "
                            f"{type(opt).__name__}")
        if opt.module is not model:
            raise ValueError("the ZeroOptimizer given in optimizers= was built over another "
                             "model than the one given to ZeroTrainer")

    # -- optimizer and wrapping ------------------------------------------------------------

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # [Note: what ZeroTrainer changes in Trainer]: backward goes through opt.backward (on
        # every accelerator Trainer makes: hyper-parameter search makes new ones).
        self.accelerator.backward = self._zero_backward

    def _build_accelerator_args(self, **kwargs) -> dict:
        out = super()._build_accelerator_args(**kwargs)
        out["mixed_precision"] = "no"   # the optimizer's param_dtype; no autocast, no GradScaler
        return out

    def create_optimizer(self, model: Optional[nn.Module] = None) -> ZeroOptimizer:
        """Build the ZeroOptimizer over the model (in place: its parameters become views of
        flat buffers, sharded at stage 3), with Trainer's decay / no-decay param groups and
        the hyper-parameters of ``TrainingArguments``; keep Accelerate from wrapping either."""
        model = self.model if model is None else model
        if self.optimizer is None:
            decay = set(self.get_decay_parameter_names(model))
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            groups = [{"params": [p for n, p in named if n in decay],
                       "weight_decay": self.args.weight_decay},
                      {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
            kwargs = optimizer_kwargs(self.args, self.zero_config)
            if self.deepspeed_config is not None:   # its optimizer block, ZeroConfig, clipping
                kwargs = _hf_deepspeed.optimizer_kwargs(self.deepspeed_config, self.args, model,
                                                        kwargs)
            groups = kwargs.pop("param_groups", [g for g in groups if g["params"]])
            if has_meta(model) and "device" not in kwargs:   # built unit by unit, sharded
                kwargs["device"] = self.args.device
            self.optimizer = ZeroOptimizer(model, param_groups=groups, **kwargs)
        self._check_optimizer(self.optimizer, model)
        if self.pretrained is not None and self._pretrained_into is not self.optimizer:
            self._load_pretrained(self.optimizer)   # once per optimizer (given or built)
            self._pretrained_into = self.optimizer
        # Accelerate's guard against preparing twice: prepare() returns both unchanged, so the
        # model is never wrapped in DDP and the optimizer is stepped directly.
        model._is_accelerate_prepared = True
        self.optimizer._is_accelerate_prepared = True
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """Trainer's schedule, or the DeepSpeed config's ``scheduler`` block (as transformers
        runs it under ``deepspeed``)."""
        if self.lr_scheduler is None and self.deepspeed_config is not None:
            sched = _hf_deepspeed.scheduler(self.deepspeed_config, self.args, self.model,
                                            self.optimizer if optimizer is None else optimizer,
                                            num_training_steps)
            if sched is not None:
                self.lr_scheduler = sched
                self._created_lr_scheduler = True
                return sched
        return super().create_scheduler(num_training_steps, optimizer)

    def _load_pretrained(self, opt: ZeroOptimizer) -> None:
        """``pretrained``'s weights into the new optimizer's shards; keys the files lack keep
        their initialized values and are reported, as ``from_pretrained`` reports them."""
        result = zk_checkpoint.load_pretrained(opt, self.pretrained, strict=False)
        if self.args.should_save and result.missing_keys:
            logger.warning("Some weights of %s were not initialized from %s and are newly "
                           "initialized: %s", type(opt.module).__name__, self.pretrained,
                           result.missing_keys)
        if self.args.should_save and result.unexpected_keys:
            logger.warning("Some weights of %s were not used: %s", self.pretrained,
                           result.unexpected_keys)

    def _move_model_to_device(self, model: nn.Module, device) -> None:
        if has_meta(model):
            return   # materialized by the ZeroOptimizer, one unit at a time, on args.device
        super()._move_model_to_device(model, device)

    def _materialize(self) -> None:
        """Build the optimizer now if the model is still on the meta device (or weights are
        still to load): evaluation and prediction need real parameters."""
        if (self.optimizer is None and has_meta(self.model)) or (
                self.pretrained is not None and self._pretrained_into is not self.optimizer):
            self.create_optimizer()

    def evaluate(self, *args, **kwargs):
        self._materialize()
        return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        self._materialize()
        return super().predict(*args, **kwargs)

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader=None) -> nn.Module:
        return model   # no nn.DataParallel, no DDP: the ZeroOptimizer reduces the gradients

    # -- one step --------------------------------------------------------------------------

    def _zero_backward(self, loss: torch.Tensor, **kwargs) -> None:
        kwargs.pop("learning_rate", None)   # LOMO's; Trainer passes it for LOMO only
        if isinstance(self.optimizer, ZeroOptimizer):
            self.optimizer.backward(loss, **kwargs)
        else:   # a forward/backward before the optimizer exists (no ZeRO yet)
            loss.backward(**kwargs)

    def training_step(self, model: nn.Module, inputs, num_items_in_batch=None) -> torch.Tensor:
        """Trainer's step; a micro-step that does not end an accumulation runs inside
        ``opt.no_sync()`` (no communication), as DDP's does inside ``no_sync``."""
        state = self.accelerator.gradient_state
        sync = state.sync_gradients or state.plugin_kwargs.get("sync_each_batch", False)
        ctx = contextlib.nullcontext() if sync else self.optimizer.no_sync()
        with ctx:
            return super().training_step(model, inputs, num_items_in_batch)

    def _clip_grad_norm(self, model):
        return None   # clipped inside opt.step() by the global norm across shards

    def _get_grad_norm(self, model, grad_norm=None):
        return None   # the global norm exists only inside opt.step(): logged from there

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs):
        if isinstance(self.optimizer, ZeroOptimizer):
            grad_norm = self.optimizer.last_grad_norm
        return super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    # -- saving and resuming ---------------------------------------------------------------

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Write the full model in the Hugging Face layout (``model.safetensors`` or shards of
        ``max_shard_size`` plus ``model.safetensors.index.json``, ``config.json``) to
        ``output_dir`` through :func:`zkernels.checkpoint.save_pretrained`, streamed one unit
        at a time, with Trainer's tokenizer and ``training_args.bin`` beside it. Trainable
        parameters are written as their fp32 masters (``save_dtype`` to cast). Collective
        once training has built the ZeroOptimizer: every rank calls it (Trainer does, for its
        checkpoints; a script must too, unguarded by ``is_world_process_zero``)."""
        if not isinstance(self.optimizer, ZeroOptimizer):
            return super().save_model(output_dir, _internal_call)
        output_dir = self.args.output_dir if output_dir is None else output_dir
        zk_checkpoint.save_pretrained(self.optimizer, output_dir, keep_others=True,
                                      max_shard_size=self.max_shard_size, dtype=self.save_dtype)
        if self.args.should_save:
            self._save_extras(output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_extras(self, output_dir: str) -> None:
        """What ``Trainer._save`` writes besides the weights: the tokenizer (or processor)
        and the training arguments."""
        tok = self.processing_class
        if tok is None:
            tok = getattr(self.data_collator, "tokenizer", None)
        if tok is not None:
            tok.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        zk_checkpoint.save(self.optimizer, os.path.join(output_dir, ZERO_CHECKPOINT_DIR))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    @staticmethod
    def _zero_checkpoint(checkpoint: str) -> str:
        path = os.path.join(checkpoint, ZERO_CHECKPOINT_DIR)
        if not os.path.isdir(path):
            raise ValueError(f"{checkpoint} holds no zkernels checkpoint ({ZERO_CHECKPOINT_DIR}/): "
                             f"ZeroTrainer resumes only from its own checkpoints, saved without "
                             f"save_only_model")
        return path

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # The weights come back with the optimizer's state in _load_optimizer_and_scheduler,
        # once the ZeroOptimizer exists (at stage 3 the model's parameters are shards).
        self._zero_checkpoint(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return
        zk_checkpoint.load(self.optimizer, self._zero_checkpoint(checkpoint))
        sched = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(sched):
            self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        logger.info("Loading best model from %s (score: %s).", best, self.state.best_metric)
        zk_checkpoint.load(self.optimizer, self._zero_checkpoint(best))
