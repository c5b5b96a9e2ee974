"""The one place where a backend is chosen for a fused op.

Triton on CUDA tensors; the C++ extension (``zkernels._C``) on CPU tensors where it is built
and implements the op; the reference otherwise. ``ZKERNELS_BACKEND=reference|triton|cpp``
forces one (read at call time, never at import) for the public ``zkernels.ops.*`` functions;
:class:`zkernels.ops.OpSet` resolves every op once instead (see ``opset.py``). Triton on CPU
tensors needs ``TRITON_INTERPRET=1`` set before ``zkernels.kernels`` is first imported.
"""
from __future__ import annotations

import functools
import importlib
import logging
import os
from types import ModuleType
from typing import Callable, Optional

import torch

from .. import optimizers

log = logging.getLogger("zkernels.ops")

BACKENDS = ("reference", "triton", "cpp")
# ``resolve(op, device) -> implementation``: how a checked op finds its kernel.
Resolve = Callable[[str, torch.device], Callable]
_MODULES = {"reference": "zkernels.reference", "triton": "zkernels.kernels",
            "cpp": "zkernels._cpu"}


@functools.lru_cache(maxsize=None)
def _module(backend: str) -> Optional[ModuleType]:
    """The backend's module, or None where it cannot be imported (no triton, no extension)."""
    try:
        return importlib.import_module(_MODULES[backend])
    except ImportError as exc:
        log.debug("zkernels backend %r unavailable: %s", backend, exc)
        return None


def available(backend: str) -> bool:
    """Whether ``backend`` can run here at all."""
    if backend == "cpp":
        mod = _module("cpp")
        return mod is not None and getattr(mod, "AVAILABLE", False)
    return _module(backend) is not None


@functools.lru_cache(maxsize=None)
def _say_once(op: str, device_type: str, backend: str) -> None:
    log.debug("zkernels.ops.%s on %s tensors runs on the %s backend", op, device_type, backend)


def forced_backend() -> str:
    """``ZKERNELS_BACKEND`` as set now, lower case ("" when unset)."""
    return os.environ.get("ZKERNELS_BACKEND", "").strip().lower()


# The per-optimizer keyword ops, which run ``optimizer_step`` of their definition.
KEYWORD_OPTIMIZERS = {"lion_step": "lion", "sgd_step": "sgd"}


def choose(op: str, device: torch.device) -> str:
    """Name of the backend that runs ``op`` for tensors on ``device`` (reads
    ``ZKERNELS_BACKEND`` now); ``lion_step``/``sgd_step``: that of their definition's
    ``optimizer_step`` (fp32 states)."""
    if op in KEYWORD_OPTIMIZERS:
        return resolve_optimizer(optimizers.get(KEYWORD_OPTIMIZERS[op]), True, device,
                                 forced_backend(), "ZKERNELS_BACKEND")
    return resolve_backend(op, device, forced_backend(), "ZKERNELS_BACKEND")


def resolve_backend(op: str, device: torch.device, forced: str, source: str,
                    has: Optional[Callable[[str], bool]] = None) -> str:
    """The backend for ``op`` on ``device``: ``forced`` (checked; ``source`` names where it came
    from in errors, e.g. "ZKERNELS_BACKEND" or "ops_backend") or, when empty, the default.
    ``has(backend)`` says whether a backend implements it (default: the module has ``op``)."""
    has = has or (lambda b: _has(b, op))
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"{source} must be one of {BACKENDS}, got {forced!r}")
        if forced == "triton" and device.type != "cuda" and \
                os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True"):
            raise RuntimeError(f"{source}=triton on CPU tensors needs TRITON_INTERPRET=1")
        if forced != "reference" and not has(forced):
            raise RuntimeError(f"{source}={forced} but that backend is not available "
                               f"for op {op!r} here")
        return forced
    if device.type == "cuda" and has("triton"):
        return "triton"
    if device.type == "cpu" and has("cpp"):
        return "cpp"
    return "reference"


def _has(backend: str, op: str) -> bool:
    return available(backend) and hasattr(_module(backend), op)


def implementation(op: str, device: torch.device) -> Callable:
    """The function implementing ``op`` for tensors on ``device``."""
    backend = choose(op, device)
    _say_once(op, device.type, backend)
    return getattr(_module(backend), op)


def has_optimizer(backend: str, defn, fp32: bool) -> bool:
    """Whether ``backend``'s ``optimizer_step`` implements the definition ``defn`` (its module
    lists the name in ``OPTIMIZER_KINDS``); the cpp backend only for an fp32 parameter with
    fp32 states (``fp32``), what ``zkernels._cpu.optimizer_step`` takes."""
    mod = _module(backend) if available(backend) else None
    if mod is None or not (fp32 or backend != "cpp"):
        return False
    return hasattr(mod, "optimizer_step") and defn.name in getattr(mod, "OPTIMIZER_KINDS", ())


def optimizer_function(backend: str, defn) -> Callable:
    """``backend``'s ``optimizer_step`` for ``defn``."""
    return _module(backend).optimizer_step


def resolve_optimizer(defn, fp32: bool, device: torch.device, forced: str, source: str) -> str:
    """The backend of ``optimizer_step`` for the definition ``defn`` (see
    :func:`resolve_backend`; ``fp32``: the parameter and the states are fp32)."""
    backend = resolve_backend(f"optimizer_step({defn.name})", device, forced, source,
                              lambda b: has_optimizer(b, defn, fp32))
    if backend == "reference" and not has_optimizer("reference", defn, fp32):
        raise RuntimeError(f"optimizer_step has no {backend} implementation of "
                           f"optimizer={defn.name!r} (its own ops run it)")
    return backend


def optimizer_implementation(defn, fp32: bool, device: torch.device) -> Callable:
    """The ``optimizer_step`` implementing ``defn`` for tensors on ``device`` (reads
    ``ZKERNELS_BACKEND`` now)."""
    backend = resolve_optimizer(defn, fp32, device, forced_backend(), "ZKERNELS_BACKEND")
    _say_once(f"optimizer_step({defn.name})", device.type, backend)
    return optimizer_function(backend, defn)
