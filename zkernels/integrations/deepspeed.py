"""DeepSpeed's config and ``deepspeed.initialize`` on a :class:`~zkernels.ZeroOptimizer`.

    from zkernels.integrations import deepspeed      # instead of: import deepspeed
    engine, opt, loader, sched = deepspeed.initialize(model=model, config="ds_config.json")
    for batch in loader:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint("ckpt")                   # ckpt/global_stepN/ + ckpt/latest

:func:`read_config` maps a DeepSpeed config (a dict or a JSON path) onto a
:class:`~zkernels.ZeroConfig` and the optimizer's other keywords. Every key it knows is in
one table, :data:`KEYS`, with its disposition: mapped onto a keyword, accepted because its
effect is what zkernels always does (logged once), accepted as a sizing knob zkernels sizes
its own way (logged once), or refused (``ValueError`` naming the key and why) where its value
asks for something zkernels does not do. A key not in the table is refused by name.

[Note: where we differ from DeepSpeed]
- The optimizer is always zkernels' fused AdamW: ``optimizer.type`` "Adam" (with DeepSpeed's
  default ``adam_w_mode: true``, which is AdamW) or "AdamW"; anything else is refused. A
  client ``optimizer=`` must be a ``torch.optim.AdamW`` (or ``Adam`` without weight decay):
  its param groups and hyper-parameters are read, the object itself is not stepped.
- fp16's loss scale is dynamic only (``loss_scale: 0``), backs off on the first overflow
  (``hysteresis: 1``) by 1/2 and has no floor; ``hysteresis`` > 1, ``min_loss_scale`` and a
  static scale are refused (with fp16 enabled; with it off they do not apply).
- ``reduce_bucket_size`` (elements) becomes ``bucket_bytes`` (elements x 4, fp32 reduce
  buffers) at stages 1-2; stage 3 reduces one unit (a transformer block) at a time and
  ``stage3_*`` sizes, ``allgather_bucket_size`` and ``sub_group_size``'s memory bounds are
  sizing knobs that zkernels sets from the model's blocks (logged, not used).
- "auto" values are filled as transformers' ``HfTrainerDeepSpeedConfig`` fills them, from
  ``args=`` (a ``TrainingArguments``), ``model.config.hidden_size`` and
  ``num_training_steps=``; an "auto" with nothing to fill it from is refused by name (plain
  DeepSpeed refuses every "auto").
- ``offload_param`` must name the same device as ``offload_optimizer`` (the parameter shards
  live beside the offloaded optimizer state), and the same ``nvme_path``.
- ``zero_quantized_gradients`` is int4 (qgZ), ``zero_quantized_weights`` int8 (qwZ) in
  blocks of 256; ``zero_hpz_partition_size`` R is ``reshard_after_forward=R``;
  ``mics_shard_size`` K is hybrid sharding over groups of K (``shard_size=K``).
- Checkpoints are ``zkernels.checkpoint`` folders (load at any world size and stage) under
  ``save_dir/tag``, with DeepSpeed's ``latest`` file beside them; DeepSpeed cannot read them
  nor we its. ``load_checkpoint`` always restores the optimizer state
  (``load_optimizer_states=False`` and ``load_module_only=True`` are refused).
- The engine runs the model as it is (no autocast, no DDP); ``engine.optimizer`` is the
  ZeroOptimizer.
"""
from __future__ import annotations

import json
import logging
import math
import os
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from ..zero.gradients.precision import LossScaleConfig
from ..zero.planning.config import ZeroConfig
from ..zero.planning.offload_config import OffloadConfig

logger = logging.getLogger(__name__)

AUTO = "auto"

# Dispositions of a key.
MAPPED = "mapped"        # becomes a ZeroConfig / optimizer / engine setting
ALWAYS = "always"        # its effect is what zkernels always does: accepted, logged once
SIZING = "sizing"        # a size or tuning knob zkernels sets its own way: accepted, logged
REFUSED = "refused"      # refused whatever its value

# [Note: the key table]
# key -> (disposition, the values accepted (None: any; for MAPPED the reader checks), why).
# A nested block's keys are written "block.key". An ALWAYS or SIZING key whose value is not
# among those accepted is refused naming the key, the value and why.
_T, _F = (True,), (False,)
KEYS: Dict[str, Tuple[str, Optional[tuple], str]] = {
    # batch and accumulation
    "train_batch_size": (MAPPED, None, "micro batch x gradient accumulation x world size"),
    "train_micro_batch_size_per_gpu": (MAPPED, None, "the data loader's batch size"),
    "gradient_accumulation_steps": (MAPPED, None, "micro-steps per optimizer step"),
    "gradient_clipping": (MAPPED, None, "max_grad_norm (0: no clipping)"),
    "steps_per_print": (SIZING, None, "DeepSpeed's progress printing; zkernels prints none"),
    "wall_clock_breakdown": (ALWAYS, _F, "no timers are printed"),
    "memory_breakdown": (ALWAYS, _F, "no memory reports are printed (see opt.stats())"),
    "dump_state": (ALWAYS, _F, "no state dump"),
    "prescale_gradients": (ALWAYS, _F, "gradients are averaged in the reduction, not "
                                       "pre-scaled"),
    "gradient_predivide_factor": (ALWAYS, (1, 1.0), "gradients are divided by the world "
                                                    "size once, in the reduction"),
    "communication_data_type": (MAPPED, None, "reduce_dtype"),
    "sparse_gradients": (ALWAYS, _F, "gradients are dense"),
    "zero_allow_untested_optimizer": (ALWAYS, None, "the optimizer is always zkernels' AdamW"),
    "zero_force_ds_cpu_optimizer": (ALWAYS, None, "offload runs zkernels' own CPU AdamW"),
    # precision
    "fp16.enabled": (MAPPED, None, "param_dtype=float16"),
    "fp16.loss_scale": (MAPPED, (0, 0.0), "0 is dynamic loss scaling; a static scale is not "
                                          "supported"),
    "fp16.initial_scale_power": (MAPPED, None, "LossScaleConfig.init_scale = 2**power"),
    "fp16.loss_scale_window": (MAPPED, None, "LossScaleConfig.growth_interval"),
    "fp16.hysteresis": (MAPPED, (1,), "the scale backs off on the first overflow "
                                      "(hysteresis 1)"),
    "fp16.consecutive_hysteresis": (ALWAYS, _F, "no hysteresis to refill"),
    "fp16.min_loss_scale": (MAPPED, None, "zkernels' loss scale has no floor"),
    "fp16.auto_cast": (ALWAYS, _F, "no autocast: the model runs in param_dtype"),
    "fp16.fp16_master_weights_and_grads": (ALWAYS, _F, "masters are fp32"),
    "bf16.enabled": (MAPPED, None, "param_dtype=bfloat16"),
    "bf16.immediate_grad_update": (SIZING, None, "gradients are reduced in fp32 buckets"),
    "amp.enabled": (ALWAYS, _F, "NVIDIA apex amp is not used; use fp16 or bf16"),
    # optimizer and scheduler
    "optimizer.type": (MAPPED, None, "Adam (adam_w_mode) or AdamW: zkernels' AdamW"),
    "optimizer.params.lr": (MAPPED, None, "lr"),
    "optimizer.params.betas": (MAPPED, None, "betas"),
    "optimizer.params.eps": (MAPPED, None, "eps"),
    "optimizer.params.weight_decay": (MAPPED, None, "weight_decay (decoupled, AdamW)"),
    "optimizer.params.adam_w_mode": (ALWAYS, _T, "weight decay is decoupled (AdamW)"),
    "optimizer.params.bias_correction": (ALWAYS, _T, "Adam's bias correction is applied"),
    "optimizer.params.amsgrad": (ALWAYS, _F, "no AMSGrad"),
    "optimizer.params.torch_adam": (SIZING, None, "zkernels' fused AdamW runs"),
    "optimizer.params.fused": (SIZING, None, "zkernels' fused AdamW runs"),
    "scheduler.type": (MAPPED, None, "WarmupLR, WarmupDecayLR or WarmupCosineLR"),
    "scheduler.params.warmup_min_lr": (MAPPED, None, "WarmupLR / WarmupDecayLR"),
    "scheduler.params.warmup_max_lr": (MAPPED, None, "WarmupLR / WarmupDecayLR"),
    "scheduler.params.warmup_num_steps": (MAPPED, None, "warmup steps"),
    "scheduler.params.warmup_type": (MAPPED, None, "'log' or 'linear'"),
    "scheduler.params.total_num_steps": (MAPPED, None, "WarmupDecayLR / WarmupCosineLR"),
    "scheduler.params.warmup_min_ratio": (MAPPED, None, "WarmupCosineLR"),
    "scheduler.params.cos_min_ratio": (MAPPED, None, "WarmupCosineLR"),
    "scheduler.params.last_batch_iteration": (MAPPED, (-1,), "a schedule starts at its "
                                                           "beginning; resume through "
                                                           "load_checkpoint"),
    # ZeRO
    "zero_optimization.stage": (MAPPED, None, "stage 1, 2 or 3"),
    "zero_optimization.reduce_bucket_size": (MAPPED, None, "bucket_bytes = elements x 4"),
    "zero_optimization.allgather_bucket_size": (SIZING, None, "stages 1-2 all-gather per "
                                                              "bucket of bucket_bytes"),
    "zero_optimization.allgather_partitions": (ALWAYS, _T, "parameters are all-gathered"),
    "zero_optimization.reduce_scatter": (ALWAYS, _T, "gradients are reduce-scattered"),
    "zero_optimization.overlap_comm": (ALWAYS, None, "reductions overlap backward"),
    "zero_optimization.contiguous_gradients": (ALWAYS, None, "gradients live in flat "
                                                            "buffers"),
    "zero_optimization.round_robin_gradients": (SIZING, None, "shards are contiguous "
                                                             "ranges"),
    "zero_optimization.load_from_fp32_weights": (ALWAYS, _T, "checkpoints hold fp32 masters"),
    "zero_optimization.elastic_checkpoint": (ALWAYS, None, "checkpoints load at any world "
                                                          "size"),
    "zero_optimization.ignore_unused_parameters": (ALWAYS, _T, "a parameter without a "
                                                               "gradient is not waited for"),
    "zero_optimization.grad_hooks": (ALWAYS, _T, "gradients are reduced from hooks"),
    "zero_optimization.sub_group_size": (MAPPED, None, "OffloadConfig.sub_group_numel"),
    "zero_optimization.stage3_prefetch_bucket_size": (SIZING, None, "stage 3 prefetches the "
                                                                    "next unit"),
    "zero_optimization.stage3_param_persistence_threshold": (SIZING, None, "stage 3 shards "
                                                                           "every unit"),
    "zero_optimization.stage3_max_live_parameters": (SIZING, None, "stage 3 holds a unit "
                                                                   "and its prefetch"),
    "zero_optimization.stage3_max_reuse_distance": (SIZING, None, "stage 3 frees each unit "
                                                                  "after use"),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": (
        SIZING, None, "zk.checkpoint.consolidate writes full weights"),
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": (
        SIZING, None, "zk.checkpoint.consolidate writes full weights"),
    "zero_optimization.zero_hpz_partition_size": (MAPPED, None, "reshard_after_forward=R"),
    "zero_optimization.zero_quantized_weights": (MAPPED, None, "quantize_weights='int8'"),
    "zero_optimization.zero_quantized_gradients": (MAPPED, None, "quantize_grads='int4'"),
    "zero_optimization.zero_quantized_nontrainable_weights": (ALWAYS, _F, "frozen weights "
                                                                         "gather exactly"),
    "zero_optimization.mics_shard_size": (MAPPED, None, "shard_size=K (hybrid sharding)"),
    "zero_optimization.mics_hierarchical_params_gather": (ALWAYS, _F, "hybrid gathers run "
                                                                      "within the group"),
    "zero_optimization.cpu_offload": (ALWAYS, _F, "deprecated: use offload_optimizer"),
    "zero_optimization.legacy_stage1": (ALWAYS, _F, "one stage-1 implementation"),
    "zero_optimization.memory_efficient_linear": (SIZING, None, "linear layers are the "
                                                                "model's own"),
    "zero_optimization.use_multi_rank_bucket_allreduce": (SIZING, None, "buckets are "
                                                                        "reduce-scattered"),
    "zero_optimization.log_trace_cache_warnings": (SIZING, None, "no trace cache"),
    "zero_optimization.offload_optimizer.device": (MAPPED, None, "offload: none, cpu, nvme"),
    "zero_optimization.offload_optimizer.nvme_path": (MAPPED, None, "offload_dir"),
    "zero_optimization.offload_optimizer.pin_memory": (MAPPED, None,
                                                       "OffloadConfig.pin_memory"),
    "zero_optimization.offload_optimizer.buffer_count": (SIZING, None, "NVMe buffers are "
                                                                       "sized in bytes"),
    "zero_optimization.offload_optimizer.fast_init": (SIZING, None, "no init pass"),
    "zero_optimization.offload_optimizer.pipeline_read": (SIZING, None, "reads are "
                                                                        "pipelined"),
    "zero_optimization.offload_optimizer.pipeline_write": (SIZING, None, "writes are "
                                                                         "pipelined"),
    "zero_optimization.offload_optimizer.ratio": (ALWAYS, (1, 1.0), "all of the optimizer "
                                                                    "state is offloaded"),
    "zero_optimization.offload_param.device": (MAPPED, None, "offload_params=True"),
    "zero_optimization.offload_param.nvme_path": (MAPPED, None, "offload_dir"),
    "zero_optimization.offload_param.pin_memory": (MAPPED, None, "OffloadConfig.pin_memory"),
    "zero_optimization.offload_param.buffer_count": (SIZING, None, "buffers are sized in "
                                                                   "bytes"),
    "zero_optimization.offload_param.buffer_size": (SIZING, None, "buffers are sized in "
                                                                  "bytes"),
    "zero_optimization.offload_param.max_in_cpu": (SIZING, None, "no host cache of "
                                                                 "NVMe shards"),
    # NVMe async I/O
    "aio.block_size": (SIZING, None, "I/O sizes are OffloadConfig's"),
    "aio.queue_depth": (SIZING, None, "I/O sizes are OffloadConfig's"),
    "aio.thread_count": (SIZING, None, "OffloadConfig.io_threads"),
    "aio.single_submit": (SIZING, None, "I/O sizes are OffloadConfig's"),
    "aio.overlap_events": (SIZING, None, "I/O sizes are OffloadConfig's"),
    # monitors and profilers: off only
    "flops_profiler.enabled": (ALWAYS, _F, "no flops profiler"),
    "tensorboard.enabled": (ALWAYS, _F, "no monitor: log from the training loop"),
    "wandb.enabled": (ALWAYS, _F, "no monitor: log from the training loop"),
    "csv_monitor.enabled": (ALWAYS, _F, "no monitor: log from the training loop"),
    "comms_logger.enabled": (ALWAYS, _F, "no comms logger (see opt.stats())"),
    "elasticity.enabled": (ALWAYS, _F, "no elastic batch sizes"),
    "activation_checkpointing": (REFUSED, None, "use torch.utils.checkpoint in the model"),
    "checkpoint": (REFUSED, None, "checkpoints are zkernels.checkpoint folders"),
    "pipeline": (REFUSED, None, "no pipeline parallelism"),
    "compression_training": (REFUSED, None, "no compression training"),
}

# Blocks whose "enabled: false" switches every other key of theirs off.
_SWITCHED = ("fp16", "bf16", "amp", "flops_profiler", "tensorboard", "wandb", "csv_monitor",
             "comms_logger", "elasticity")
_OPT_TYPES = ("adam", "adamw")
_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
_logged: set = set()


def _log_once(key: str, disposition: str, why: str) -> None:
    if key not in _logged:
        _logged.add(key)
        what = "has no effect here" if disposition == SIZING else "is what zkernels does"
        logger.info("DeepSpeed config %s: accepted, %s (%s)", key, what, why)


def _flatten(block: dict, prefix: str = "") -> Dict[str, Any]:
    out = {}
    for k, v in block.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict) and name not in ("optimizer.params", "scheduler.params") \
                and name not in KEYS:
            sub = _flatten(v, name + ".")
            out.update(sub if sub else {name: v})
        elif isinstance(v, dict) and name in ("optimizer.params", "scheduler.params"):
            out.update({f"{name}.{kk}": vv for kk, vv in v.items()})
        else:
            out[name] = v
    return out


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _hidden_size(model) -> Optional[int]:
    cfg = getattr(model, "config", None)
    for c in (cfg, getattr(cfg, "text_config", None)):
        if c is None:
            continue
        if getattr(c, "hidden_size", None) is not None:
            return c.hidden_size
        if getattr(c, "hidden_sizes", None):
            return max(c.hidden_sizes)
    return None


def _hf_values(args, model, num_training_steps, world_size) -> Dict[str, Any]:
    """What ``HfTrainerDeepSpeedConfig`` fills each "auto" with (None: no source here)."""
    fill: Dict[str, Any] = {"scheduler.params.warmup_min_lr": 0}
    if args is not None:
        micro, gas = args.per_device_train_batch_size, args.gradient_accumulation_steps
        fill.update({
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": gas,
            "train_batch_size": args.world_size * micro * gas,
            "gradient_clipping": args.max_grad_norm,
            "optimizer.params.lr": args.learning_rate,
            "optimizer.params.betas": [args.adam_beta1, args.adam_beta2],
            "optimizer.params.eps": args.adam_epsilon,
            "optimizer.params.weight_decay": args.weight_decay,
            "scheduler.params.warmup_max_lr": args.learning_rate,
            "fp16.enabled": bool(args.fp16 or args.fp16_full_eval),
            "bf16.enabled": bool(args.bf16 or args.bf16_full_eval),
        })
        if num_training_steps is not None:
            fill["scheduler.params.warmup_num_steps"] = max(
                1, args.get_warmup_steps(num_training_steps))
    if num_training_steps is not None:
        fill["scheduler.params.total_num_steps"] = num_training_steps
    h = _hidden_size(model)
    if h is not None:
        fill["zero_optimization.reduce_bucket_size"] = h * h
        fill["zero_optimization.stage3_prefetch_bucket_size"] = int(0.9 * h * h)
        fill["zero_optimization.stage3_param_persistence_threshold"] = 10 * h
    return fill


# Filled only where "auto" (transformers' fill_only): any other value stands.
_FILL_ONLY = ("scheduler.params.warmup_min_lr", "zero_optimization.reduce_bucket_size",
              "zero_optimization.stage3_prefetch_bucket_size",
              "zero_optimization.stage3_param_persistence_threshold")

_AUTO_SOURCE = {
    "zero_optimization.reduce_bucket_size": "model.config.hidden_size",
    "zero_optimization.stage3_prefetch_bucket_size": "model.config.hidden_size",
    "zero_optimization.stage3_param_persistence_threshold": "model.config.hidden_size",
    "scheduler.params.total_num_steps": "num_training_steps=",
    "scheduler.params.warmup_num_steps": "args= and num_training_steps=",
}


def _load(config) -> dict:
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            return json.load(f)
    if isinstance(config, dict):
        return json.loads(json.dumps(config))   # a deep copy of plain JSON values
    raise TypeError(f"config must be a path to a DeepSpeed JSON config or a dict, got "
                    f"{type(config).__name__}")


def _batch_sizes(flat: dict, world: int) -> Tuple[int, int, int]:
    """DeepSpeed's ``_set_batch_related_parameters``: two of three give the third."""
    tb = flat.get("train_batch_size")
    mb = flat.get("train_micro_batch_size_per_gpu")
    gas = flat.get("gradient_accumulation_steps")
    if tb is not None and mb is not None and gas is not None:
        pass
    elif tb is not None and mb is not None:
        gas = tb // mb // world
    elif tb is not None and gas is not None:
        mb = tb // world // gas
    elif mb is not None and gas is not None:
        tb = mb * gas * world
    elif tb is not None:
        gas, mb = 1, tb // world
    elif mb is not None:
        gas, tb = gas or 1, mb * world
    else:
        raise ValueError("train_batch_size or train_micro_batch_size_per_gpu must be given")
    gas = 1 if gas is None else gas
    for name, v in (("train_batch_size", tb), ("train_micro_batch_size_per_gpu", mb),
                    ("gradient_accumulation_steps", gas)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if tb != mb * gas * world:
        raise ValueError(f"train_batch_size {tb} != train_micro_batch_size_per_gpu {mb} x "
                         f"gradient_accumulation_steps {gas} x world size {world}")
    return tb, mb, gas


def read_config(config, *, args=None, model=None, num_training_steps=None,
                world_size: Optional[int] = None) -> Tuple[ZeroConfig, Dict[str, Any]]:
    """A DeepSpeed config as a :class:`~zkernels.ZeroConfig` and the rest of the run.

    Args:
        config: a path to a DeepSpeed JSON config, or its dict.
        args: a ``transformers.TrainingArguments`` filling "auto" values as transformers'
            ``HfTrainerDeepSpeedConfig`` does (and, like it, refusing a value that
            contradicts it).
        model: its ``config.hidden_size`` fills the "auto" bucket sizes (as transformers).
        num_training_steps: fills the schedulers' "auto" ``total_num_steps`` and
            ``warmup_num_steps``.
        world_size: for the batch sizes (default: the process group's, else 1).

    Returns:
        ``(zero_config, extras)``: ``extras`` holds ``optimizer`` (``ZeroOptimizer``'s
        ``lr``, ``betas``, ``eps``, ``weight_decay``, ``max_grad_norm`` and ``loss_scale``
        keywords), ``scheduler`` (None or ``{"type", "params"}``),
        ``train_batch_size``, ``train_micro_batch_size_per_gpu`` and
        ``gradient_accumulation_steps``.

    Raises:
        ValueError: a key not in :data:`KEYS`, a value zkernels cannot honour, or an "auto"
            with nothing to fill it, naming the key and why.
    """
    raw = _load(config)
    world = _world_size() if world_size is None else world_size
    flat = _flatten(raw)
    fill = _hf_values(args, model, num_training_steps, world)
    for key, value in list(flat.items()):
        if value == AUTO:
            if fill.get(key) is None:
                src = _AUTO_SOURCE.get(key, "args= (a TrainingArguments)")
                raise ValueError(f"DeepSpeed config {key}: 'auto' needs {src} to be filled "
                                 f"from (as transformers fills it)")
            flat[key] = fill[key]
        elif args is not None and key in fill and key not in _FILL_ONLY:
            want = fill[key]
            same = list(value) == list(want) if isinstance(want, list) else value == want
            if not same:
                raise ValueError(f"DeepSpeed config {key}={value!r} contradicts the "
                                 f"TrainingArguments' {want!r} (as transformers refuses it)")
    # Blocks switched off: their other keys do not apply.
    for block in _SWITCHED:
        if flat.get(f"{block}.enabled") is False:
            for key in [k for k in flat if k.startswith(block + ".") and
                        k != f"{block}.enabled"]:
                if key in KEYS:
                    del flat[key]
    if flat.get("fp16.enabled") and flat.get("bf16.enabled"):
        raise ValueError("DeepSpeed config: fp16.enabled and bf16.enabled are both true")
    for key, value in flat.items():
        entry = KEYS.get(key)
        if entry is None:
            raise ValueError(f"DeepSpeed config {key}: not a key zkernels knows (see "
                             f"zkernels.integrations.deepspeed.KEYS)")
        disposition, accepted, why = entry
        if disposition == REFUSED:
            raise ValueError(f"DeepSpeed config {key}: not supported ({why})")
        if accepted is not None and value not in accepted:
            raise ValueError(f"DeepSpeed config {key}={value!r}: not supported ({why})")
        if disposition in (ALWAYS, SIZING):
            _log_once(key, disposition, why)
    return _zero_config(flat), _extras(flat, world)


def _zero_config(flat: dict) -> ZeroConfig:
    z = "zero_optimization."
    stage = flat.get(z + "stage", 0)
    if stage not in (1, 2, 3):
        raise ValueError(f"DeepSpeed config zero_optimization.stage={stage!r}: zkernels runs "
                         f"ZeRO stages 1, 2 and 3 (0, plain data parallel, is not a "
                         f"ZeroOptimizer stage)")
    dtype = None
    if flat.get("fp16.enabled"):
        dtype = torch.float16
    elif flat.get("bf16.enabled"):
        dtype = torch.bfloat16
    reduce = flat.get("communication_data_type")
    off = {}
    for part in ("offload_optimizer", "offload_param"):
        device = flat.get(f"{z}{part}.device", "none")
        if device not in ("none", "cpu", "nvme", None):
            raise ValueError(f"DeepSpeed config {z}{part}.device={device!r}: 'none', 'cpu' or "
                             f"'nvme'")
        off[part] = None if device in ("none", None) else device
    kind, params = off["offload_optimizer"], off["offload_param"] is not None
    if params and off["offload_param"] != kind:
        raise ValueError(f"DeepSpeed config {z}offload_param.device="
                         f"{off['offload_param']!r}: zkernels keeps parameter shards beside "
                         f"the offloaded optimizer state, so offload_optimizer.device must be "
                         f"{off['offload_param']!r} too (got {kind!r})")
    path = flat.get(f"{z}offload_optimizer.nvme_path")
    ppath = flat.get(f"{z}offload_param.nvme_path")
    if params and kind == "nvme" and ppath is not None and path is not None and ppath != path:
        raise ValueError(f"DeepSpeed config {z}offload_param.nvme_path={ppath!r}: must be the "
                         f"offload_optimizer.nvme_path ({path!r}), zkernels' one NVMe folder")
    path = path if path is not None else ppath
    if kind != "nvme":
        path = None
    pins = {flat[k] for k in (f"{z}offload_optimizer.pin_memory", f"{z}offload_param.pin_memory")
            if k in flat and (kind is not None)}
    if len(pins) > 1:
        raise ValueError(f"DeepSpeed config {z}offload_param.pin_memory: zkernels pins both "
                         f"or neither (offload_optimizer.pin_memory differs)")
    oc_kwargs = {}
    if pins:
        oc_kwargs["pin_memory"] = bool(pins.pop())
    if kind is not None and flat.get(z + "sub_group_size") is not None:
        oc_kwargs["sub_group_numel"] = int(flat[z + "sub_group_size"])
    if kind is None and z + "sub_group_size" in flat:
        _log_once(z + "sub_group_size", SIZING, "applies only with offload")
    bucket = flat.get(z + "reduce_bucket_size")
    hpz = flat.get(z + "zero_hpz_partition_size", 1)
    mics = flat.get(z + "mics_shard_size", -1)
    return ZeroConfig.from_kwargs(
        stage=stage, param_dtype=dtype, reduce_dtype=reduce, offload=kind, offload_dir=path,
        offload_config=OffloadConfig(**oc_kwargs) if oc_kwargs else None,
        offload_params=params,
        bucket_bytes=int(bucket) * 4 if bucket is not None and stage < 3 else None,
        shard_size=None if mics in (-1, None) else int(mics),
        reshard_after_forward=True if hpz in (1, None) else int(hpz),
        quantize_weights="int8" if flat.get(z + "zero_quantized_weights") else None,
        quantize_grads="int4" if flat.get(z + "zero_quantized_gradients") else None)


def _extras(flat: dict, world: int) -> Dict[str, Any]:
    tb, mb, gas = _batch_sizes(flat, world)
    otype = flat.get("optimizer.type")
    if otype is not None and str(otype).lower() not in _OPT_TYPES:
        raise ValueError(f"DeepSpeed config optimizer.type={otype!r}: zkernels runs AdamW "
                         f"(type 'Adam' or 'AdamW')")
    p = "optimizer.params."
    opt: Dict[str, Any] = {k: flat[p + k] for k in ("lr", "eps", "weight_decay")
                           if p + k in flat}
    if p + "betas" in flat:
        opt["betas"] = tuple(flat[p + "betas"])
    clip = flat.get("gradient_clipping", 0.0)
    opt["max_grad_norm"] = float(clip) if clip else None
    if flat.get("fp16.enabled"):
        if flat.get("fp16.min_loss_scale") not in (None,):
            raise ValueError(f"DeepSpeed config fp16.min_loss_scale="
                             f"{flat['fp16.min_loss_scale']!r}: not supported (zkernels' "
                             f"loss scale has no floor)")
        ls = {}
        if "fp16.initial_scale_power" in flat:
            ls["init_scale"] = 2.0 ** flat["fp16.initial_scale_power"]
        if "fp16.loss_scale_window" in flat:
            ls["growth_interval"] = int(flat["fp16.loss_scale_window"])
        opt["loss_scale"] = LossScaleConfig(**ls)
    sched = None
    if "scheduler.type" in flat:
        stype = flat["scheduler.type"]
        if stype not in _SCHEDULERS:
            raise ValueError(f"DeepSpeed config scheduler.type={stype!r}: supported are "
                             f"{', '.join(_SCHEDULERS)}")
        sp = "scheduler.params."
        sched = {"type": stype, "params": {k[len(sp):]: v for k, v in flat.items()
                                           if k.startswith(sp)}}
        _check_scheduler(sched)
    elif any(k.startswith("scheduler.") for k in flat):
        raise ValueError("DeepSpeed config scheduler: needs a type")
    return {"optimizer": opt, "scheduler": sched, "train_batch_size": tb,
            "train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": gas}


_SCHED_PARAMS = {
    "WarmupLR": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                 "last_batch_iteration"},
    "WarmupDecayLR": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                      "total_num_steps", "last_batch_iteration"},
    "WarmupCosineLR": {"warmup_min_ratio", "warmup_num_steps", "cos_min_ratio",
                       "warmup_type", "total_num_steps", "last_batch_iteration"},
}


def _check_scheduler(sched: dict) -> None:
    t, params = sched["type"], sched["params"]
    extra = set(params) - _SCHED_PARAMS[t]
    if extra:
        raise ValueError(f"DeepSpeed config scheduler.params.{sorted(extra)[0]}: not a "
                         f"parameter of {t}")
    if t != "WarmupLR" and "total_num_steps" not in params:
        raise ValueError(f"DeepSpeed config scheduler.params.total_num_steps: {t} needs it")
    n = params.get("warmup_num_steps", 1000)
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"DeepSpeed config scheduler.params.warmup_num_steps must be a "
                         f"positive integer, got {n!r}")
    if params.get("warmup_type", "log") not in ("log", "linear"):
        raise ValueError(f"DeepSpeed config scheduler.params.warmup_type="
                         f"{params['warmup_type']!r}: 'log' or 'linear'")


class _DeepSpeedLambda:
    """DeepSpeed's schedule as a ``LambdaLR`` factor of the group's ``lr``: LambdaLR's epoch
    e is DeepSpeed's ``last_batch_iteration`` e - 1 (DeepSpeed sets the iteration -1 lr at
    construction, LambdaLR the epoch 0 one). Plain numbers only, so LambdaLR's state_dict
    holds them."""

    def __init__(self, kind: str, params: dict, base_lr: float) -> None:
        self.kind, self.base_lr = kind, float(base_lr)
        self.warmup_type = params.get("warmup_type", "log")
        self.warmup = max(2, params.get("warmup_num_steps", 1000))
        self.total = params.get("total_num_steps", 0)
        self.min_lr = float(params.get("warmup_min_lr", 0.0))
        self.max_lr = float(params.get("warmup_max_lr", 0.001 if kind == "WarmupDecayLR"
                                       else base_lr))
        self.min_ratio = float(params.get("warmup_min_ratio", 0.0))
        self.cos_min_ratio = float(params.get("cos_min_ratio", 0.0001))
        if kind != "WarmupCosineLR" and self.base_lr == 0:
            raise ValueError(f"{kind} with an optimizer lr of 0: zkernels schedules lr as a "
                             f"factor of the optimizer's lr")

    def _warm(self, it: int) -> float:
        if self.warmup_type == "log":
            return 1.0 / math.log(self.warmup) * math.log(it + 1)
        return it / self.warmup

    def __call__(self, epoch: int) -> float:
        it = epoch - 1
        if self.kind == "WarmupCosineLR":
            if it < 0:
                return 0.0
            if it < self.warmup:
                return self.min_ratio + self._warm(it) * (1.0 - self.min_ratio)
            progress = min(1.0, (it - self.warmup + 1) / max(1, self.total - self.warmup))
            r = (1 + math.cos(math.pi * progress)) / 2
            return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * r)
        if it < 0:
            gamma = 0.0
        elif it < self.warmup:
            gamma = self._warm(it)
        elif self.kind == "WarmupDecayLR":
            gamma = max(0.0, float(self.total - it) / float(max(1.0, self.total - self.warmup)))
        else:
            gamma = 1.0
        return (self.min_lr + (self.max_lr - self.min_lr) * gamma) / self.base_lr


def build_scheduler(optimizer, scheduler: dict):
    """DeepSpeed's ``WarmupLR`` / ``WarmupDecayLR`` / ``WarmupCosineLR`` as a
    ``torch.optim.lr_scheduler.LambdaLR`` over ``optimizer``'s groups (``scheduler`` as
    ``read_config``'s ``extras["scheduler"]``)."""
    lambdas = [_DeepSpeedLambda(scheduler["type"], scheduler["params"], g["lr"])
               for g in optimizer.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)


def _client_groups(model, model_parameters, optimizer):
    """``ZeroOptimizer`` param groups from a client optimizer or ``model_parameters``."""
    if optimizer is not None:
        if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError("optimizer= as a callable is not supported: pass a "
                             "torch.optim.AdamW or the config's optimizer block")
        ok = type(optimizer) is torch.optim.AdamW or (
            type(optimizer) is torch.optim.Adam and
            all(g["weight_decay"] == 0 for g in optimizer.param_groups))
        if not ok:
            raise ValueError(f"optimizer={type(optimizer).__name__}: zkernels runs AdamW; pass "
                             f"a torch.optim.AdamW (or Adam without weight decay)")
        return [{"params": list(g["params"]), "lr": g["lr"], "betas": tuple(g["betas"]),
                 "eps": g["eps"], "weight_decay": g["weight_decay"]}
                for g in optimizer.param_groups]
    if model_parameters is None:
        return None
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return [dict(g, params=list(g["params"])) for g in items]
    return [{"params": items}]


class ZeroEngine:
    """DeepSpeed's engine over a :class:`~zkernels.ZeroOptimizer` (see :func:`initialize`).

    Attributes:
        module: the model.
        optimizer: the ZeroOptimizer.
        lr_scheduler: the scheduler stepped at each optimizer step (or None).
        global_steps: optimizer steps taken; ``micro_steps``: ``step()`` calls.
    """

    def __init__(self, module, optimizer, lr_scheduler, extras: dict) -> None:
        self.module, self.optimizer, self.lr_scheduler = module, optimizer, lr_scheduler
        self._extras = extras
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        self.module.eval()
        return self

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._extras["train_micro_batch_size_per_gpu"]

    def train_batch_size(self) -> int:
        return self._extras["train_batch_size"]

    def gradient_accumulation_steps(self) -> int:
        return self._extras["gradient_accumulation_steps"]

    def is_gradient_accumulation_boundary(self) -> bool:
        """True on the micro-step whose ``step()`` steps the optimizer (DeepSpeed's
        ``(micro_steps + 1) % gas == 0``)."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Backward of ``loss / gradient_accumulation_steps`` (DeepSpeed's default
        ``scale_wrt_gas``); off the boundary inside ``opt.no_sync()``, so gradients are
        reduced once per optimizer step. Returns the scaled loss, as DeepSpeed does."""
        gas = self.gradient_accumulation_steps()
        scaled = loss / gas if gas > 1 else loss
        if self.is_gradient_accumulation_boundary():
            self.optimizer.backward(scaled)
        else:
            with self.optimizer.no_sync():
                self.optimizer.backward(scaled)
        return scaled

    def step(self) -> None:
        """At the boundary: the optimizer step, ``zero_grad`` and the scheduler step (held
        back when the step was skipped on an overflow, as DeepSpeed does); every call
        counts a micro-step."""
        if self.is_gradient_accumulation_boundary():
            self.optimizer.step()
            self.optimizer.zero_grad()
            if self.lr_scheduler is not None and not self.optimizer.step_was_skipped:
                self.lr_scheduler.step()
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
        self.micro_steps += 1

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def get_lr(self):
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self):
        return self.optimizer.last_grad_norm

    def save_checkpoint(self, save_dir, tag=None, client_state=None,
                        save_latest: bool = True) -> bool:
        """``save_dir/tag`` (default tag ``global_step{N}``) as a ``zkernels.checkpoint``
        folder holding ``client_state``, the counters and the scheduler; then ``latest``
        (the tag) beside it, as DeepSpeed writes it. Collective."""
        from .. import checkpoint
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        extra = {"client_state": dict(client_state or {}),
                 "global_steps": self.global_steps, "global_samples": self.global_samples,
                 "micro_steps": self.micro_steps,
                 "lr_scheduler": None if self.lr_scheduler is None else
                 self.lr_scheduler.state_dict()}
        os.makedirs(save_dir, exist_ok=True)
        checkpoint.save(self.optimizer, os.path.join(save_dir, tag), model_extra=extra)
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if save_latest and rank == 0:
            with open(os.path.join(save_dir, "latest.tmp"), "w") as f:
                f.write(tag)
            os.replace(os.path.join(save_dir, "latest.tmp"), os.path.join(save_dir, "latest"))
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        return True

    def load_checkpoint(self, load_dir, tag=None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False):
        """Restore ``load_dir/tag`` (default: the tag in ``load_dir/latest``); returns
        ``(path, client_state)``, or ``(None, None)`` without a ``latest`` as DeepSpeed
        does. Collective."""
        from .. import checkpoint
        if not load_optimizer_states or load_module_only:
            raise ValueError("load_optimizer_states=False / load_module_only=True: zkernels "
                             "checkpoints always restore the optimizer state")
        if tag is None:
            latest = os.path.join(load_dir, "latest")
            if not os.path.isfile(latest):
                logger.warning("no 'latest' file in %s: nothing loaded", load_dir)
                return None, None
            with open(latest) as f:
                tag = f.read().strip()
        path = os.path.join(load_dir, str(tag))
        extra = checkpoint.load(self.optimizer, path)
        self.global_steps = extra["global_steps"]
        self.global_samples = extra["global_samples"]
        self.micro_steps = extra["micro_steps"]
        if load_lr_scheduler_states and self.lr_scheduler is not None \
                and extra["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        return path, extra["client_state"]


def initialize(args=None, model=None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, config=None, config_params=None,
               collate_fn=None, dist_init_required=None, mpu=None):
    """``deepspeed.initialize`` on a :class:`~zkernels.ZeroOptimizer`: returns
    ``(engine, optimizer, dataloader, lr_scheduler)``.

    ``config`` (or ``config_params``, or ``args.deepspeed_config``) is read by
    :func:`read_config`. The optimizer is a ZeroOptimizer over ``model`` with the config's
    hyper-parameters, or a client ``torch.optim.AdamW``'s param groups; ``model_parameters``
    limits or groups what it trains. ``lr_scheduler``: a scheduler already built, or a
    callable taking the optimizer (as DeepSpeed takes them); else the config's
    ``scheduler`` block, else None. ``training_data``: a dataset, loaded in micro batches
    through a ``DistributedSampler`` over the ranks (DeepSpeed's data loader).
    """
    from ..zero.optimizer import ZeroOptimizer
    if model is None:
        raise ValueError("initialize() needs model=")
    if mpu is not None:
        raise ValueError("mpu= (model parallelism) is not supported")
    if config is None:
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None)
    if config is None:
        raise ValueError("initialize() needs config= (a DeepSpeed config dict or JSON path)")
    if dist_init_required and not dist.is_initialized():
        dist.init_process_group()
    zcfg, extras = read_config(config, model=model)
    groups = _client_groups(model, model_parameters, optimizer)
    opt_kwargs = dict(extras["optimizer"])
    if optimizer is not None:
        for k in ("lr", "betas", "eps", "weight_decay"):
            opt_kwargs.pop(k, None)
    opt = ZeroOptimizer(model, config=zcfg, param_groups=groups, **opt_kwargs)
    if lr_scheduler is not None and callable(lr_scheduler) and \
            not hasattr(lr_scheduler, "step"):
        lr_scheduler = lr_scheduler(opt)
    elif lr_scheduler is not None and getattr(lr_scheduler, "optimizer", opt) is not opt:
        raise ValueError("lr_scheduler= was built over another optimizer: pass a callable "
                         "taking the optimizer")
    if lr_scheduler is None and extras["scheduler"] is not None:
        lr_scheduler = build_scheduler(opt, extras["scheduler"])
    engine = ZeroEngine(model, opt, lr_scheduler, extras)
    loader = None
    if training_data is not None:
        from torch.utils.data import DataLoader, DistributedSampler
        # Every rank draws its own micro-batches, hybrid sharding included (the shard group
        # is smaller than the data-parallel world).
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        sampler = DistributedSampler(training_data, num_replicas=world, rank=rank)
        loader = DataLoader(training_data, batch_size=extras["train_micro_batch_size_per_gpu"],
                            sampler=sampler, collate_fn=collate_fn)
    return engine, opt, loader, lr_scheduler
