"""Flat rank-aligned buckets over the trainable parameters: the compute buffer the model's
parameters become views of, this rank's master shard and its AdamW moments.

See [Note: rank-aligned flat buffers] in ``zkernels/layout.py``. Buckets never mix param
groups, so every hyperparameter is uniform over a bucket and AdamW runs once per bucket shard.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

from .. import ops
from ..layout import FlatLayout
from .precision import MixedPrecision

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


@dataclass
class Bucket:
    """One bucket's persistent buffers on this rank.

    Attributes:
        index: position in launch order.
        group_index: the param group all its parameters belong to.
        params: its parameters; ``params[i].data`` is a view of ``compute`` at
            ``layout.offsets[i]``.
        layout: placement in the flat buffers.
        compute: [padded_numel] param_dtype, the full compute parameters (all-gather output).
        master: [shard_numel] fp32, this rank's master shard: a view of ``compute`` in pure
            fp32, a separate buffer with a low-precision ``param_dtype``.
        exp_avg, exp_avg_sq: [shard_numel] fp32 AdamW moments of the shard.
        step: AdamW steps applied to this bucket.
    """

    index: int
    group_index: int
    params: List[torch.Tensor]
    layout: FlatLayout
    rank: int
    compute: torch.Tensor
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int = 0

    @property
    def shard_slice(self) -> slice:
        lo, hi = self.layout.shard_range(self.rank)
        return slice(lo, hi)

    @property
    def compute_shard(self) -> torch.Tensor:
        """[shard_numel] param_dtype view of this rank's slice of ``compute``."""
        return self.compute[self.shard_slice]


def build_bucket(index: int, group_index: int, params: List[torch.Tensor], layout: FlatLayout,
                 rank: int, precision: MixedPrecision) -> Bucket:
    """Copy ``params`` into a new flat compute buffer and make them views of it.

    The master shard is taken from the original fp32 values before any cast, so a
    low-precision ``param_dtype`` loses nothing in the master copy.
    """
    device = params[0].device
    lo, hi = layout.shard_range(rank)
    fp32 = torch.zeros(layout.padded_numel, dtype=torch.float32, device=device)
    with torch.no_grad():
        ops.flatten([p.detach().contiguous() for p in params], out=fp32,
                    offsets=layout.offsets)
    if precision.has_master:
        master = fp32[lo:hi].clone()
        compute = ops.cast(fp32, precision.param_dtype)
        del fp32
    else:
        compute = fp32
        master = compute[lo:hi]
    views = ops.unflatten(compute, [p.shape for p in params], offsets=layout.offsets)
    for p, v in zip(params, views):
        p.data = v
    shard = layout.shard_numel
    return Bucket(index, group_index, list(params), layout, rank, compute, master,
                  torch.zeros(shard, dtype=torch.float32, device=device),
                  torch.zeros(shard, dtype=torch.float32, device=device))
