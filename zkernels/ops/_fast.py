"""The checked fast path of the CPU copy ops: one native call that checks what the Python
checks would and runs the copy, or declines (see [Note: checked fast path of the copy ops] in
python/src/cpu_ops.cpp).

``copy(...)`` returns True when the copy ran; False when it did not (no extension built, or
anything about the call that the native check does not take), and then the caller runs its
checked Python path as if this module did not exist: that path raises the error naming the
argument, or runs the backend it chooses. So the fast path never changes a result or a message.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

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


def copy(tensors: Sequence[torch.Tensor], flat: torch.Tensor, offsets: Optional[Sequence[int]],
         to_flat: bool, scale: float, fp32_route: bool, obey_env: bool,
         whole_flat: bool = False) -> bool:
    """Each tensor to (``to_flat``) or from its offset in ``flat`` (``offsets`` None: back to
    back), times ``scale``, cast; ``fp32_route``: the bucket ops' NaN pattern. ``obey_env``:
    decline unless ``ZKERNELS_BACKEND`` is unset, empty or ``cpp`` (the public ops; an OpSet
    that chose cpp passes False). ``whole_flat``: one tensor into ``flat`` of any shape and
    exactly its numel (the cast). Returns whether it ran."""
    return _native()(tensors, flat, offsets, to_flat, scale, fp32_route, _get_num_threads(),
                     obey_env, whole_flat)


def unscale(x: torch.Tensor, inv_scale, found_inf: torch.Tensor, obey_env: bool) -> bool:
    """``unscale_and_check_`` natively when every check holds; returns whether it ran."""
    return _native("CHECKED_UNSCALE")(x, inv_scale, found_inf, _get_num_threads(), obey_env)
