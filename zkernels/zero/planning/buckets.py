"""How stages 1-2 cut the trainable parameters into flat rank-aligned buckets (each becomes
one :class:`~zkernels.zero.parameters.units.FlatParamUnit`, the unit one reduce-scatter moves).

See [Note: rank-aligned flat buffers] in ``zkernels/layout.py``. Buckets never mix param
groups, so every hyperparameter is uniform over a bucket and AdamW runs once per bucket shard.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from ...layout import FlatLayout

ALIGN_BYTES = 16  # every tensor and shard starts 16-byte aligned for vector loads

# [Note: buckets sized from the model]
# ``bucket_bytes=None`` (the default) sizes buckets from the model, by what a bucket costs:
# - Where gradients go through pooled reduce buffers (stage 2; stage 1 when it must cast or
#   pre-divide: ``StagePolicy.uses_reduce_pool``), a bucket costs memory: two of them are held
#   (``policy.num_reduce_buffers``). The model's reduce bytes (Ψ · reduce dtype size) are cut
#   into AUTO_NUM_BUCKETS buckets, within [AUTO_MIN_BUCKET_BYTES, AUTO_MAX_BUCKET_BYTES]
#   (larger models get more buckets, not larger ones), with a first bucket a quarter of that
#   so the first reduce-scatter starts early in backward (DDP's small first bucket). Four
#   buckets' worth (five buckets with the first, as the greedy cut falls at tensor boundaries)
#   keep the two buffers at most Ψ/2 of reduce dtype: stage 2 then holds at most stage 1
#   (whose full gradients are Ψ of the param dtype; at two ranks in fp32 the buffers may take
#   all that stage 2 saves there, Ψ/2 of fp32, and no more) and stays within its formula plus
#   two buckets, while backward overlaps the reductions. Each further bucket pays one more
#   collective latency twice (reduce-scatter and all-gather): measured on the demo's GPT at 2
#   gloo ranks, seven buckets (six's worth) took 2.5-3% more step time than five, paired, in
#   each of three runs; more memory-frugal settings trade step time for memory no bar asks for.
# - Where stage 1 reduce-scatters its flat gradient in place, a bucket costs no memory, only
#   a collective latency per reduce-scatter and per all-gather, so it takes DDP's sizes: a
#   1 MiB first bucket, then 25 MiB (``torch.nn.parallel.DistributedDataParallel``'s
#   defaults), the fewest collectives that still start the first one early.
# ``estimate_memory`` applies the same rule (:func:`auto_bucket_bytes`), so estimates and
# ``stats()`` agree.
AUTO_NUM_BUCKETS = 4
AUTO_MIN_BUCKET_BYTES = 2 ** 16
AUTO_MAX_BUCKET_BYTES = 25 * 2 ** 20
AUTO_FIRST_BUCKET_FRACTION = 4
DDP_FIRST_BUCKET_BYTES = 2 ** 20
DDP_BUCKET_BYTES = 25 * 2 ** 20


def align_numel(*dtypes: torch.dtype) -> int:
    """Element alignment that keeps every offset 16-byte aligned in each of ``dtypes``."""
    return ALIGN_BYTES // min(d.itemsize for d in dtypes)


def auto_bucket_bytes(num_params: int, reduce_dtype: torch.dtype,
                      pooled: bool = True) -> Tuple[int, int]:
    """``(first bucket bytes, bucket bytes)`` for ``num_params`` trainable parameters reduced in
    ``reduce_dtype``, through pooled reduce buffers or not (see [Note: buckets sized from the
    model])."""
    if not pooled:
        return DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES
    total = int(num_params) * reduce_dtype.itemsize
    size = min(max(total // AUTO_NUM_BUCKETS, AUTO_MIN_BUCKET_BYTES), AUTO_MAX_BUCKET_BYTES)
    return size // AUTO_FIRST_BUCKET_FRACTION, size


def bucket_capacities(bucket_bytes: Optional[int], num_params: int, reduce_dtype: torch.dtype,
                      world_size: int, align: int, pooled: bool) -> Tuple[int, int]:
    """``(first bucket capacity, capacity)`` in elements: ``bucket_bytes`` for every bucket,
    or, with None, sized from the model (:func:`auto_bucket_bytes`; never below one aligned
    element per rank)."""
    if bucket_bytes is None:
        first, size = auto_bucket_bytes(num_params, reduce_dtype, pooled)
        minimum = world_size * align * reduce_dtype.itemsize
        return (bucket_capacity(max(first, minimum), reduce_dtype, world_size, align),
                bucket_capacity(max(size, minimum), reduce_dtype, world_size, align))
    capacity = bucket_capacity(bucket_bytes, reduce_dtype, world_size, align)
    return capacity, capacity


def bucket_capacity(bucket_bytes: int, reduce_dtype: torch.dtype, world_size: int,
                    align: int) -> int:
    """Elements a bucket holds: ``bucket_bytes`` (an int: ``BucketConfig`` checked it) of
    reduce buffer (the unit one reduce-scatter moves).

    Raises:
        ValueError: ``bucket_bytes`` cannot hold one aligned element per rank (each rank's
            shard would be empty).
    """
    elem = reduce_dtype.itemsize
    minimum = world_size * align * elem
    if bucket_bytes < minimum:
        raise ValueError(f"bucket_bytes={bucket_bytes} is too small: a bucket must hold at least "
                         f"{align} element(s) per rank ({minimum} bytes of {reduce_dtype} for "
                         f"{world_size} ranks)")
    return bucket_bytes // elem


def plan_buckets(ordered: Sequence[Tuple[int, torch.Tensor]], capacity: int, world_size: int,
                 align: int, first_capacity: Optional[int] = None
                 ) -> List[Tuple[int, List[torch.Tensor], FlatLayout]]:
    """Greedy partition into buckets of at most ``capacity`` elements that never mix groups;
    a parameter larger than ``capacity`` gets a bucket of its own.

    Parameters are taken in reverse registration order, because backward produces gradients
    roughly in that order, with one open bucket per group; a bucket takes its place in the
    launch order when it closes (is full), so stage 2's buckets complete, and launch, in
    about the order of the list even when groups interleave (weights and biases).

    Args:
        ordered: ``(group_index, param)`` in the model's registration order.
        capacity, world_size, align: bucket size in elements, ranks, element alignment.
        first_capacity: the first bucket to close closes once it holds this many elements
            (default ``capacity``): a small first bucket starts the first reduction early.

    Returns:
        ``(group_index, params, layout)`` per bucket, in launch order.
    """
    plans = []
    open_: dict = {}  # group index -> (params, used elements)

    def close(gi):
        params, _ = open_.pop(gi)
        plans.append((gi, params, FlatLayout.build([q.numel() for q in params], world_size,
                                                   align)))

    first = capacity if first_capacity is None else first_capacity
    for gi, p in reversed(list(ordered)):
        params, used = open_.get(gi, ([], 0))
        start = -(-used // align) * align
        # The first bucket closes once it holds ``first`` elements (DDP's rule for its small
        # first bucket: the tensor that crosses the line stays in); every bucket, the first
        # too, closes before it would exceed ``capacity``.
        if params and (start + p.numel() > capacity or (not plans and used >= first)):
            close(gi)
            params, start = [], 0
        params.append(p)
        open_[gi] = (params, start + p.numel())
    for gi in sorted(open_):
        close(gi)
    return plans
