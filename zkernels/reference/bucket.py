"""Reference bucket pack / unpack (see [Note: rank-aligned flat buffers] in zkernels/layout.py)."""
from __future__ import annotations

from typing import Sequence

import torch


def bucket_pack(tensors: Sequence[torch.Tensor], bucket: torch.Tensor, offsets: Sequence[int], *,
                scale: float = 1.0) -> torch.Tensor:
    """Write each tensor, times ``scale``, cast to ``bucket.dtype``, at its offset in ``bucket``.

    The product is formed in fp32 and rounded once (nearest even) to the bucket dtype, so
    with ``scale == 1`` this is exactly ``tensor.to(bucket.dtype)``.

    Args:
        tensors: gradients, contiguous, one dtype (fp32/bf16/fp16), on ``bucket``'s device.
        bucket: 1-D contiguous buffer (fp32/bf16/fp16): the reduce buffer.
        offsets: element offset of each tensor in ``bucket``.
        scale: multiplier, e.g. 1/N for a mean or the inverse loss scale.

    Returns:
        ``bucket``. Elements between and after tensors are left untouched (they are padding).
    """
    for t, o in zip(tensors, offsets):
        n = t.numel()
        bucket[o:o + n].copy_(t.reshape(-1).float().mul(scale))
    return bucket


def bucket_unpack(bucket: torch.Tensor, outs: Sequence[torch.Tensor], offsets: Sequence[int], *,
                  scale: float = 1.0) -> Sequence[torch.Tensor]:
    """Inverse of :func:`bucket_pack`: ``out = (bucket[o:o+n] * scale).to(out.dtype)``.

    Args:
        bucket: 1-D contiguous buffer.
        outs: contiguous destinations (any shapes, one dtype), on ``bucket``'s device.
        offsets: element offset of each destination's data in ``bucket``.
        scale: multiplier applied in fp32 before the cast.

    Returns:
        ``outs``.
    """
    for t, o in zip(outs, offsets):
        n = t.numel()
        t.view(-1).copy_(bucket[o:o + n].float().mul(scale))
    return outs
