"""The table-driven copy-scale-cast kernel behind flatten, unflatten and bucket pack/unpack.

All four ops move each of T tensors between its own storage and a slice of one flat buffer,
optionally multiplying by a scale in fp32 and casting to the destination dtype; only the
address columns differ. One kernel serves them (see [Note: multi-tensor launches] in
``_tables.py``).
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from ._rounding import convert, round_to
from ._tables import COPY_BLOCK, COPY_WARPS, build_table, native_nan, tl_dtype


@triton.jit
def _scaled(x, scale, DST: tl.constexpr, HAS_SCALE: tl.constexpr, FP32_ROUTE: tl.constexpr,
            NATIVE_NAN: tl.constexpr):
    if HAS_SCALE:
        return round_to(x.to(tl.float32) * scale, DST, NATIVE_NAN)
    elif FP32_ROUTE and x.dtype != DST:
        # ``(x.float() * 1.0).to(DST)``: same bits as ``x.to(DST)`` except for NaN, whose CPU
        # pattern depends on the route (see [Note: exact rounding in kernels]).
        return round_to(x.to(tl.float32), DST, NATIVE_NAN)
    else:
        return convert(x, DST, NATIVE_NAN)


@triton.jit
def _copy_block(src_ptrs, dst_ptrs, offs, numel, scale, DST: tl.constexpr,
                HAS_SCALE: tl.constexpr, FP32_ROUTE: tl.constexpr, MASKED: tl.constexpr,
                NATIVE_NAN: tl.constexpr):
    if MASKED:
        mask = offs < numel
        x = tl.load(src_ptrs, mask=mask)
        tl.store(dst_ptrs, _scaled(x, scale, DST, HAS_SCALE, FP32_ROUTE, NATIVE_NAN), mask=mask)
    else:
        x = tl.load(src_ptrs)
        tl.store(dst_ptrs, _scaled(x, scale, DST, HAS_SCALE, FP32_ROUTE, NATIVE_NAN))


# Sizes are not specialized on: a new bucket or tensor count must not mean a new compile.
@triton.jit(do_not_specialize=["num_tensors", "num_blocks"])
def _scaled_copy_kernel(meta, scale, num_tensors, num_blocks, SRC: tl.constexpr,
                        DST: tl.constexpr, HAS_SCALE: tl.constexpr, FP32_ROUTE: tl.constexpr,
                        NATIVE_NAN: tl.constexpr, BLOCK: tl.constexpr):
    """Block ``pid``: ``dst[i] = round(src[i] * scale)`` for its BLOCK elements of one tensor.

    ``meta`` columns: source byte address, destination byte address (see ``_tables.py``).
    """
    pid = tl.program_id(0)
    tensor = tl.load(meta + 4 * num_tensors + pid)
    start = tl.load(meta + 4 * num_tensors + num_blocks + pid)
    src = tl.load(meta + tensor).to(tl.pointer_type(SRC))
    dst = tl.load(meta + num_tensors + tensor).to(tl.pointer_type(DST))
    aligned = tl.load(meta + 2 * num_tensors + tensor)
    numel = tl.load(meta + 3 * num_tensors + tensor)
    offs = start + tl.arange(0, BLOCK)
    src_ptrs = src + offs
    dst_ptrs = dst + offs
    # Full blocks go unmasked, aligned ones with the hint, so that the compiler vectorizes;
    # only a tensor's last block pays for the mask.
    if start + BLOCK <= numel:
        if aligned != 0:
            _copy_block(tl.max_contiguous(tl.multiple_of(src_ptrs, 16), BLOCK),
                        tl.max_contiguous(tl.multiple_of(dst_ptrs, 16), BLOCK), offs, numel,
                        scale, DST, HAS_SCALE, FP32_ROUTE, False, NATIVE_NAN)
        else:
            _copy_block(src_ptrs, dst_ptrs, offs, numel, scale, DST, HAS_SCALE, FP32_ROUTE,
                        False, NATIVE_NAN)
    else:
        _copy_block(src_ptrs, dst_ptrs, offs, numel, scale, DST, HAS_SCALE, FP32_ROUTE, True,
                    NATIVE_NAN)


# [Note: one tensor, no table]
# ZeRO stage 2's gradient hook packs ONE gradient per call, thousands of times per step.
# Building a block table for it (host tensors, a pinned copy, a host-to-device transfer) would
# cost more host time than the copy itself, and the table cannot be cached: autograd hands
# each step a fresh gradient tensor. A single tensor needs no table: its source and
# destination are kernel arguments, block ``pid`` copies elements [pid * BLOCK, +BLOCK), and
# Triton's own specialization of pointer arguments on 16-byte alignment gives full blocks
# their vector loads. Same ``_copy_block``, so the same bits as the table kernel.
@triton.jit(do_not_specialize=["numel"])
def _scaled_copy_one_kernel(src, dst, numel, scale, DST: tl.constexpr, HAS_SCALE: tl.constexpr,
                            FP32_ROUTE: tl.constexpr, NATIVE_NAN: tl.constexpr,
                            BLOCK: tl.constexpr):
    """Block ``pid``: ``dst[i] = round(src[i] * scale)`` for its BLOCK elements."""
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= numel:
        _copy_block(src + offs, dst + offs, offs, numel, scale, DST, HAS_SCALE, FP32_ROUTE,
                    False, NATIVE_NAN)
    else:
        _copy_block(src + offs, dst + offs, offs, numel, scale, DST, HAS_SCALE, FP32_ROUTE,
                    True, NATIVE_NAN)


def scaled_copy_one(src: torch.Tensor, dst: torch.Tensor, scale: float = 1.0,
                    fp32_route: bool = False) -> None:
    """:func:`scaled_copy` of one tensor with no block table (see [Note: one tensor, no
    table]): ``dst = round(src * scale)``, both contiguous with the same number of elements."""
    numel = src.numel()
    if numel == 0:
        return
    scale = float(scale)
    _scaled_copy_one_kernel[(triton.cdiv(numel, COPY_BLOCK),)](
        src, dst, numel, scale, DST=tl_dtype(dst.dtype), HAS_SCALE=scale != 1.0,
        FP32_ROUTE=fp32_route, NATIVE_NAN=native_nan(dst.device), BLOCK=COPY_BLOCK,
        num_warps=COPY_WARPS)


def scaled_copy(src_addrs: Sequence[int], dst_addrs: Sequence[int], numels: Sequence[int],
                src_dtype: torch.dtype, dst_dtype: torch.dtype, device: torch.device,
                scale: float = 1.0, fp32_route: bool = False) -> None:
    """One launch: for each i, ``numels[i]`` elements from byte address ``src_addrs[i]``
    (``src_dtype``) to ``dst_addrs[i]`` (``dst_dtype``), times ``scale`` in fp32, cast RNE.

    Args:
        src_addrs, dst_addrs: byte addresses of each tensor's first element, on ``device``.
        numels: element counts.
        src_dtype, dst_dtype: fp32/bf16/fp16.
        device: the device holding every address.
        scale: 1.0 skips the multiply (a pure copy or cast, bit-exact).
        fp32_route: convert as ``(x.float() * scale).to(dst)`` even when ``scale == 1``
            (the bucket ops' definition) rather than ``x.to(dst)`` (flatten's); the two differ
            only in NaN bit patterns on CPU.
    """
    table = build_table([src_addrs, dst_addrs], numels, device, COPY_BLOCK, 2)
    if table.num_blocks == 0:
        return
    scale = float(scale)
    _scaled_copy_kernel[(table.num_blocks,)](
        table.meta, scale, table.num_tensors, table.num_blocks, SRC=tl_dtype(src_dtype),
        DST=tl_dtype(dst_dtype), HAS_SCALE=scale != 1.0, FP32_ROUTE=fp32_route,
        NATIVE_NAN=native_nan(device), BLOCK=COPY_BLOCK, num_warps=COPY_WARPS)
