"""``ZeroConfig``: one frozen description of a ZeRO run, validated once, here.

[Note: one config]
``ZeroOptimizer``, ``estimate_memory``, the ladder (``plan``, ``stage="auto"``) and the Trainer
integration all read a :class:`ZeroConfig`: its parts say how parameters are sharded
(:class:`ShardingConfig`: stage, hybrid shard size, reshard after forward), in which dtypes
(:class:`PrecisionConfig`), where the fp32 work lives (:class:`OffloadSpec`, its knobs an
:class:`~zkernels.zero.planning.offload_config.OffloadConfig`), how collectives are compressed
(:class:`QuantizeConfig`), how gradients are bucketed (:class:`BucketConfig`) and in which
format the optimizer state is kept (:class:`StateConfig`), as FSDP2's
``MixedPrecisionPolicy`` and ``OffloadPolicy`` are frozen dataclasses. Each part checks its own
fields; :class:`ZeroConfig` checks how they combine. What needs the ranks or the model (a
shard size dividing the world, ``reshard_after_forward=R`` dividing it, the offload folder on
disk, the comm engine's support for quantization) is checked by the optimizer once it knows
them. The constructor's keywords (and any other flat source: a JSON ``zero_config``, later a
DeepSpeed ``zero_optimization`` block) become a config through :meth:`ZeroConfig.from_kwargs`,
the one path from names to parts.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field, fields, replace
from typing import Dict, Iterable, Optional, Sequence, Tuple, Union

import torch

from ...ops.quant import check_block_size
from .offload_config import OffloadConfig
from .policy import OFFLOADS, STAGES, StagePolicy
from .state_format import parse_state_dtype

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
           "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16, "half": torch.float16}


def parse_dtype(value, name: str) -> Optional[torch.dtype]:
    """None, fp32/bf16/fp16 as a ``torch.dtype`` or a name ("bf16", ...) -> the dtype."""
    if isinstance(value, str) and value.lower() in _DTYPES:
        return _DTYPES[value.lower()]
    if value is None or value in set(_DTYPES.values()):
        return value
    raise ValueError(f"{name} must be None, torch.float32, torch.bfloat16 or torch.float16, "
                     f"got {value!r} (names are accepted too: {', '.join(sorted(_DTYPES))})")


@dataclass(frozen=True)
class ShardingConfig:
    """What is sharded and over how many ranks.

    Attributes:
        stage: 1, 2, 3 or "auto": the lowest rung whose estimate fits the device (``auto.py``;
            logs its choice at INFO): an ``offload`` kind limits the rungs to that kind; left
            None, CPU offload is offered on a GPU, NVMe too with an ``offload_dir``. 0 is data
            parallel, the estimator's baseline (``ZeroOptimizer`` refuses it).
        shard_size: hybrid sharding (FSDP2's HSDP): shard over groups of K consecutive ranks
            (K divides N) and replicate across the N/K groups, each reduced gradient shard
            all-reduced across them; bytes per rank are the formula with N -> K ([Note:
            hybrid sharding is a group shape] in ``zkernels/comm/hybrid.py``). None: all N.
        reshard_after_forward: stage 3: free each unit after forward and gather it again for
            backward (True: 3Ψ per step) or keep it to backward (False: 2Ψ); an int R (FSDP2's
            integer, ZeRO++'s hpZ; 1 < R < K, R divides K) keeps a chunk over R ranks, so the
            backward gather runs within them for pΨ/R more memory ([Note: secondary shards]).
    """

    stage: Union[int, str] = 1
    shard_size: Optional[int] = None
    reshard_after_forward: Union[bool, int] = True

    def __post_init__(self) -> None:
        s = self.stage
        if not (s == "auto" and isinstance(s, str)) and (isinstance(s, bool) or
                                                         s not in STAGES):
            raise ValueError(f"stage must be one of (1, 2, 3) or 'auto' (0: data parallel, "
                             f"the estimator's baseline), got {s!r}")
        k = self.shard_size
        if k is not None and (isinstance(k, bool) or not isinstance(k, int)):
            raise TypeError(f"shard_size must be an int (ranks per shard group) or None, got "
                            f"{type(k).__name__}")
        if k is not None and k < 1:
            raise ValueError(f"shard_size must be >= 1, got {k}")
        if not isinstance(self.reshard_after_forward, (bool, int)):
            raise TypeError(f"reshard_after_forward must be a bool or an int (ranks of the "
                            f"secondary shard group), got "
                            f"{type(self.reshard_after_forward).__name__}")

    @property
    def policy(self) -> Optional[StagePolicy]:
        """The stage's registry entry (None for "auto")."""
        return None if self.stage == "auto" else STAGES[self.stage]

    @property
    def secondary_size(self) -> Optional[int]:
        """R of an int ``reshard_after_forward`` (None for a bool)."""
        r = self.reshard_after_forward
        return None if isinstance(r, bool) else r


@dataclass(frozen=True)
class PrecisionConfig:
    """Dtypes of the compute copy and of the gradient reduction (names are accepted and
    stored as ``torch.dtype``).

    Attributes:
        param_dtype: None (pure fp32: the parameter is its own master; for a model whose
            trainable parameters are all bf16 or all fp16, that dtype, see [Note:
            low-precision models] in ``parameters/groups.py``) or bf16 / fp16 (an fp32
            master shard beside it).
        reduce_dtype: None (fp32; for the estimator's data parallel row, the gradients' own
            dtype, as DDP reduces them) or a dtype.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):   # frozen: normalized in place, once
            object.__setattr__(self, name, parse_dtype(getattr(self, name), name))


@dataclass(frozen=True)
class OffloadSpec:
    """Where the fp32 work lives (the registry's ``OFFLOADS`` says what each kind moves).

    Attributes:
        kind: None (the device), "cpu" (fp32 master, moments and gradient shard in host RAM,
            the step on the CPU) or "nvme" (moments and master in files under ``dir``,
            streamed through a fixed host budget); stages 2-3 (``state/engine.py``).
        dir: "nvme": an existing folder (checked on disk by the optimizer; the estimator
            needs none); the run's files go in a folder of their own inside, removed by
            ``close()``. With ``stage="auto"`` a folder offers the NVMe rungs.
        params: stage 3: the parameter shards off the device between uses, brought in ahead
            of each all-gather (host RAM with "cpu", files with "nvme"). With "auto", True
            limits the rungs to stage 3 with offload; False lets the ladder still take it
            where a stage-3 offload rung does not fit without it.
        config: an :class:`OffloadConfig` (pinning, sub-groups, NVMe budgets); None: defaults.
    """

    kind: Optional[str] = None
    dir: Optional[Union[str, os.PathLike]] = None
    params: bool = False
    config: Optional[OffloadConfig] = None

    def __post_init__(self) -> None:
        if self.kind is not None and not (isinstance(self.kind, str) and
                                          self.kind in OFFLOADS):
            raise ValueError(f"offload must be None, 'cpu' or 'nvme', got {self.kind!r}")
        if self.config is not None and not isinstance(self.config, OffloadConfig):
            raise TypeError(f"offload_config must be a zkernels.zero.OffloadConfig or None, "
                            f"got {type(self.config).__name__}")
        if self.dir is not None and not isinstance(self.dir, (str, os.PathLike)):
            raise TypeError(f"offload_dir must be a path, got {type(self.dir).__name__}")
        if not isinstance(self.params, bool):
            raise TypeError(f"offload_params must be a bool, got {type(self.params).__name__}")

    @property
    def options(self) -> OffloadConfig:
        """The knobs in force (``OffloadConfig()`` when none were given)."""
        return self.config if self.config is not None else OffloadConfig()


@dataclass(frozen=True)
class QuantizeConfig:
    """ZeRO++'s compressed collectives (see ``zkernels/comm/quantized.py``).

    Attributes:
        weights: None or "int8": stage 3's parameter all-gathers (qwZ) move int8 blocks and
            fp32 scales; master and shards stay exact.
        grads: None, "int8" or "int4": each gradient reduce-scatter (qgZ, stages 1-3) is an
            all-to-all of codes, dequantize-summed in fp32; hybrid's cross-group all-reduce
            stays exact.
        block: elements per fp32 scale, a power of two in [2, 8192].
    """

    weights: Optional[str] = None
    grads: Optional[str] = None
    block: int = 256

    def __post_init__(self) -> None:
        from ...comm.quantized import GRAD_FORMATS, WEIGHT_FORMATS, _bits, check_block_size
        if self.grads is not None:
            _bits(self.grads, GRAD_FORMATS, "quantize_grads")
        if self.weights is not None:
            _bits(self.weights, WEIGHT_FORMATS, "quantize_weights")
        check_block_size(self.block, "quantize_block")

    @property
    def active(self) -> bool:
        return self.weights is not None or self.grads is not None


@dataclass(frozen=True)
class BucketConfig:
    """Gradient buckets.

    Attributes:
        bucket_bytes: reduce-buffer bytes per bucket (a larger parameter gets its own;
            stages 1-2, stage 3 reduces one unit at a time); None: sized from the model
            ([Note: buckets sized from the model] in ``buckets.py``); 0 (estimator only):
            count no buffers.
    """

    bucket_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        b = self.bucket_bytes
        if b is not None and (isinstance(b, bool) or not isinstance(b, int)):
            raise TypeError(f"bucket_bytes must be an int, got {type(b).__name__}")
        if b is not None and b < 0:
            raise ValueError(f"bucket_bytes must be None or an int >= 0, got {b!r}")


@dataclass(frozen=True)
class StateConfig:
    """The fused AdamW's state format (see [Note: low-bit moment formats] in
    ``zkernels/reference/adamw_lowbit.py`` and [Note: low-bit state in shards] in
    ``state/lowbit_state.py``); a param group's ``"state_dtype"`` key overrides
    ``state_dtype`` for its parameters (``state_format.py``).

    Attributes:
        state_dtype: None (fp32 moments, 8 bytes per element), ``torch.bfloat16`` (bf16
            moments, 4) or ``"int8"`` (blockwise 8-bit moments, 2 plus an fp32 scale per
            block and moment); names ``"fp32"``/``"bf16"`` are accepted.
        block_size: elements per quantization block of ``"int8"`` (a power of two in
            [2, 8192]); every parameter and shard starts at a multiple of it.
        master_dtype: None (an fp32 master, 4 bytes per element) or ``torch.bfloat16``
            (the fused AdamW's master kept in bf16, the update rounded to nearest even: 2
            bytes per element, none where the bf16 parameter shard is the master; needs bf16
            parameters, see [Note: bf16 master] in ``state/bf16_master.py``).
    """

    state_dtype: Optional[Union[str, torch.dtype]] = None
    block_size: int = 256
    master_dtype: Optional[torch.dtype] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "state_dtype", parse_state_dtype(self.state_dtype,
                                                                  "state_dtype"))
        check_block_size(self.block_size, "state_block_size")
        master = parse_dtype(self.master_dtype, "master_dtype")
        if master not in (None, torch.float32, torch.bfloat16):
            raise ValueError(f"master_dtype must be None (fp32) or torch.bfloat16, got "
                             f"{master}")
        object.__setattr__(self, "master_dtype", None if master == torch.float32 else master)


@dataclass(frozen=True)
class ZeroConfig:
    """One ZeRO run: its parts (see [Note: one config]), checked together at construction
    (TypeError / ValueError naming the argument: a part of the wrong type, or parts that do
    not combine, e.g. offload below stage 2, quantized weights below stage 3)."""

    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    offload: OffloadSpec = field(default_factory=OffloadSpec)
    quantization: QuantizeConfig = field(default_factory=QuantizeConfig)
    buckets: BucketConfig = field(default_factory=BucketConfig)
    state: StateConfig = field(default_factory=StateConfig)

    def __post_init__(self) -> None:
        for f in fields(self):
            if not isinstance(getattr(self, f.name), f.default_factory):
                raise TypeError(f"ZeroConfig.{f.name} must be a {f.default_factory.__name__}, "
                                f"got {type(getattr(self, f.name)).__name__}")
        off, stage, auto = self.offload, self.stage, self.stage == "auto"
        if off.kind is None and off.config is not None and not auto:
            raise ValueError("offload_config applies only with offload='cpu' or 'nvme'")
        if off.kind == "cpu" and off.config is not None and off.config.resume_dir:
            raise ValueError("OffloadConfig.resume_dir applies only to offload='nvme'")
        if off.kind != "nvme" and off.dir is not None and not (auto and off.kind is None):
            raise ValueError(f"offload_dir applies only to offload='nvme' (got offload="
                             f"{off.kind!r}, offload_dir={off.dir!r})")
        pdt = self.precision.param_dtype
        if self.state.master_dtype is not None and pdt not in (None, torch.bfloat16):
            raise ValueError(f"master_dtype=torch.bfloat16 needs bf16 parameters "
                             f"(param_dtype=torch.bfloat16 or a bf16 model), got param_dtype="
                             f"{pdt}: a bf16 master would hold less than the parameters it "
                             f"updates")
        if auto:
            return
        policy = self.sharding.policy
        reshard = self.sharding.reshard_after_forward
        if not policy.shards_params and reshard is not True:
            what = "reshard_after_forward=False and units= apply" if reshard is False else \
                f"reshard_after_forward={reshard} applies"
            raise ValueError(f"{what} only to stage=3 (the stage that shards parameters), got "
                             f"stage={stage}")
        min_stage = OFFLOADS[off.kind].min_stage
        if stage < min_stage:
            allowed = " or ".join(str(s) for s in STAGES if s >= min_stage)
            raise ValueError(f"offload={off.kind!r} needs stage {allowed}, got stage {stage}: "
                             f"stage {stage} keeps full gradients on the device until step(), "
                             f"so there is no gradient shard to stream to the host during "
                             f"backward")
        if off.params and not policy.shards_params:
            raise ValueError(f"offload_params=True applies only to stage=3, got stage="
                             f"{stage}: stages 1-2 keep the full parameters on the device "
                             f"(every rank computes with all of them), so there is no "
                             f"parameter shard to keep in host RAM")
        if off.params and off.kind is None:
            raise ValueError("offload_params=True needs offload='cpu' or 'nvme': the "
                             "parameter shards go to host RAM beside the offloaded optimizer "
                             "state (pass offload='cpu' too)")
        q = self.quantization
        if q.active and stage == 0:
            raise ValueError("quantize_grads / quantize_weights apply to ZeRO stages 1-3, not "
                             "to stage 0 (data parallel)")
        if q.weights is not None and not policy.shards_params:
            raise ValueError(f"quantize_weights={q.weights!r} applies to stage 3 (the stage "
                             f"that gathers parameters before use); stage {stage} keeps them "
                             f"whole and its post-update all-gather exact")

    @property
    def stage(self) -> Union[int, str]:
        return self.sharding.stage

    @classmethod
    def from_kwargs(cls, **kwargs) -> "ZeroConfig":
        """The config of ``ZeroOptimizer``'s keyword arguments of the same names (the one
        path from flat names to parts, :data:`KEYWORDS`: the constructor, a JSON
        ``zero_config``, a DeepSpeed ``zero_optimization`` reader); ``ZeroConfig()`` with
        :meth:`with_keywords`.

        Raises:
            TypeError: a name that is not in :data:`KEYWORDS` (the closest one suggested).
        """
        return cls().with_keywords("ZeroConfig.from_kwargs()", **kwargs)

    def with_keywords(self, where: str = "ZeroConfig.with_keywords()", **kwargs
                      ) -> "ZeroConfig":
        """This config with the fields the flat keywords name replaced (the keyword wins over
        the field), every part and the combination checked again.

        Args:
            where: the caller named in an error (``"ZeroOptimizer()"``).
            **kwargs: names of :data:`KEYWORDS` (``stage=3``, ``offload="cpu"``, ...).

        Raises:
            TypeError: a name that is not in :data:`KEYWORDS` (the closest one suggested).
            ValueError: a value or combination the parts refuse (naming the keyword).
        """
        unknown = [k for k in kwargs if k not in KEYWORDS]
        if unknown:
            raise unexpected_keywords(where, unknown, KEYWORDS)
        parts = {}
        for name, value in kwargs.items():
            part, attr = KEYWORDS[name]
            parts.setdefault(part, {})[attr] = value
        if not parts:
            return self
        return replace(self, **{f.name: replace(getattr(self, f.name), **parts[f.name])
                                for f in fields(self) if f.name in parts})   # parts in order

    def at_rung(self, stage: int, offload: Optional[str], offload_params: bool) -> "ZeroConfig":
        """This config on one rung of the ladder (``stage="auto"``'s choice, a ``plan`` row):
        the NVMe folder kept only for an NVMe rung, the offload knobs only for an offload
        rung."""
        off = OffloadSpec(offload, self.offload.dir if offload == "nvme" else None,
                          offload_params, self.offload.config if offload else None)
        return replace(self, sharding=replace(self.sharding, stage=stage), offload=off)

    def with_param_dtype(self, param_dtype: Optional[torch.dtype]) -> "ZeroConfig":
        """This config computing in ``param_dtype`` (a bf16/fp16 model's own dtype: [Note:
        low-precision models] in ``parameters/groups.py``); itself when it already does."""
        if param_dtype == self.precision.param_dtype:
            return self
        return replace(self, precision=replace(self.precision, param_dtype=param_dtype))


# [Note: one keyword per field]
# Every field of every part of a ZeroConfig has one flat keyword, its name as
# ``ZeroOptimizer(...)``, ``estimate_memory``, the JSON ``zero_config`` and the readers spell
# it; this table is the only place that maps one to the other (``from_kwargs``,
# ``with_keywords``, ``zkernels/zero/config_keywords.py``). A new field needs its row here:
# tests/zero/test_constructor.py walks ``dataclasses.fields`` and fails on a field with none.
KEYWORDS: Dict[str, Tuple[str, str]] = {
    "stage": ("sharding", "stage"),
    "shard_size": ("sharding", "shard_size"),
    "reshard_after_forward": ("sharding", "reshard_after_forward"),
    "param_dtype": ("precision", "param_dtype"),
    "reduce_dtype": ("precision", "reduce_dtype"),
    "offload": ("offload", "kind"),
    "offload_dir": ("offload", "dir"),
    "offload_params": ("offload", "params"),
    "offload_config": ("offload", "config"),
    "quantize_weights": ("quantization", "weights"),
    "quantize_grads": ("quantization", "grads"),
    "quantize_block": ("quantization", "block"),
    "bucket_bytes": ("buckets", "bucket_bytes"),
    "state_dtype": ("state", "state_dtype"),
    "state_block_size": ("state", "block_size"),
    "master_dtype": ("state", "master_dtype"),
}


def _field_default(part: str, attr: str):
    """The declared default of field ``attr`` of ZeroConfig's part ``part``."""
    cls = next(f.default_factory for f in fields(ZeroConfig) if f.name == part)
    return next(f.default for f in fields(cls) if f.name == attr)


# The keywords that build a ZeroConfig, with their defaults (the parts' field defaults).
CONFIG_KWARGS = {name: _field_default(*where) for name, where in KEYWORDS.items()}


def unexpected_keywords(where: str, names: Sequence[str], known: Iterable[str]) -> TypeError:
    """The TypeError for keywords ``where`` does not take, each with the closest known name
    (``difflib.get_close_matches``), e.g. ``ZeroOptimizer() got an unexpected keyword 'stag';
    did you mean 'stage'?``."""
    known = sorted(set(known))

    def hint(name: str) -> str:
        close = difflib.get_close_matches(name, known, n=1)
        return f"did you mean {close[0]!r}?" if close else "no keyword of that name is close"

    if len(names) == 1:
        return TypeError(f"{where} got an unexpected keyword {names[0]!r}; {hint(names[0])}")
    return TypeError(f"{where} got unexpected keywords "
                     f"{', '.join(f'{n!r} ({hint(n)})' for n in names)}")


def resolve_stage(stage) -> Optional[int]:
    """The ZeRO stage ``ZeroOptimizer`` runs (1, 2 or 3), or None for ``"auto"`` (resolved
    once the world size is known: ``auto.py``).

    Raises:
        ValueError: not 1, 2, 3 or "auto" (0, data parallel, is only the estimator's).
    """
    ShardingConfig(stage)
    if stage == 0:
        raise ValueError("stage must be one of (1, 2, 3) or 'auto', got 0 (stage 0, data "
                         "parallel, is the estimator's baseline, not a ZeroOptimizer stage)")
    return None if stage == "auto" else int(stage)
