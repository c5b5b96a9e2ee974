"""Flat, rank-aligned buffer layouts: where each tensor lives in a flat buffer and which slice
each rank owns.

[Note: rank-aligned flat buffers]
A bucket (stage 1/2) or a gathered unit (stage 3) is one contiguous 1-D buffer holding its
tensors back to back, each starting at a multiple of ``align`` elements, padded at the end so
that ``padded_numel`` divides by the world size. Rank ``r`` owns the contiguous slice
``[r * shard_numel, (r + 1) * shard_numel)``. Hence ONE ``reduce_scatter`` over the whole
bucket leaves each rank exactly its gradient shard and ONE ``all_gather`` of the shards rebuilds
the bucket: 2Ψ per step. Shard boundaries may cut through a tensor; every per-element update
(AdamW, casts, unscale) is indifferent to that, and per-tensor quantities (norms) are sums over
elements. Padding elements are zero and stay zero: they never receive a gradient.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple


def packed_offsets(numels: Sequence[int]) -> List[int]:
    """Offsets that place tensors of ``numels`` back to back from 0 (no alignment)."""
    out, pos = [], 0
    for n in numels:
        out.append(pos)
        pos += int(n)
    return out


@dataclass(frozen=True)
class FlatLayout:
    """Placement of tensors in one flat buffer shared by ``world_size`` ranks.

    Attributes:
        numels: element count of each tensor, in order.
        offsets: element offset of each tensor in the buffer.
        numel: elements covered by tensors and the alignment gaps between them.
        padded_numel: buffer length, ``numel`` rounded up to a multiple of ``world_size * align``.
        world_size: number of ranks sharing the buffer.
        shard_numel: ``padded_numel // world_size``, the slice each rank owns.
    """

    numels: Tuple[int, ...]
    offsets: Tuple[int, ...]
    numel: int
    padded_numel: int
    world_size: int
    shard_numel: int

    @classmethod
    def build(cls, numels: Sequence[int], world_size: int, align: int = 1) -> "FlatLayout":
        """Lay ``numels`` out back to back, each offset a multiple of ``align``.

        Args:
            numels: element counts (each >= 0).
            world_size: ranks sharing the buffer (>= 1).
            align: element alignment of each tensor's start and of each shard (>= 1). Use
                e.g. 16 bytes / element size to keep every tensor and shard vector-aligned.
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if align < 1:
            raise ValueError(f"align must be >= 1, got {align}")
        offsets, pos = [], 0
        for i, n in enumerate(numels):
            n = int(n)
            if n < 0:
                raise ValueError(f"numels[{i}] must be >= 0, got {n}")
            pos = -(-pos // align) * align
            offsets.append(pos)
            pos += n
        unit = world_size * align
        padded = max(-(-pos // unit) * unit, 0)
        return cls(tuple(int(n) for n in numels), tuple(offsets), pos, padded, world_size,
                   padded // world_size)

    def shard_range(self, rank: int) -> Tuple[int, int]:
        """Half-open element range ``[start, end)`` of the buffer that ``rank`` owns."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def tensor_slices_in_shard(self, rank: int):
        """For each tensor overlapping ``rank``'s shard, yield
        ``(index, start_in_tensor, start_in_shard, length)``."""
        lo, hi = self.shard_range(rank)
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            a, b = max(off, lo), min(off + n, hi)
            if a < b:
                yield i, a - off, a - lo, b - a
