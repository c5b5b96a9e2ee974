"""Triton cast (round to nearest even, bit-exact with ``Tensor.to``) and the fused
unscale + non-finite check of mixed-precision training."""
from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from ._rounding import convert, round_to
from ._tables import COPY_BLOCK, COPY_WARPS, native_nan


@triton.jit(do_not_specialize=["numel"])  # no recompile per size
def _cast_kernel(x_ptr, out_ptr, numel, NATIVE_NAN: tl.constexpr, BLOCK: tl.constexpr):
    """``out[i] = x[i].to(out.dtype)`` for one BLOCK of the flat tensors."""
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    DST: tl.constexpr = out_ptr.dtype.element_ty
    # Full blocks unmasked so that loads and stores vectorize; the last one is masked.
    if start + BLOCK <= numel:
        tl.store(out_ptr + offs, convert(tl.load(x_ptr + offs), DST, NATIVE_NAN))
    else:
        mask = offs < numel
        tl.store(out_ptr + offs, convert(tl.load(x_ptr + offs, mask=mask), DST, NATIVE_NAN),
                 mask=mask)


def cast(x: torch.Tensor, dtype: Optional[torch.dtype] = None, *,
         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x.to(dtype)`` bit for bit, optionally into ``out``.

    Args:
        x: contiguous tensor (fp32/bf16/fp16).
        dtype: target dtype; taken from ``out`` when ``out`` is given.
        out: optional contiguous destination with ``x.numel()`` elements.

    Returns:
        ``out`` or a new tensor shaped like ``x``.
    """
    if out is None:
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    numel = x.numel()
    if numel == 0:
        return out
    _cast_kernel[(triton.cdiv(numel, COPY_BLOCK),)](
        x.reshape(-1), out.view(-1), numel, NATIVE_NAN=native_nan(x.device), BLOCK=COPY_BLOCK,
        num_warps=COPY_WARPS)
    return out


@triton.jit
def _unscale_block(x_ptr, offs, numel, inv, found_inf_ptr, MASKED: tl.constexpr,
                   NATIVE_NAN: tl.constexpr):
    if MASKED:
        mask = offs < numel
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    else:
        mask = None
        x = tl.load(x_ptr + offs)
    xf = x.to(tl.float32)
    # Checked before scaling, as torch's _amp_foreach_non_finite_check_and_unscale_ does, on
    # the exponent bits (all ones: inf or NaN), which no fast-math folding can touch.
    exponent = xf.to(tl.uint32, bitcast=True) & 0x7F800000
    bad = tl.max((exponent == 0x7F800000).to(tl.int32), axis=0)
    # Every writer stores the same 1.0, so concurrent blocks need no atomics; nothing is
    # ever cleared and the host never waits.
    tl.store(found_inf_ptr, 1.0, mask=bad > 0)
    tl.store(x_ptr + offs, round_to(xf * inv, x_ptr.dtype.element_ty, NATIVE_NAN), mask=mask)


@triton.jit(do_not_specialize=["numel"])  # no recompile per size
def _unscale_and_check_kernel(x_ptr, inv_scale, inv_ptr, found_inf_ptr, numel,
                              INV_IS_TENSOR: tl.constexpr, NATIVE_NAN: tl.constexpr,
                              BLOCK: tl.constexpr):
    """In place ``x *= inv_scale`` for one BLOCK; ``found_inf = 1`` if it held inf/NaN."""
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    if INV_IS_TENSOR:
        inv = tl.load(inv_ptr).to(tl.float32)
    else:
        inv = inv_scale
    # Full blocks unmasked so that loads and stores vectorize.
    if start + BLOCK <= numel:
        _unscale_block(x_ptr, offs, numel, inv, found_inf_ptr, False, NATIVE_NAN)
    else:
        _unscale_block(x_ptr, offs, numel, inv, found_inf_ptr, True, NATIVE_NAN)


def unscale_and_check_(x: torch.Tensor, inv_scale: Union[float, torch.Tensor],
                       found_inf: torch.Tensor) -> torch.Tensor:
    """In place: ``x *= inv_scale`` (fp32 product, rounded to ``x.dtype``); ``found_inf`` set to
    1.0 if any element of ``x`` was inf or NaN. No host synchronization.

    Args:
        x: contiguous gradient buffer (fp32/bf16/fp16), modified in place.
        inv_scale: float or 1-element fp32 tensor on ``x``'s device.
        found_inf: 1-element fp32 tensor; set to 1.0 on a non-finite value, never cleared.

    Returns:
        ``found_inf``.
    """
    numel = x.numel()
    if numel == 0:
        return found_inf
    is_tensor = isinstance(inv_scale, torch.Tensor)
    _unscale_and_check_kernel[(triton.cdiv(numel, COPY_BLOCK),)](
        x.view(-1), 1.0 if is_tensor else float(inv_scale),
        inv_scale.reshape(-1) if is_tensor else found_inf, found_inf.view(-1), numel,
        INV_IS_TENSOR=is_tensor, NATIVE_NAN=native_nan(x.device), BLOCK=COPY_BLOCK,
        num_warps=COPY_WARPS)
    return found_inf
