"""Where each keyword of ``ZeroOptimizer(model, config=None, **overrides)`` goes.

[Note: config-first constructor]
``ZeroOptimizer``'s signature names ``config`` and the keywords README's example uses
(``stage``, ``lr``, ``weight_decay``, ``param_dtype``, ``max_grad_norm``), as FSDP2's
``fully_shard`` names a handful; every other keyword it has ever taken by name is still taken,
through ``**overrides``, and routed here, by name, to one of three places:

* a :class:`~zkernels.ZeroConfig` field: ``planning/config.py``'s :data:`KEYWORDS` (flat name
  -> part and field, the one table every reader of flat names goes through);
* a run option (:data:`RUN_OPTIONS`, name -> default): what the run needs beside the plan a
  ZeroConfig describes (the process group, the ops backend, the hooks' knobs, the optimizer's
  class and the AdamW hyperparameters the constructor does not name);
* an optimizer hyperparameter: any other name that some optimizer takes (a definition's in
  ``zkernels.optimizers.REGISTRY``, such as AdEMAMix's ``alpha`` or ``beta3_warmup``, a known
  ``torch.optim`` class's, the given class's own) goes to the chosen optimizer, which checks it
  against its own list (``momentum=`` with AdamW is refused by AdamW, naming what it takes).

A name that is none of these raises ``TypeError`` naming it and the closest known name
(``ZeroOptimizer() got an unexpected keyword 'stag'; did you mean 'stage'?``), before anything
is built.

Config and keywords: ``config`` is the base and a keyword naming one of its fields wins
(``ZeroOptimizer(model, config=cfg, stage=3)`` runs ``cfg`` at stage 3), as DeepSpeed's
``initialize(config=..., **kwargs)`` lets a keyword override its config file and FSDP2 takes a
policy object beside plain arguments; the merged config is checked again as a whole (an
override that does not combine with the rest, e.g. ``stage=1`` over an offloading config,
raises the config's own error). A keyword is given when it is passed, even as None
(``param_dtype=None`` over a bf16 config computes in the model's dtype, ``offload=None``
drops the config's offload): the signature's ``stage`` and ``param_dtype`` default to
:data:`FROM_CONFIG`, the config's value (ZeroConfig's default without a config).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Dict, FrozenSet, Optional

import torch

from ..optimizers import REGISTRY
from .planning.config import KEYWORDS as CONFIG_KEYWORDS
from .planning.config import ZeroConfig, unexpected_keywords
from .planning.optimizer_spec import ELEMENTWISE, MATRIX, NAMES

class _FromConfig:
    """The default of the ZeroConfig keywords the signature names: the config's value
    (ZeroConfig's default without a config); any other value, None included, is given."""

    def __repr__(self) -> str:
        return "FROM_CONFIG"


FROM_CONFIG = _FromConfig()
# The constructor's run options taken through **overrides, with their defaults (each is
# documented on ZeroOptimizer).
RUN_OPTIONS: Dict[str, object] = {
    "betas": None, "eps": None, "param_groups": None, "optimizer": "adamw",
    "elementwise": False, "process_group": None, "mesh": None, "comm_backend": "auto",
    "timeout": None, "ops_backend": None, "loss_scale": None, "memory_budget_bytes": None,
    "nonfinite": "skip", "unused_grads": "skip", "units": None, "check_paths": True,
    "overlap_param_gather": False, "device": None, "param_init": None,
}
# The keywords ZeroOptimizer's signature names besides the model.
NAMED = ("config", "stage", "lr", "weight_decay", "param_dtype", "max_grad_norm")
# Every keyword ZeroOptimizer takes by name (optimizer hyperparameters aside): what a caller
# that forwards keywords (ZeroStrategy, the benchmarks) may check a name against.
KEYWORDS: FrozenSet[str] = frozenset(NAMED) | frozenset(CONFIG_KEYWORDS) | frozenset(RUN_OPTIONS)


def _init_keywords(cls: type) -> Optional[FrozenSet[str]]:
    """``cls.__init__``'s keywords besides ``params``; None when it takes ``**kwargs``."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return frozenset(n for n in params if n not in ("self", "params"))


def hyperparameter_names(optimizer) -> Optional[FrozenSet[str]]:
    """Every name an optimizer hyperparameter may have: each definition's
    (``zkernels.optimizers.REGISTRY``), each known ``torch.optim`` class's and ``optimizer``'s
    own when it is a class (or a class's name); None when that class takes any keyword.

    Which of them ``optimizer`` takes is its own check (``planning/optimizer_spec.py``).
    """
    names = {h.name for d in REGISTRY.values() for h in d.hparams}
    for cls in (*ELEMENTWISE, *MATRIX):
        names |= _init_keywords(cls) or set()
    chosen = NAMES.get(optimizer.lower()) if isinstance(optimizer, str) else optimizer
    if isinstance(chosen, type) and issubclass(chosen, torch.optim.Optimizer):
        own = _init_keywords(chosen)
        if own is None:
            return None
        names |= own
    return frozenset(names)


@dataclass(frozen=True)
class ConstructorKeywords:
    """The constructor's keywords, sorted by destination.

    Attributes:
        config: the run's :class:`~zkernels.ZeroConfig` (``config`` with the keywords naming
            its fields applied, checked as a whole).
        options: every name of :data:`RUN_OPTIONS`, given or its default.
        optimizer_kwargs: the optimizer's other hyperparameters (``momentum=0.9``, ...).
    """

    config: ZeroConfig
    options: Dict[str, object]
    optimizer_kwargs: Dict[str, object]


def read_keywords(config: Optional[ZeroConfig], overrides: Dict[str, object],
                  **named) -> ConstructorKeywords:
    """Sort ``ZeroOptimizer``'s keywords (see [Note: config-first constructor]).

    Args:
        config: None or the base :class:`~zkernels.ZeroConfig`.
        overrides: the constructor's ``**overrides``.
        **named: the signature's own ZeroConfig keywords (``stage``, ``param_dtype``):
            :data:`FROM_CONFIG` is not given.

    Raises:
        TypeError: ``config`` is not a ZeroConfig; a keyword that is neither a ZeroConfig
            field, a run option nor a hyperparameter of any optimizer (the closest named).
        ValueError: a value or combination the config refuses (naming the keyword).
    """
    if config is not None and not isinstance(config, ZeroConfig):
        hint = " (pass the stage by name: stage=...)" if isinstance(config, (int, str)) else ""
        raise TypeError(f"config must be a zkernels.ZeroConfig or None, got "
                        f"{type(config).__name__}{hint}")
    options = {k: overrides.get(k, d) for k, d in RUN_OPTIONS.items()}
    rest = {k: v for k, v in overrides.items()
            if k not in CONFIG_KEYWORDS and k not in RUN_OPTIONS}
    hparams = hyperparameter_names(options["optimizer"])
    unknown = [k for k in rest if hparams is not None and k not in hparams]
    if unknown:
        raise unexpected_keywords("ZeroOptimizer()", unknown, KEYWORDS | hparams)
    fields = {k: v for k, v in named.items() if v is not FROM_CONFIG}
    fields.update((k, v) for k, v in overrides.items() if k in CONFIG_KEYWORDS)
    cfg = (ZeroConfig() if config is None else config).with_keywords("ZeroOptimizer()",
                                                                      **fields)
    return ConstructorKeywords(cfg, options, rest)
