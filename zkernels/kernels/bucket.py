"""Triton bucket pack / unpack: scaled, cast, one launch for all tensors (kernel in
``_copy.py``; see [Note: rank-aligned flat buffers] in ``zkernels/layout.py``)."""
from __future__ import annotations

from typing import Sequence

import torch

from ._copy import scaled_copy, scaled_copy_one


def bucket_pack(tensors: Sequence[torch.Tensor], bucket: torch.Tensor, offsets: Sequence[int], *,
                scale: float = 1.0) -> torch.Tensor:
    """``bucket[o:o+n] = round((float32(t) * scale) -> bucket.dtype)`` for every tensor.

    Args:
        tensors: contiguous, one dtype (fp32/bf16/fp16), on ``bucket``'s device.
        bucket: 1-D contiguous buffer (fp32/bf16/fp16).
        offsets: element offset of each tensor in ``bucket``.
        scale: fp32 multiplier (1.0: a plain copy/cast).

    Returns:
        ``bucket``; elements outside the tensors (padding) are untouched.
    """
    if not tensors:
        return bucket
    if len(tensors) == 1:   # stage 2's per-gradient hook: no table (see _copy.py)
        t, o = tensors[0], int(offsets[0])
        scaled_copy_one(t, bucket[o:o + t.numel()], scale, fp32_route=True)
        return bucket
    esize, base = bucket.element_size(), bucket.data_ptr()
    scaled_copy([t.data_ptr() for t in tensors], [base + int(o) * esize for o in offsets],
                [t.numel() for t in tensors], tensors[0].dtype, bucket.dtype, bucket.device,
                scale, fp32_route=True)
    return bucket


def bucket_unpack(bucket: torch.Tensor, outs: Sequence[torch.Tensor], offsets: Sequence[int], *,
                  scale: float = 1.0) -> Sequence[torch.Tensor]:
    """``out = round((float32(bucket[o:o+n]) * scale) -> out.dtype)`` for every output.

    Args:
        bucket: 1-D contiguous buffer.
        outs: contiguous destinations (one dtype), on ``bucket``'s device.
        offsets: element offset of each destination's data in ``bucket``.
        scale: fp32 multiplier.

    Returns:
        ``outs``.
    """
    if not outs:
        return outs
    esize, base = bucket.element_size(), bucket.data_ptr()
    scaled_copy([base + int(o) * esize for o in offsets], [t.data_ptr() for t in outs],
                [t.numel() for t in outs], bucket.dtype, outs[0].dtype, bucket.device,
                scale, fp32_route=True)
    return outs
