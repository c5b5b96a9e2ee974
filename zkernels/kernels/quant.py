"""Triton blockwise int8/int4 quantize, dequantize and fused dequantize-and-sum, bit for bit
the arithmetic of [Note: blockwise quantization semantics] in ``zkernels/reference/quant.py``.

Each program owns ``ROWS`` whole quantization blocks (a (ROWS, BLOCK) tile, ``ROWS * BLOCK``
about TILE elements), so a block's absmax is one in-register reduction along the tile's rows.
Exactness on a GPU: divisions are ``tl.div_rn`` (``/`` is approximate there), rounding to an
integer is :func:`_rint` (one fp32 add whose result is read through its bits, exact), and every
launch passes ``enable_fp_fusion=False`` so that no product and sum are contracted into an FMA
(which rounds once where the reference rounds twice). The interpreter ignores that option and
computes in numpy, which never fuses.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ._rounding import round_to, widen
from ._tables import native_nan

QMAX = {8: 127, 4: 7}
# Elements per program (ROWS * BLOCK): 4096 over 8 warps, as the copy kernels.
TILE = 4096
WARPS = 8
_MAGIC = 12582912.0      # 1.5 * 2**23: adding it rounds |y| < 2**22 to an integer
_MAGIC_BITS = 0x4B400000


def _rows(block_size: int) -> int:
    return max(1, TILE // block_size)


@triton.jit
def _rint(y):
    """int32 round-half-to-even of fp32 ``y``, |y| <= 2**22: the sum lands in [2**23, 2**24),
    where the fp32 ulp is 1, so the adder rounds to nearest even; its bits minus the magic's
    are that integer. Nothing can be folded: the sum is read as bits."""
    return (y + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000


@triton.jit
def _top(x):
    """Per row of the fp32 tile ``x``: the largest ``bits & 0x7FFFFFFF`` (|x| order, NaN
    above inf; masked lanes must hold 0)."""
    return tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)


@triton.jit
def _scale(top, QMAX: tl.constexpr):
    """(scale, ok, divisor) of each block from its ``top`` bits: ok = finite nonzero absmax,
    divisor = absmax where ok else 1."""
    amax = top.to(tl.float32, bitcast=True)
    ok = (top > 0) & (top < 0x7F800000)
    nan = tl.full(top.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    qmax = tl.full(top.shape, QMAX, tl.float32)
    scale = tl.where(top > 0x7F800000, nan, tl.div_rn(amax, qmax))
    divisor = tl.where(ok, amax, 1.0)
    return scale, ok, divisor


@triton.jit
def _codes(x, divisor, ok, QMAX: tl.constexpr):
    """int32 codes of the fp32 tile ``x``: rint((x / absmax) * qmax), 0 where not ok."""
    d = tl.div_rn(x, tl.broadcast_to(divisor[:, None], x.shape))
    q = _rint(d * QMAX)
    return tl.where(ok[:, None], q, 0)


@triton.jit(do_not_specialize=["numel", "num_blocks"])
def _quantize_kernel(x_ptr, q_ptr, scales_ptr, numel, num_blocks, BITS: tl.constexpr,
                     QMAX: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    if BITS == 8:
        offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        mask = offs < numel
        x = widen(tl.load(x_ptr + offs, mask=mask, other=0.0))
        scale, ok, divisor = _scale(_top(x), QMAX)
        tl.store(q_ptr + offs, _codes(x, divisor, ok, QMAX).to(tl.int8), mask=mask)
    else:
        # Even and odd elements as two (ROWS, BLOCK / 2) tiles: byte j = lo | hi << 4.
        even = rows[:, None] * BLOCK + 2 * tl.arange(0, BLOCK // 2)[None, :]
        mask_e = even < numel
        mask_o = even + 1 < numel
        xe = widen(tl.load(x_ptr + even, mask=mask_e, other=0.0))
        xo = widen(tl.load(x_ptr + even + 1, mask=mask_o, other=0.0))
        scale, ok, divisor = _scale(tl.maximum(_top(xe), _top(xo)), QMAX)
        lo = _codes(xe, divisor, ok, QMAX) & 0xF
        hi = _codes(xo, divisor, ok, QMAX) & 0xF
        tl.store(q_ptr + even // 2, (lo | (hi << 4)).to(tl.uint8), mask=mask_e)
    tl.store(scales_ptr + rows, scale, mask=rows < num_blocks)


@triton.jit
def _nibble(b):
    """Sign-extended int4 in the low 4 bits of int32 ``b``."""
    v = b & 0xF
    return v - ((v & 8) << 1)


@triton.jit(do_not_specialize=["numel", "num_blocks", "q_row", "s_row"])
def _dequantize_kernel(q_ptr, scales_ptr, out_ptr, numel, num_blocks, q_row, s_row, scale,
                       NUM_CHUNKS: tl.constexpr, SUM: tl.constexpr, ACCUMULATE: tl.constexpr,
                       BITS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                       NATIVE_NAN: tl.constexpr):
    """``out = float(q) * scale`` (SUM False, one chunk), or the dequantize-and-sum of
    NUM_CHUNKS chunks ``q_row`` codes / ``s_row`` scales apart, times ``scale``, plus ``out``
    when ACCUMULATE."""
    DST: tl.constexpr = out_ptr.dtype.element_ty
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_blocks
    if BITS == 8:
        offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        mask = offs < numel
        acc = tl.zeros((ROWS, BLOCK), tl.float32)
        for r in range(NUM_CHUNKS):
            s = tl.load(scales_ptr + rows, mask=row_ok, other=0.0)
            q = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.float32)
            if SUM:
                acc = acc + q * s[:, None]
            else:
                acc = q * s[:, None]
            # Chunk by chunk through the pointers: no int32 product r * q_row to overflow.
            q_ptr += q_row
            scales_ptr += s_row
        if SUM:
            acc = acc * scale
            if ACCUMULATE:
                acc = widen(tl.load(out_ptr + offs, mask=mask, other=0.0)) + acc
        tl.store(out_ptr + offs, round_to(acc, DST, NATIVE_NAN), mask=mask)
    else:
        even = rows[:, None] * BLOCK + 2 * tl.arange(0, BLOCK // 2)[None, :]
        mask_e = even < numel
        mask_o = even + 1 < numel
        acc_e = tl.zeros((ROWS, BLOCK // 2), tl.float32)
        acc_o = tl.zeros((ROWS, BLOCK // 2), tl.float32)
        for r in range(NUM_CHUNKS):
            s = tl.load(scales_ptr + rows, mask=row_ok, other=0.0)[:, None]
            b = tl.load(q_ptr + even // 2, mask=mask_e, other=0).to(tl.int32)
            qe = _nibble(b).to(tl.float32)
            qo = _nibble(b >> 4).to(tl.float32)
            if SUM:
                acc_e = acc_e + qe * s
                acc_o = acc_o + qo * s
            else:
                acc_e = qe * s
                acc_o = qo * s
            q_ptr += q_row
            scales_ptr += s_row
        if SUM:
            acc_e = acc_e * scale
            acc_o = acc_o * scale
            if ACCUMULATE:
                acc_e = widen(tl.load(out_ptr + even, mask=mask_e, other=0.0)) + acc_e
                acc_o = widen(tl.load(out_ptr + even + 1, mask=mask_o, other=0.0)) + acc_o
        tl.store(out_ptr + even, round_to(acc_e, DST, NATIVE_NAN), mask=mask_e)
        tl.store(out_ptr + even + 1, round_to(acc_o, DST, NATIVE_NAN), mask=mask_o)


def _grid(numel: int, block_size: int) -> Tuple[int]:
    return (triton.cdiv(triton.cdiv(numel, block_size), _rows(block_size)),)


def quantize(x: torch.Tensor, *, bits: int = 8, block_size: int = 256,
             out: Optional[torch.Tensor] = None,
             scales: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Blockwise symmetric quantization of ``x``; arguments and result as
    :func:`zkernels.reference.quantize`."""
    n = x.numel()
    nb = triton.cdiv(n, block_size)
    if out is None:
        out = torch.empty(n if bits == 8 else triton.cdiv(n, 2),
                          dtype=torch.int8 if bits == 8 else torch.uint8, device=x.device)
    if scales is None:
        scales = torch.empty(nb, dtype=torch.float32, device=x.device)
    if n == 0:
        return out, scales
    _quantize_kernel[_grid(n, block_size)](
        x.reshape(-1), out.view(-1), scales.view(-1), n, nb, BITS=bits, QMAX=QMAX[bits],
        BLOCK=block_size, ROWS=_rows(block_size), num_warps=WARPS, enable_fp_fusion=False)
    return out, scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, *, bits: int = 8, block_size: int = 256,
               numel: Optional[int] = None, out: Optional[torch.Tensor] = None,
               dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``round_to(out.dtype, float(q) * scale)``; arguments and result as
    :func:`zkernels.reference.dequantize`."""
    if numel is None:
        numel = out.numel() if out is not None else q.numel() * (1 if bits == 8 else 2)
    if out is None:
        out = torch.empty(numel, dtype=dtype or torch.float32, device=q.device)
    if numel:
        _launch_dequantize(q.view(-1), scales.view(-1), out.view(-1), numel, 1, 0, 0, 1.0,
                           False, False, bits, block_size)
    return out


def dequantize_sum(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, bits: int = 8,
                   block_size: int = 256, scale: float = 1.0,
                   accumulate: bool = False) -> torch.Tensor:
    """Dequantize the N chunks of ``q``/``scales`` and sum them into ``out``; arguments and
    result as :func:`zkernels.reference.dequantize_sum`."""
    n = out.numel()
    if n == 0:
        return out
    _launch_dequantize(q, scales, out.view(-1), n, q.shape[0], q.stride(0), scales.stride(0),
                       float(scale), True, bool(accumulate), bits, block_size)
    return out


def _launch_dequantize(q, scales, out, numel, num_chunks, q_row, s_row, scale, is_sum,
                       accumulate, bits, block_size) -> None:
    _dequantize_kernel[_grid(numel, block_size)](
        q, scales, out, numel, triton.cdiv(numel, block_size), q_row, s_row, scale,
        NUM_CHUNKS=num_chunks, SUM=is_sum, ACCUMULATE=accumulate, BITS=bits,
        BLOCK=block_size, ROWS=_rows(block_size), NATIVE_NAN=native_nan(out.device),
        num_warps=WARPS, enable_fp_fusion=False)
