"""Which optimizer a param group runs: ``ZeroOptimizer(optimizer=...)`` validated once, here.

[Note: optimizer rules]
A group's optimizer is one of two update rules, chosen at construction:

* ``"adamw"`` (the default): today's fused AdamW (``zkernels.ops.adamw``), its bytes, speed
  and checkpoints unchanged.
* an element-wise ``torch.optim`` class (:data:`ELEMENTWISE`, or one the user declares with
  ``elementwise=True``): its update of an element reads only that element's gradient and
  state, so the class runs on this rank's shard. The pieces of each parameter in the shard
  are its parameters (views into the fp32 master shard), their gradients views of the
  (unscaled) gradient shard, and its state lives with the pieces (``state/torch_rule.py``).

Names select a rule too: ``"adamw"``; the name of every other element-wise definition of
``zkernels.optimizers.REGISTRY`` (``"lion"``, ``"sgd"``, ...), whose fused op
(``zkernels.ops.optimizer_step``: reference, Triton, C++) runs on the shard ([Note: fused
element-wise rules] in ``state/fused_rule.py``): its keywords, defaults, checks and state bytes
are the definition's, so a new definition needs no edit here; and the lower-case names of the other classes of :data:`ELEMENTWISE` and
:data:`MATRIX` (``"adagrad"``, ``"muon"``, ...), which run the torch class (``torch.optim.SGD``
itself: pass the class). The matrix classes of :data:`MATRIX` (``torch.optim.Muon``,
``torch.optim.Adafactor``: Newton-Schulz and the row/column factors read the whole matrix) run on
whole parameters, each updated by one owner rank ([Note: whole matrices on owners] in
``state/matrix_rule.py``). A class whose update needs more than one element and is not there
(LBFGS's closure over the whole model, SparseAdam's sparse gradients) or any class neither listed
nor declared is refused by name: it is never run silently on pieces.

State bytes per trainable element (fp32) follow the class and its hyperparameters
(:func:`state_bytes`): SGD 4 with momentum and 0 without, Adam 8 (12 with amsgrad),
Adagrad 4, RMSprop 4 (+4 momentum, +4 centered), ... ``estimate_memory`` and ``plan`` take
them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch

from ...optimizers import REGISTRY, ElementwiseOptimizer

# Element-wise torch.optim classes and their fp32 state bytes per element (hyperparameters).
_O = torch.optim
ELEMENTWISE: Dict[type, Callable[[dict], int]] = {
    _O.SGD: lambda h: 4 if h.get("momentum", 0) else 0,
    _O.Adam: lambda h: 12 if h.get("amsgrad") else 8,
    _O.AdamW: lambda h: 12 if h.get("amsgrad") else 8,
    _O.Adamax: lambda h: 8,
    _O.NAdam: lambda h: 8,
    _O.RAdam: lambda h: 8,
    _O.RMSprop: lambda h: 4 + (4 if h.get("momentum", 0) else 0) + (4 if h.get("centered")
                                                                      else 0),
    _O.Adagrad: lambda h: 4,
    _O.Adadelta: lambda h: 8,
    _O.Rprop: lambda h: 8,
    _O.ASGD: lambda h: 4,
}
# Whole-matrix torch.optim classes ([Note: whole matrices on owners]) and their fp32 bytes per
# element: the owner's whole fp32 master (4) plus the class's state (Muon's momentum 4;
# Adafactor's row/column factors, O(rows + columns), counted as 0). Averaged over the shard
# group, as the owners are balanced.
MATRIX: Dict[type, Callable[[dict], int]] = {
    _O.Muon: lambda h: 8,
    _O.Adafactor: lambda h: 4,
}
# The fused element-wise rules a name selects: every definition but the fused AdamW (which
# keeps its own rule, bytes and checkpoints).
KERNELS: Dict[str, ElementwiseOptimizer] = {n: d for n, d in REGISTRY.items() if n != "adamw"}
NAMES: Dict[str, type] = {c.__name__.lower(): c for c in (*ELEMENTWISE, *MATRIX)
                          if c.__name__.lower() not in KERNELS}
ADAMW_STATE_BYTES = 8

_REFUSED = {
    "LBFGS": "its step() re-evaluates a closure over the whole model and keeps a history of "
             "whole-model vectors: it cannot run on one rank's shard",
    "SparseAdam": "it takes sparse gradients; ZeRO reduces dense gradient shards",
}


@dataclass(frozen=True)
class OptimizerSpec:
    """One param group's update rule (see [Note: optimizer rules]).

    Attributes:
        name: ``"adamw"`` (the fused AdamW), a definition's name (a fused element-wise rule:
            ``"lion"``, ``"sgd"``, ...) or the torch class's name (``"SGD"``).
        cls: the torch class (None for the fused ops).
        defaults: the class's hyperparameters with the given keywords applied (what its
            param groups carry; a definition's: resolved by it); for the fused AdamW empty
            (the groups carry lr, betas, ...).
    """

    name: str
    cls: Optional[type] = None
    defaults: Dict[str, object] = field(default_factory=dict)

    @property
    def fused(self) -> bool:
        """The fused AdamW (today's default rule)."""
        return self.cls is None and self.name == "adamw"

    @property
    def definition(self) -> Optional[ElementwiseOptimizer]:
        """The element-wise definition the group's fused rule runs (:data:`KERNELS`), else
        None."""
        return KERNELS.get(self.name) if self.cls is None else None

    @property
    def matrix(self) -> bool:
        """Whether the class updates whole parameters on an owner rank (:data:`MATRIX`)."""
        return self.cls in MATRIX

    def state_bytes(self, form: str = "fp32") -> int:
        """State bytes per trainable element under the spec's hyperparameters (``form``: a
        definition's low-bit state form, "bf16"; the fused AdamW's and a class's: fp32)."""
        if self.definition is not None:   # the definition's present states, in ``form``
            return int(self.definition.state_bytes(self.defaults, form))
        if self.cls is None:
            return ADAMW_STATE_BYTES
        rule = ELEMENTWISE.get(self.cls) or MATRIX.get(self.cls)
        if rule is None:   # a declared class: its state measured after its first step
            return 0
        return rule(self.defaults)


def _class_of(optimizer, where: str):
    if isinstance(optimizer, str):
        key = optimizer.lower()
        if key == "adamw" or key in KERNELS:
            return key
        if key not in NAMES:
            raise ValueError(f"{where}optimizer={optimizer!r} is not a known name: expected "
                             f"one of {sorted({'adamw', *KERNELS, *NAMES})}, or a "
                             f"torch.optim.Optimizer subclass")
        return NAMES[key]
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return optimizer
    raise TypeError(f"{where}optimizer must be a name ('adamw', 'sgd', ...) or a "
                    f"torch.optim.Optimizer subclass, got {optimizer!r}")


def resolve_optimizer(optimizer, hparams: dict, elementwise: bool = False,
                      where: str = "") -> OptimizerSpec:
    """The checked :class:`OptimizerSpec` of ``optimizer`` with keyword ``hparams``.

    Args:
        optimizer: ``"adamw"``, a name of :data:`NAMES`, or a ``torch.optim.Optimizer``
            subclass.
        hparams: the class's keywords (``lr``, ``momentum``, ...); for ``"adamw"`` none
            beyond those ``ZeroOptimizer`` names.
        elementwise: the user declares a class not in :data:`ELEMENTWISE` element-wise.
        where: prefix of error messages (``"param_groups[1]: "``).

    Raises:
        ValueError: a refused class or name (with the reason), a class that is neither known
            nor declared element-wise, hyperparameters the class rejects.
        TypeError: not a name or an Optimizer subclass; keywords the class does not take.
    """
    cls = _class_of(optimizer, where)
    if cls == "adamw":
        if hparams:
            raise TypeError(f"{where}optimizer='adamw' takes lr, betas, eps and weight_decay; "
                            f"got unexpected keywords {sorted(hparams)}")
        return OptimizerSpec("adamw")
    if isinstance(cls, str):
        return _kernel_spec(cls, hparams, where)
    if cls.__name__ in _REFUSED and cls not in ELEMENTWISE:
        raise ValueError(f"{where}optimizer=torch.optim.{cls.__name__} is refused: "
                         f"{_REFUSED[cls.__name__]}")
    if cls not in ELEMENTWISE and cls not in MATRIX and not elementwise:
        raise ValueError(f"{where}optimizer={cls.__module__}.{cls.__name__} is not known to "
                         f"be element-wise (known: {', '.join(c.__name__ for c in ELEMENTWISE)}"
                         f"): ZeroOptimizer runs a class on pieces of parameters only when "
                         f"each element's update reads only its own gradient and state; pass "
                         f"elementwise=True if that holds for it")
    shape = (1, 1) if cls in MATRIX else (1,)   # (Muon takes only matrices)
    probe = cls([torch.zeros(shape, requires_grad=True)], **hparams)   # the class checks them
    defaults = {k: v for k, v in probe.defaults.items()}
    return OptimizerSpec(cls.__name__, cls, defaults)


def _kernel_spec(name: str, hparams: dict, where: str) -> OptimizerSpec:
    """A fused element-wise rule's spec: its keywords, defaults and checks the definition's."""
    defn = KERNELS[name]
    extra = sorted(set(hparams) - set(defn.defaults))
    if extra:
        raise TypeError(f"{where}optimizer={name!r} (the fused op) takes "
                        f"{', '.join(defn.defaults)}; got unexpected keywords {extra}")
    try:
        h = defn.resolve(**hparams)
    except ValueError as exc:
        raise ValueError(f"{where}optimizer={name!r}: {exc}") from exc
    return OptimizerSpec(name, None, h)
