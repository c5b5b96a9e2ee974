"""How stages 1-2 cut the trainable parameters into flat rank-aligned buckets (each becomes
one :class:`~zkernels.zero.units.FlatParamUnit`, the unit one reduce-scatter moves).

See [Note: rank-aligned flat buffers] in ``zkernels/layout.py``. Buckets never mix param
groups, so every hyperparameter is uniform over a bucket and AdamW runs once per bucket shard.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from ..layout import FlatLayout

ALIGN_BYTES = 16  # every tensor and shard starts 16-byte aligned for vector loads


def align_numel(*dtypes: torch.dtype) -> int:
    """Element alignment that keeps every offset 16-byte aligned in each of ``dtypes``."""
    return ALIGN_BYTES // min(torch.empty((), dtype=d).element_size() for d in dtypes)


def bucket_capacity(bucket_bytes: int, reduce_dtype: torch.dtype, world_size: int,
                    align: int) -> int:
    """Elements a bucket holds: ``bucket_bytes`` of reduce buffer (the unit one
    reduce-scatter moves).

    Raises:
        ValueError: ``bucket_bytes`` cannot hold one aligned element per rank (each rank's
            shard would be empty).
    """
    if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool):
        raise TypeError(f"bucket_bytes must be an int, got {type(bucket_bytes).__name__}")
    elem = torch.empty((), dtype=reduce_dtype).element_size()
    minimum = world_size * align * elem
    if bucket_bytes < minimum:
        raise ValueError(f"bucket_bytes={bucket_bytes} is too small: a bucket must hold at least "
                         f"{align} element(s) per rank ({minimum} bytes of {reduce_dtype} for "
                         f"{world_size} ranks)")
    return bucket_bytes // elem


def plan_buckets(ordered: Sequence[Tuple[int, torch.Tensor]], capacity: int, world_size: int,
                 align: int) -> List[Tuple[int, List[torch.Tensor], FlatLayout]]:
    """Greedy partition into buckets of at most ``capacity`` elements that never mix groups;
    a parameter larger than ``capacity`` gets a bucket of its own.

    Parameters are taken in reverse registration order, because backward produces gradients
    roughly in that order, with one open bucket per group; a bucket takes its place in the
    launch order when it closes (is full), so stage 2's buckets complete, and launch, in
    about the order of the list even when groups interleave (weights and biases).

    Args:
        ordered: ``(group_index, param)`` in the model's registration order.
        capacity, world_size, align: bucket size in elements, ranks, element alignment.

    Returns:
        ``(group_index, params, layout)`` per bucket, in launch order.
    """
    plans = []
    open_: dict = {}  # group index -> (params, used elements)

    def close(gi):
        params, _ = open_.pop(gi)
        plans.append((gi, params, FlatLayout.build([q.numel() for q in params], world_size,
                                                   align)))

    for gi, p in reversed(list(ordered)):
        params, used = open_.get(gi, ([], 0))
        start = -(-used // align) * align
        if params and start + p.numel() > capacity:
            close(gi)
            params, start = [], 0
        params.append(p)
        open_[gi] = (params, start + p.numel())
    for gi in sorted(open_):
        close(gi)
    return plans
