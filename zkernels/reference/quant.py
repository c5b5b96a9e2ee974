"""Reference blockwise int8/int4 quantization, dequantization and the fused dequantize-and-sum
of ZeRO++'s quantized collectives (qwZ weight gathers, qgZ gradient all-to-all).

[Note: blockwise quantization semantics]
A flat buffer of ``numel`` elements (fp32, bf16 or fp16; read as fp32, which is exact) is cut
into blocks of ``block_size`` consecutive elements; the last block holds what is left
(``numel % block_size`` elements when that is not 0). ``bits`` is 8 or 4 and sets
``qmax`` = 127 or 7: codes are symmetric, in [-qmax, qmax] (-128 and -8 are never written).
Per block, with ``top`` the largest ``bits(x) & 0x7FFFFFFF`` over its elements (the integer
order of those bits is the order of ``|x|``, with NaN above inf, so no float comparison is
involved) and ``amax`` the float with the bits ``top``:

- finite and nonzero amax: ``scale = amax / qmax`` (one fp32 IEEE division) and
  ``q = rint((x / amax) * qmax)``: an fp32 IEEE division, an fp32 product, then round half to
  even. ``|x / amax| <= 1`` exactly, so ``|q| <= qmax`` without a clamp, and the element(s)
  at ``|x| == amax`` get exactly ``+-qmax``. Dividing by ``amax`` (not ``x / scale`` nor
  ``x * (qmax / amax)``) leaves no finite input without a defined answer: ``scale``
  underflows to subnormals or 0 for blocks below ~1.5e-36, and ``qmax / amax`` overflows to
  inf below ~3.7e-37; ``x / amax`` does neither. (Such a block's scale is subnormal or 0, so
  it dequantizes with that precision, or to zeros.)
- amax == 0 (all elements +-0): ``scale = +0`` and every code 0; it dequantizes to +0.
- a block holding NaN: ``scale`` = NaN (bits 0x7FC00000) and every code 0; holding +-inf but
  no NaN: ``scale = +inf`` and every code 0. Either way ``0 * scale`` is NaN, so the whole
  block dequantizes to NaN and a non-finite gradient still trips the optimizer's inf/NaN check
  after a quantized reduce-scatter (inf comes back as NaN: the scale says which it was).

Storage: int8 codes in an int8 tensor of ``numel`` elements; int4 codes as 4-bit two's
complement nibbles in a uint8 tensor of ``ceil(numel / 2)`` bytes, element ``2j`` in the low
nibble of byte ``j`` and ``2j + 1`` in the high nibble (an odd ``numel`` leaves the last high
nibble 0). ``block_size`` is a power of two from 2 to 8192, so no byte holds two blocks.
Scales: fp32, ``ceil(numel / block_size)`` of them.

Dequantize: ``out = round_to(out.dtype, float(q) * scale)`` (one fp32 product, then the
``Tensor.to`` rounding of [Note: exact rounding in kernels]). The signs of zeros are not kept
(a -0 input comes back +0), and the NaN that ``0 * inf`` produces has the hardware's payload
(x86: 0xFFC00000, GPUs: 0x7FFFFFFF): only NaN positions are defined.

Dequantize-and-sum of ``N`` chunks of one shard (the qgZ receive side: chunk ``r`` is rank
``r``'s quantization of this rank's shard, ``q[r]`` and ``scales[r]``), per element ``i``, in
fp32 with every operation rounded (no fused multiply-add on any backend)::

    acc = +0.0
    for r in 0 .. N-1:  acc = acc + float(q[r, i]) * scales[r, block(i)]
    acc = acc * float32(scale)
    if accumulate:      acc = float(out[i]) + acc
    out[i] = round_to(out.dtype, acc)

The kernels reproduce these operations in this order bit for bit (``tl.div_rn``, an exact
round-half-even helper and ``enable_fp_fusion=False`` in Triton; ``-ffp-contract=off``, IEEE
division and ``rint`` in C++).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

QMAX = {8: 127, 4: 7}
_NAN_BITS = 0x7FC00000
_INF_BITS = 0x7F800000


def num_blocks(numel: int, block_size: int) -> int:
    """Scales per buffer of ``numel`` elements: ``ceil(numel / block_size)``."""
    return -(-numel // block_size)


def code_numel(numel: int, bits: int) -> int:
    """Elements of the code tensor: ``numel`` int8 codes, or ``ceil(numel / 2)`` int4 bytes."""
    return numel if bits == 8 else -(-numel // 2)


def _blocks(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """``flat`` (1-D) zero-padded to whole blocks, viewed as (num_blocks, block_size)."""
    pad = num_blocks(flat.numel(), block_size) * block_size - flat.numel()
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, block_size)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 codes (1-D) to the stored form: int8, or int4 nibbles, low nibble first."""
    if bits == 8:
        return codes.to(torch.int8)
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    return ((codes[0::2] & 0xF) | ((codes[1::2] & 0xF) << 4)).to(torch.uint8)


def _unpack(q: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """The stored codes (1-D) back to ``numel`` int32 codes."""
    if bits == 8:
        return q.reshape(-1)[:numel].to(torch.int32)
    b = q.reshape(-1).to(torch.int32)
    nibbles = torch.stack([b & 0xF, (b >> 4) & 0xF], dim=1).reshape(-1)[:numel]
    return nibbles - ((nibbles & 8) << 1)  # sign-extend 4-bit two's complement


def _dequantized(q: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int,
                 numel: int) -> torch.Tensor:
    """fp32 ``float(q) * scale`` of each element, one product each."""
    codes = _unpack(q, bits, numel).to(torch.float32)
    s = scales.reshape(-1).to(torch.float32).repeat_interleave(block_size)[:numel]
    return codes * s


def quantize(x: torch.Tensor, *, bits: int = 8, block_size: int = 256,
             out: Optional[torch.Tensor] = None,
             scales: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Blockwise symmetric quantization of ``x`` (see [Note: blockwise quantization
    semantics]).

    Args:
        x: contiguous tensor (fp32/bf16/fp16), read as a flat buffer of ``numel`` elements.
        bits: 8 (int8 codes) or 4 (two int4 codes per byte, low nibble first).
        block_size: elements per block, a power of two in [2, 8192].
        out: optional contiguous destination: int8 of ``numel`` elements (bits 8) or uint8 of
            ``ceil(numel / 2)`` (bits 4).
        scales: optional contiguous fp32 destination of ``ceil(numel / block_size)`` elements.

    Returns:
        ``(out, scales)``, new 1-D tensors where not given.
    """
    n = x.numel()
    if out is None:
        out = torch.empty(code_numel(n, bits), dtype=torch.int8 if bits == 8 else torch.uint8,
                          device=x.device)
    if scales is None:
        scales = torch.empty(num_blocks(n, block_size), dtype=torch.float32, device=x.device)
    if n == 0:
        return out, scales
    codes, scale = block_codes(x.reshape(-1).to(torch.float32), block_size, QMAX[bits])
    out.view(-1).copy_(_pack(codes, bits))
    scales.view(-1).copy_(scale)
    return out, scales


def block_codes(flat: torch.Tensor, block_size: int,
                qmax: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """int32 codes (``flat.numel()``) and fp32 scales (one per block) of the fp32 1-D ``flat``,
    with the arithmetic of [Note: blockwise quantization semantics] for any ``qmax``
    (codes in [-qmax, qmax]; in [0, qmax] when ``flat`` holds no negative value)."""
    n = flat.numel()
    blocks = _blocks(flat, block_size)
    top = (blocks.view(torch.int32) & 0x7FFFFFFF).amax(dim=1)
    amax = top.view(torch.float32)
    ok = (top > 0) & (top < _INF_BITS)
    nan = torch.full_like(top, _NAN_BITS).view(torch.float32)
    scale = torch.where(top > _INF_BITS, nan, amax / qmax)
    divisor = torch.where(ok, amax, torch.ones_like(amax))
    codes = torch.round((blocks / divisor[:, None]) * qmax)   # round half to even
    codes = torch.where(ok[:, None], codes, torch.zeros_like(codes)).to(torch.int32)
    return codes.reshape(-1)[:n], scale


def dequantize(q: torch.Tensor, scales: torch.Tensor, *, bits: int = 8, block_size: int = 256,
               numel: Optional[int] = None, out: Optional[torch.Tensor] = None,
               dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``round_to(out.dtype, float(q) * scale)`` per element (see [Note: blockwise
    quantization semantics]).

    Args:
        q: contiguous codes as :func:`quantize` writes them (int8, or uint8 int4 pairs).
        scales: contiguous fp32, ``ceil(numel / block_size)`` elements.
        bits, block_size: as given to :func:`quantize`.
        numel: elements to produce; default ``out.numel()`` when ``out`` is given, else
            ``q.numel()`` (bits 8) or ``2 * q.numel()`` (bits 4).
        out: optional contiguous destination (fp32/bf16/fp16) of ``numel`` elements.
        dtype: dtype of a new ``out`` (default fp32).

    Returns:
        ``out``, or a new 1-D tensor.
    """
    if numel is None:
        numel = out.numel() if out is not None else q.numel() * (1 if bits == 8 else 2)
    if out is None:
        out = torch.empty(numel, dtype=dtype or torch.float32, device=q.device)
    if numel:
        out.view(-1).copy_(_dequantized(q, scales, bits, block_size, numel))
    return out


def dequantize_sum(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, bits: int = 8,
                   block_size: int = 256, scale: float = 1.0,
                   accumulate: bool = False) -> torch.Tensor:
    """Dequantize ``N`` chunks of one shard and sum them in fp32, in chunk order, times
    ``scale``, written to (or, with ``accumulate``, added to) ``out`` (see [Note: blockwise
    quantization semantics] for the exact order of operations).

    Args:
        q: contiguous 2-D (N, codes per chunk): chunk ``r``'s codes of ``out.numel()``
            elements each, as :func:`quantize` writes them.
        scales: contiguous fp32 2-D (N, ceil(out.numel() / block_size)).
        out: contiguous destination (fp32/bf16/fp16), the shard.
        bits, block_size: as given to :func:`quantize`.
        scale: fp32 multiplier of the sum (e.g. 1 / world size to average).
        accumulate: add to ``out`` (in fp32, then rounded) instead of overwriting it.

    Returns:
        ``out``.
    """
    n = out.numel()
    if n == 0:
        return out
    acc = torch.zeros(n, dtype=torch.float32, device=out.device)
    for r in range(q.shape[0]):
        acc = acc + _dequantized(q[r], scales[r], bits, block_size, n)
    acc = acc * torch.tensor(scale, dtype=torch.float32, device=out.device)
    if accumulate:
        acc = out.reshape(-1).to(torch.float32) + acc
    out.view(-1).copy_(acc)
    return out
