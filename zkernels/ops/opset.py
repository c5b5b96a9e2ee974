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

from .adamw import _adamw_step, _sum_squares
from .bucket import _bucket_pack, _bucket_unpack
from .cast import _cast, _unscale_and_check_
from .flatten import _flatten, _unflatten
from ._backend import BACKENDS, _module, _say_once, forced_backend, resolve_backend

OPS = ("flatten", "unflatten", "bucket_pack", "bucket_unpack", "cast", "unscale_and_check_",
       "adamw_step", "sum_squares")


class OpSet:
    """The fused ops for tensors on one device type, each bound to one implementation.

    Build with :func:`for_device`. Attributes: ``device_type`` ("cpu", "cuda"), ``backends``
    (op name -> backend name, read-only). Methods: the ops of ``zkernels.ops`` with the same
    arguments and checks (``flatten``, ``unflatten``, ``bucket_pack``, ``bucket_unpack``,
    ``cast``, ``unscale_and_check_``, ``adamw_step``, ``sum_squares``).
    """

    def __init__(self, device_type: str, backends: Mapping[str, str],
                 unavailable: Optional[Mapping[str, Callable]] = None) -> None:
        self.device_type = device_type
        self.backends = MappingProxyType(dict(backends))
        self._fns = {op: getattr(_module(b), op) for op, b in backends.items()}
        self._fns.update(unavailable or {})

    def _resolve(self, op: str, device: torch.device) -> Callable:
        if device.type != self.device_type:
            raise ValueError(f"{op}: tensors are on {device} but this OpSet was built for "
                             f"{self.device_type} tensors")
        return self._fns[op]

    def flatten(self, tensors, **kw):
        return _flatten(self._resolve, tensors, **kw)

    def unflatten(self, flat, shapes=None, **kw):
        return _unflatten(self._resolve, flat, shapes, **kw)

    def bucket_pack(self, tensors, bucket, offsets, **kw):
        return _bucket_pack(self._resolve, tensors, bucket, offsets, **kw)

    def bucket_unpack(self, bucket, outs, offsets, **kw):
        return _bucket_unpack(self._resolve, bucket, outs, offsets, **kw)

    def cast(self, x, dtype=None, **kw):
        return _cast(self._resolve, x, dtype, **kw)

    def unscale_and_check_(self, x, inv_scale, found_inf):
        return _unscale_and_check_(self._resolve, x, inv_scale, found_inf)

    def adamw_step(self, param, grad, exp_avg, exp_avg_sq, **kw):
        return _adamw_step(self._resolve, param, grad, exp_avg, exp_avg_sq, **kw)

    def sum_squares(self, tensors):
        if not tensors:  # the public op's empty answer, on this OpSet's device
            return torch.zeros((), dtype=torch.float32, device=self.device_type)
        return _sum_squares(self._resolve, tensors)

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
    return OpSet(device.type, backends, unavailable)


def _raiser(exc: Exception) -> Callable:
    def fail(*args, **kwargs):
        raise RuntimeError(str(exc))
    return fail
