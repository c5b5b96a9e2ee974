"""The checked fast path of the CPU copy ops: one native call that checks what the Python
checks would and runs the copy, or declines (see [Note: checked fast path of the copy ops] in
python/src/cpu_ops.cpp).

Each function returns True when the op ran; False when it did not (no extension built, or
anything about the call that the native check does not take), and then the caller runs its
checked Python path as if this module did not exist: that path raises the error naming the
argument, or runs the backend it chooses. So the fast path never changes a result or a message.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from ._backend import _module

_get_num_threads = torch.get_num_threads


def _declined(*args) -> bool:
    return False


@functools.lru_cache(maxsize=None)
def _native(name: str = "CHECKED_COPY") -> Callable[..., bool]:
    """``zkernels._cpu.<name>`` (a ``zkernels._C`` function) where the cpp backend loaded,
    else ``_declined``."""
    mod = _module("cpp")
    fn = getattr(mod, name, None) if mod is not None else None
    return fn if fn is not None else _declined


# Scales the bucket fast paths take as they are (anything else goes through the Python
# path's check of ``scale``).
_PLAIN_SCALE = (float, int)


# One function per op, for the public op (``obey_env`` True: ZKERNELS_BACKEND may route the call
# elsewhere) and for an OpSet that chose cpp (False): the native call's arguments for the op,
# after what the fast path does not take (a dtype= to allocate with, shapes= views, a scale
# that is not a plain number). Each returns whether the op ran. The native call's arguments:
# tensors, flat, offsets (None: back to back), to_flat, scale, fp32_route (the bucket ops' NaN
# pattern), threads, obey_env, whole_flat (one tensor into ``flat`` of any shape and exactly
# its numel: the cast).

def flatten(tensors, out, dtype, offsets, obey_env: bool) -> bool:
    return out is not None and dtype is None and _native()(
        tensors, out, offsets, True, 1.0, False, _get_num_threads(), obey_env, False)


def unflatten(flat, shapes, out, offsets, obey_env: bool) -> bool:
    return shapes is None and out is not None and _native()(
        out, flat, offsets, False, 1.0, False, _get_num_threads(), obey_env, False)


def bucket_pack(tensors, bucket, offsets, scale, obey_env: bool) -> bool:
    return type(scale) in _PLAIN_SCALE and _native()(
        tensors, bucket, offsets, True, scale, True, _get_num_threads(), obey_env, False)


def bucket_unpack(bucket, outs, offsets, scale, obey_env: bool) -> bool:
    return type(scale) in _PLAIN_SCALE and _native()(
        outs, bucket, offsets, False, scale, True, _get_num_threads(), obey_env, False)


def cast(x, dtype, out, obey_env: bool) -> bool:
    return out is not None and dtype is None and _native()(
        (x,), out, None, True, 1.0, False, _get_num_threads(), obey_env, True)


def unscale(x: torch.Tensor, inv_scale, found_inf: torch.Tensor, obey_env: bool) -> bool:
    """``unscale_and_check_`` natively when every check holds; returns whether it ran."""
    return _native("CHECKED_UNSCALE")(x, inv_scale, found_inf, _get_num_threads(), obey_env)
