"""The element-wise optimizers, one definition each ([Note: one definition per optimizer] in
``_definition.py``): read by the ops, the reference, the kernels, the C++ binding, ZeRO's rules,
the planners, checkpoints and the config readers. The bottom layer (imports torch and math).

Attributes:
    REGISTRY: name -> :class:`ElementwiseOptimizer` ("adamw", "lion", "sgd", "ademamix").
"""
import importlib

from types import MappingProxyType

from ._definition import ElementwiseOptimizer, HParam, StateSpec
from .ademamix import ADEMAMIX, AdEMAMix
from .adamw import ADAMW
from .lion import LION
from .sgd import SGD

REGISTRY = MappingProxyType({d.name: d for d in (ADAMW, LION, SGD, ADEMAMIX)})


def get(name_or_defn) -> ElementwiseOptimizer:
    """The definition named ``name_or_defn`` (case-insensitive), or the definition itself.

    Raises:
        ValueError: an unknown name (the known ones listed).
    """
    if isinstance(name_or_defn, ElementwiseOptimizer):
        return name_or_defn
    if isinstance(name_or_defn, str) and name_or_defn.lower() in REGISTRY:
        return REGISTRY[name_or_defn.lower()]
    raise ValueError(f"optimizer must be one of {sorted(REGISTRY)} or an ElementwiseOptimizer, "
                     f"got {name_or_defn!r}")


def backend_math(defn, package: str, kinds, attr: str, where: str):
    """A backend's per-element math for ``defn``: the attribute ``attr`` of the module
    ``<package>.<name>`` (each backend keeps one module per optimizer it lists in ``kinds``).

    Raises:
        ValueError: ``where`` (the backend, for the message) has no step for ``defn``.
    """
    name = get(defn).name
    if name not in kinds:
        raise ValueError(f"{where} has no generic step for optimizer={name!r} (it has {kinds})")
    return getattr(importlib.import_module(f"{package}.{name}"), attr)


__all__ = ["ElementwiseOptimizer", "HParam", "StateSpec", "REGISTRY", "get", "backend_math", "ADAMW", "LION",
           "SGD", "ADEMAMIX", "AdEMAMix"]
