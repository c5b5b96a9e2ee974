"""Host side of the multi-tensor kernels: dtype mapping and the per-call block table.

[Note: multi-tensor launches]
flatten, unflatten, bucket_pack/unpack and sum_squares touch many tensors of different sizes
in ONE launch. The host builds, with vectorized torch ops (no per-block Python loop), one int64
buffer

    [ column_0 (T) | ... | column_{K-1} (T) | aligned (T) | numel (T) |
      block_tensor (B) | block_start (B) ]

where the K per-tensor columns are byte addresses (``data_ptr`` plus an element offset) or
small codes, and each of the B blocks is one BLOCK-sized piece of one tensor. The buffer moves
to the device in one copy; program ``pid`` reads its tensor index and element start, then that
tensor's row, and casts the addresses with ``.to(tl.pointer_type(...))``. Every program handles
exactly one block, so no kernel needs a loop with a runtime bound, and the grid and table are
identical on CPU (interpreter) and GPU.

``aligned`` is 1 where all of a tensor's addresses are multiples of 16 bytes. A full block of
such a tensor takes a branch that tells the compiler so (``tl.multiple_of``), and gets 128-bit
loads and stores; blocks start at multiples of BLOCK, so the hint holds for each of its blocks.
Other full blocks run unmasked but element-wise, last blocks masked: one misaligned tensor
(an odd offset in a flat buffer) slows only itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import triton.language as tl

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

# Elements per program and warps per program for the memory-bound kernels. 4096 elements over
# 8 warps is 16 elements per thread: four 128-bit accesses of fp32, two of bf16/fp16.
COPY_BLOCK = 4096
COPY_WARPS = 8


def tl_dtype(dtype: torch.dtype):
    """The Triton dtype of a torch float dtype (fp32/bf16/fp16)."""
    try:
        return TL_DTYPES[dtype]
    except KeyError:
        raise TypeError(f"dtype must be one of {tuple(TL_DTYPES)}, got {dtype}") from None


def native_nan(device: torch.device) -> bool:
    """Whether NaN casts use the compiled instruction (see [Note: exact rounding in kernels])."""
    return device.type == "cuda"


@dataclass(frozen=True)
class BlockTable:
    """The table of [Note: multi-tensor launches], on the kernels' device.

    Attributes:
        meta: 1-D int64 tensor, ``(K + 2) * num_tensors + 2 * num_blocks`` elements.
        num_tensors: T, rows per column.
        num_blocks: B, the grid size.
    """

    meta: torch.Tensor
    num_tensors: int
    num_blocks: int


def build_table(columns: Sequence[Sequence[int]], numels: Sequence[int], device: torch.device,
                block: int, num_address_columns: int) -> BlockTable:
    """Build the block table of [Note: multi-tensor launches].

    Args:
        columns: K per-tensor integer columns, each of length T; the first
            ``num_address_columns`` are byte addresses (their 16-byte alignment per tensor
            becomes the ``aligned`` column).
        numels: T element counts (empty tensors get no block).
        device: where the kernels run.
        block: elements per block (the kernel's BLOCK).
        num_address_columns: how many leading columns hold addresses.

    Returns:
        the table, already on ``device``.
    """
    num_tensors = len(numels)
    cols = torch.tensor([[int(v) for v in col] for col in columns],
                        dtype=torch.int64).reshape(len(columns), num_tensors)
    aligned = (cols[:num_address_columns] % 16 == 0).all(dim=0).to(torch.int64)
    numel = torch.tensor([int(n) for n in numels], dtype=torch.int64)
    counts = (numel + (block - 1)) // block
    block_tensor = torch.repeat_interleave(torch.arange(num_tensors, dtype=torch.int64), counts)
    num_blocks = int(block_tensor.numel())
    first_block = torch.cumsum(counts, 0) - counts
    block_start = (torch.arange(num_blocks, dtype=torch.int64) - first_block[block_tensor]) * block
    meta = torch.cat([cols.reshape(-1), aligned, numel, block_tensor, block_start])
    if device.type != "cpu":
        # Pinned + non_blocking: no host sync; the caching host allocator keeps the pinned
        # buffer alive until the copy has run.
        meta = meta.pin_memory().to(device, non_blocking=True)
    return BlockTable(meta, num_tensors, num_blocks)
