"""A DeepSpeed config given to :class:`~.transformers.ZeroTrainer`: taken out of
``TrainingArguments(deepspeed=...)`` (or given as ``zero_config``) and read through
:func:`.deepspeed.read_config`, so that zkernels, not DeepSpeed, trains.

[Note: taking TrainingArguments.deepspeed away from transformers]
``TrainingArguments(deepspeed=cfg)`` sets up DeepSpeed as soon as the arguments exist: its
``__post_init__`` builds an ``HfTrainerDeepSpeedConfig`` (which registers itself in a module
global of ``transformers.integrations.deepspeed``: from then on
``is_deepspeed_zero3_enabled()`` is true for a stage-3 config, so ``from_pretrained`` builds
under ``deepspeed.zero.Init`` and ``resize_token_embeddings`` gathers through DeepSpeed), an
Accelerate ``DeepSpeedPlugin`` (which makes ``Trainer`` call ``deepspeed_init`` and
``Accelerator`` wrap the model in a DeepSpeed engine) and, off the CPU, a ``PartialState`` of
type DEEPSPEED. :func:`detach_deepspeed` undoes the three on a shallow copy of the arguments
before ``Trainer.__init__`` sees them: the copy's ``deepspeed``, ``hf_deepspeed_config`` and
``deepspeed_plugin`` are None, the global is cleared, and a DEEPSPEED distributed state is
reset and set up again as plain data parallel. The config itself (path or dict, untouched) is
what ZeroTrainer keeps and reads, with "auto" filled from the arguments as transformers fills
it (:func:`.deepspeed.read_config` with ``args=``).

A model built between ``TrainingArguments(deepspeed=<stage 3>)`` and ``ZeroTrainer`` by
``from_pretrained`` is already partitioned by DeepSpeed (its parameters carry ``ds_id``):
:func:`check_not_deepspeed_partitioned` refuses it, naming the two ways round (build the model
first, or pass ``model_init=``, which Trainer calls after the arguments are detached).

As transformers does with DeepSpeed, the config's ``optimizer`` block (if any) replaces the
``TrainingArguments.optim`` choice: AdamW with the block's hyper-parameters over every
trainable parameter in one group (DeepSpeed builds its optimizer over
``model.parameters()``, so its weight decay applies to biases and norms too: no Trainer
no-decay group); without the block the optimizer is Trainer's (``optim``, its groups). The
``scheduler`` block (WarmupLR, WarmupDecayLR, WarmupCosineLR) likewise replaces Trainer's
``lr_scheduler_type``.
"""
from __future__ import annotations

import copy
import os
from typing import Any, Dict, Optional, Tuple

from . import deepspeed as zk_deepspeed

# Top-level keys that mark a dict as a DeepSpeed config rather than ZeroOptimizer keywords.
_DEEPSPEED_TOP = ("zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size",
                  "gradient_accumulation_steps", "gradient_clipping", "fp16", "bf16",
                  "optimizer", "scheduler")


def load_json_or_dict(config) -> Any:
    """A dict as given, or the JSON object at a path (anything else as given)."""
    if isinstance(config, (str, os.PathLike)):
        import json
        with open(config) as f:
            return json.load(f)
    return config


def is_deepspeed_config(config) -> bool:
    """Whether a dict is a DeepSpeed config (it has one of DeepSpeed's top-level keys)."""
    return isinstance(config, dict) and any(k in config for k in _DEEPSPEED_TOP)


def detach_deepspeed(args) -> Tuple[Any, Optional[Any]]:
    """``(args_without_deepspeed, config)``: a shallow copy of ``TrainingArguments`` with
    transformers' and Accelerate's DeepSpeed set-up undone, and the ``deepspeed`` value it
    held (None, and ``args`` itself, when it held none). See [Note: taking
    TrainingArguments.deepspeed away from transformers]."""
    config = getattr(args, "deepspeed", None)
    if not config:
        return args, None
    try:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    except ImportError:   # pragma: no cover - transformers without its DeepSpeed module
        unset_hf_deepspeed_config = None
    if unset_hf_deepspeed_config is not None:
        unset_hf_deepspeed_config()
    args = copy.copy(args)
    args.deepspeed = None
    args.hf_deepspeed_config = None
    args.deepspeed_plugin = None
    state = args.__dict__.get("distributed_state")
    if state is not None and str(getattr(state, "distributed_type", "")).endswith("DEEPSPEED"):
        from accelerate.state import AcceleratorState
        AcceleratorState._reset_state(reset_partial_state=True)
        args.__dict__.pop("_setup_devices", None)   # a cached_property: set up again
        args._setup_devices   # noqa: B018 - plain data parallel now that deepspeed is None
    return args, config


def check_not_deepspeed_partitioned(model) -> None:
    """Refuse a model whose parameters DeepSpeed's ``zero.Init`` partitioned."""
    if model is None:
        return
    for name, p in model.named_parameters():
        if hasattr(p, "ds_id"):
            raise ValueError(
                f"model parameter {name!r} was partitioned by DeepSpeed's zero.Init "
                f"(from_pretrained ran after TrainingArguments(deepspeed=<a stage-3 config>)): "
                f"build the model before the TrainingArguments, or pass model_init= to "
                f"ZeroTrainer, so that zkernels shards it")


def read(config, args, model, num_training_steps: Optional[int]):
    """:func:`.deepspeed.read_config` with "auto" filled from ``args`` and ``model``.
    ``num_training_steps`` None: only the scheduler's values depend on it, and they are read
    again once it is known (``create_scheduler``); until then a stand-in of 1 fills them."""
    return zk_deepspeed.read_config(
        config, args=args, model=model,
        num_training_steps=1 if num_training_steps is None else num_training_steps)


def has_block(config, block: str) -> bool:
    return block in load_json_or_dict(config)


def optimizer_kwargs(config, args, model, base: Dict[str, Any]) -> Dict[str, Any]:
    """ZeroOptimizer keywords for a DeepSpeed config: ``base`` (those ``TrainingArguments``
    give, param groups included) with the config's ZeroConfig, clipping and fp16 loss scale,
    and, when the config has an ``optimizer`` block, its AdamW over one group of every
    trainable parameter (see the module docstring)."""
    zero, extras = read(config, args, model, None)
    opt = dict(extras["optimizer"])
    clip, loss_scale = opt.pop("max_grad_norm", None), opt.pop("loss_scale", None)
    if has_block(config, "optimizer"):   # AdamW from the block, not TrainingArguments.optim
        out = dict(opt, param_groups=[{"params": [p for p in model.parameters()
                                                  if p.requires_grad]}])
    else:
        out = dict(base)
    out.update(config=zero, max_grad_norm=clip)
    if loss_scale is not None:
        out["loss_scale"] = loss_scale
    return out


def scheduler(config, args, model, optimizer, num_training_steps: int):
    """The config's scheduler block as a torch scheduler over ``optimizer`` (None: none)."""
    _, extras = read(config, args, model, num_training_steps)
    if extras["scheduler"] is None:
        return None
    return zk_deepspeed.build_scheduler(optimizer, extras["scheduler"])
