"""Every fused op with its implementation chosen once, for one device.

[Note: ops chosen once]
The public ``zkernels.ops.xxx`` functions choose a backend on every call (they read
``ZKERNELS_BACKEND`` each time, so a test or a script can switch it). Code that calls ops in a
hot loop, e.g. ZeRO's gradient hooks during backward, should not: the choice would be repeated
thousands of times per step and could change in the middle of training if the environment did.
An :class:`OpSet` resolves the implementation of every op once, at construction (reading
``ZKERNELS_BACKEND`` once, unless a backend is given), and its methods run the same argument
checks as the public functions, then call the kernel chosen then. ``ZeroOptimizer`` builds one
(``ops_backend=``) and passes it to everything under it.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Mapping, Optional

import torch

from .. import optimizers
from . import _fast
from .adamw import _adamw_step, _sum_squares
from .adamw_lowbit import _adamw_step_lowbit
from .bucket import _bucket_pack, _bucket_unpack
from .cast import _cast, _unscale_and_check_
from .flatten import _flatten, _unflatten
from .optimizer import _lion_step, _optimizer_step, _sgd_step
from .quant import _dequantize, _dequantize_sum, _quantize
from ._backend import (BACKENDS, _module, _say_once, forced_backend, optimizer_function,
                       resolve_backend, resolve_optimizer)

# The ops with a checked native fast path on CPU (see ops/_fast.py).
_FAST_OPS = ("flatten", "unflatten", "bucket_pack", "bucket_unpack", "cast",
             "unscale_and_check_")

OPS = ("flatten", "unflatten", "bucket_pack", "bucket_unpack", "cast", "unscale_and_check_",
       "adamw_step", "adamw_step_lowbit", "sum_squares", "quantize",
       "dequantize", "dequantize_sum")


class OpSet:
    """The fused ops for tensors on one device type, each bound to one implementation.

    Build with :func:`for_device`. Attributes: ``device_type`` ("cpu", "cuda"), ``backends``
    (op name -> backend name, read-only). Methods: the ops of ``zkernels.ops`` with the same
    arguments and checks (``flatten``, ``unflatten``, ``bucket_pack``, ``bucket_unpack``,
    ``cast``, ``unscale_and_check_``, ``adamw_step``, ``adamw_step_lowbit``, ``lion_step``,
    ``sgd_step``, ``sum_squares``, ``quantize``, ``dequantize``, ``dequantize_sum``), and
    ``optimizer_step(defn, ...)``, whose backend is one entry per definition (and state form),
    chosen at its first call under the choice this OpSet was built with
    (:meth:`optimizer_backend`).
    """

    def __init__(self, device_type: str, backends: Mapping[str, str],
                 unavailable: Optional[Mapping[str, Callable]] = None, *, forced: str = "",
                 source: str = "ZKERNELS_BACKEND") -> None:
        self.device_type = device_type
        self.backends = MappingProxyType(dict(backends))
        self._forced, self._source = forced, source
        self._optimizers = {}  # (definition name, fp32) -> implementation
        self._fns = {op: getattr(_module(b), op) for op, b in backends.items()}
        self._fns.update(unavailable or {})
        # The copy ops bound to cpp on CPU first try its checked fast path (ops/_fast.py),
        # without reading ZKERNELS_BACKEND again: the choice was made here.
        self._fast = {op: device_type == "cpu" and backends.get(op) == "cpp"
                      for op in _FAST_OPS}

    def _resolve(self, op: str, device: torch.device) -> Callable:
        if device.type != self.device_type:
            raise ValueError(f"{op}: tensors are on {device} but this OpSet was built for "
                             f"{self.device_type} tensors")
        return self._fns[op]

    def flatten(self, tensors, *, out=None, dtype=None, offsets=None):
        if self._fast["flatten"] and _fast.flatten(tensors, out, dtype, offsets, False):
            return out
        return _flatten(self._resolve, tensors, out=out, dtype=dtype, offsets=offsets)

    def unflatten(self, flat, shapes=None, *, out=None, offsets=None):
        if self._fast["unflatten"] and _fast.unflatten(flat, shapes, out, offsets, False):
            return list(out)
        return _unflatten(self._resolve, flat, shapes, out=out, offsets=offsets)

    def bucket_pack(self, tensors, bucket, offsets, *, scale=1.0):
        if self._fast["bucket_pack"] and _fast.bucket_pack(tensors, bucket, offsets, scale,
                                                           False):
            return bucket
        return _bucket_pack(self._resolve, tensors, bucket, offsets, scale=scale)

    def bucket_unpack(self, bucket, outs, offsets, *, scale=1.0):
        if self._fast["bucket_unpack"] and _fast.bucket_unpack(bucket, outs, offsets, scale,
                                                               False):
            return outs
        return _bucket_unpack(self._resolve, bucket, outs, offsets, scale=scale)

    def cast(self, x, dtype=None, *, out=None):
        if self._fast["cast"] and _fast.cast(x, dtype, out, False):
            return out
        return _cast(self._resolve, x, dtype, out=out)

    def unscale_and_check_(self, x, inv_scale, found_inf):
        if self._fast["unscale_and_check_"] and _fast.unscale(x, inv_scale, found_inf, False):
            return found_inf
        return _unscale_and_check_(self._resolve, x, inv_scale, found_inf)

    def adamw_step(self, param, grad, exp_avg, exp_avg_sq, **kw):
        return _adamw_step(self._resolve, param, grad, exp_avg, exp_avg_sq, **kw)

    def adamw_step_lowbit(self, param, grad, exp_avg, exp_avg_sq, exp_avg_scales=None,
                          exp_avg_sq_scales=None, **kw):
        return _adamw_step_lowbit(self._resolve, param, grad, exp_avg, exp_avg_sq,
                                  exp_avg_scales, exp_avg_sq_scales, **kw)

    def lion_step(self, param, grad, exp_avg, **kw):
        return _lion_step(self._resolve_optimizer, param, grad, exp_avg, **kw)

    def sgd_step(self, param, grad, momentum_buffer, **kw):
        return _sgd_step(self._resolve_optimizer, param, grad, momentum_buffer, **kw)

    def optimizer_backend(self, defn, fp32: bool = True) -> str:
        """The backend that runs ``optimizer_step`` for the definition ``defn`` (``fp32``: an
        fp32 parameter with fp32 states), under this OpSet's choice.

        Raises:
            RuntimeError: a forced backend that does not implement ``defn``.
        """
        defn = optimizers.get(defn)
        return resolve_optimizer(defn, fp32, torch.device(self.device_type), self._forced,
                                 self._source)

    def _resolve_optimizer(self, defn, fp32: bool, device: torch.device) -> Callable:
        if device.type != self.device_type:
            raise ValueError(f"optimizer_step: tensors are on {device} but this OpSet was built "
                             f"for {self.device_type} tensors")
        key = (defn.name, fp32)
        fn = self._optimizers.get(key)
        if fn is None:
            backend = self.optimizer_backend(defn, fp32)
            _say_once(f"optimizer_step({defn.name})", self.device_type, backend)
            fn = self._optimizers[key] = optimizer_function(backend, defn)
        return fn

    def optimizer_step(self, defn, param, grad, states, coeffs, **kw):
        return _optimizer_step(self._resolve_optimizer, defn, param, grad, states, coeffs, **kw)

    def sum_squares(self, tensors):
        if not tensors:  # the public op's empty answer, on this OpSet's device
            return torch.zeros((), dtype=torch.float32, device=self.device_type)
        return _sum_squares(self._resolve, tensors)

    def quantize(self, x, **kw):
        return _quantize(self._resolve, x, **kw)

    def dequantize(self, q, scales, **kw):
        return _dequantize(self._resolve, q, scales, **kw)

    def dequantize_sum(self, q, scales, out, **kw):
        return _dequantize_sum(self._resolve, q, scales, out, **kw)

    def __repr__(self) -> str:
        return f"OpSet({self.device_type}, {dict(self.backends)})"


def for_device(device, backend: Optional[str] = None, *, arg_name: str = "backend") -> OpSet:
    """Resolve every op for tensors on ``device``, once.

    Args:
        device: a ``torch.device`` or device string.
        backend: None (``ZKERNELS_BACKEND`` if set now, else Triton on CUDA, the C++ extension
            on CPU where it implements the op, the reference otherwise), or one of
            ``"reference"``, ``"triton"``, ``"cpp"`` for every op.
        arg_name: the caller's name for ``backend`` in error messages.

    Raises:
        ValueError: an unknown backend. RuntimeError: a backend not available here for some op.
    """
    device = torch.device(device)
    if backend is not None:
        if not isinstance(backend, str) or backend.strip().lower() not in BACKENDS:
            raise ValueError(f"{arg_name} must be None or one of {BACKENDS}, got {backend!r}")
        forced, source = backend.strip().lower(), arg_name
    else:
        forced, source = forced_backend(), "ZKERNELS_BACKEND"
    backends, unavailable = {}, {}
    for op in OPS:
        try:
            backends[op] = resolve_backend(op, device, forced, source)
        except RuntimeError as exc:
            # A forced backend that lacks one op: that op fails when used, with the message
            # the public function gives (some ops, e.g. unflatten to views, never need it).
            unavailable[op] = _raiser(exc)
            continue
        _say_once(op, device.type, backends[op])
    return OpSet(device.type, backends, unavailable, forced=forced, source=source)


def _raiser(exc: Exception) -> Callable:
    def fail(*args, **kwargs):
        raise RuntimeError(str(exc))
    return fail
