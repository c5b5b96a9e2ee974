"""Reference casts and the fused unscale + non-finite check."""
from __future__ import annotations

from typing import Optional, Union

import torch


def cast(x: torch.Tensor, dtype: Optional[torch.dtype] = None, *,
         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x.to(dtype)`` with round to nearest even, optionally into ``out``.

    Args:
        x: contiguous tensor (fp32/bf16/fp16).
        dtype: target dtype; taken from ``out`` when ``out`` is given.
        out: optional contiguous destination with ``x.numel()`` elements.

    Returns:
        ``out`` or a new tensor shaped like ``x``.
    """
    if out is None:
        return x.to(dtype)
    out.view(-1).copy_(x.reshape(-1))
    return out


def unscale_and_check_(x: torch.Tensor, inv_scale: Union[float, torch.Tensor],
                       found_inf: torch.Tensor) -> torch.Tensor:
    """In place: ``x *= inv_scale``; set ``found_inf`` to 1.0 if any element of ``x`` is
    inf or NaN, checked on the input (still loss-scaled) values before the multiply, as
    ``torch._amp_foreach_non_finite_check_and_unscale_`` does.

    Args:
        x: contiguous gradient buffer (fp32/bf16/fp16), modified in place.
        inv_scale: float or 1-element fp32 tensor.
        found_inf: 1-element fp32 tensor; set to 1.0 on a non-finite value, never cleared.

    Returns:
        ``found_inf``.
    """
    if not bool(torch.isfinite(x).all()):
        found_inf.fill_(1.0)
    inv = inv_scale.float().reshape(()) if isinstance(inv_scale, torch.Tensor) else inv_scale
    x.copy_(x.float().mul(inv))
    return found_inf
