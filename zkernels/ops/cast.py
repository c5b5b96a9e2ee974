"""Public cast and fused unscale + non-finite check: checks, then dispatch."""
from __future__ import annotations

from typing import Optional, Union

import torch

from . import _checks, _fast
from ._backend import Resolve, implementation


def cast(x: torch.Tensor, dtype: Optional[torch.dtype] = None, *,
         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x.to(dtype)`` bit for bit (round to nearest even). See
    :func:`zkernels.reference.cast`."""
    if _fast.cast(x, dtype, out, True):
        return out
    return _cast(implementation, x, dtype, out=out)


def _cast(resolve: Resolve,
          x: torch.Tensor, dtype: Optional[torch.dtype] = None, *,
          out: Optional[torch.Tensor] = None) -> torch.Tensor:
    _checks.tensor("x", x)
    if out is None:
        if dtype is None:
            raise ValueError("cast: give dtype= or out=")
        if dtype not in _checks.FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of {_checks.FLOAT_DTYPES}, got {dtype}")
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    else:
        _checks.tensor("out", out, device=x.device, numel=x.numel())
        if dtype is not None and dtype != out.dtype:
            raise TypeError(f"dtype={dtype} disagrees with out.dtype={out.dtype}")
    if x.numel() == 0:
        return out
    return resolve("cast", x.device)(x, out=out)


def unscale_and_check_(x: torch.Tensor, inv_scale: Union[float, torch.Tensor],
                       found_inf: torch.Tensor) -> torch.Tensor:
    """In place ``x *= inv_scale``; ``found_inf = 1`` on any inf/NaN. See
    :func:`zkernels.reference.unscale_and_check_`."""
    if _fast.unscale(x, inv_scale, found_inf, True):
        return found_inf
    return _unscale_and_check_(implementation, x, inv_scale, found_inf)


def _unscale_and_check_(resolve: Resolve,
                        x: torch.Tensor, inv_scale: Union[float, torch.Tensor],
                        found_inf: torch.Tensor) -> torch.Tensor:
    _checks.tensor("x", x)
    _checks.tensor("found_inf", found_inf, dtypes=(torch.float32,), device=x.device, numel=1)
    if isinstance(inv_scale, torch.Tensor):
        _checks.tensor("inv_scale", inv_scale, dtypes=(torch.float32,), device=x.device,
                       numel=1)
    if x.numel() == 0:
        return found_inf
    return resolve("unscale_and_check_", x.device)(x, inv_scale, found_inf)
