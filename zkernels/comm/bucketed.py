"""Bucketed reduce-scatter in a fixed launch order: buckets fill member by member (e.g. the
gradients of a bucket's parameters as backward produces them) and each launches as soon as it
and every bucket before it is complete.

[Note: bucket launch order]
Every rank must issue the same collectives in the same order, but the order in which a bucket's
members arrive may differ (autograd's order, unused parameters). So buckets launch strictly in
index order: a complete bucket waits for the ones before it (its buffer is held meanwhile, see
``ReducePool``). A round ends when the last bucket has launched. A member arriving twice in a
round, or for a bucket already launched (a second backward, some member unused in the first),
closes the round: the caller flushes (packs what it still holds, every pending bucket launches,
one with no member at all reduces zeros) and a new round begins. Callers own what a member is
and how it is packed; this class owns buffers, order and launches.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Set

import torch

from .base import Comm
from .reduce_pool import ReducePool


class BucketedReduceScatter:
    """Launch order and buffers of a list of buckets' reduce-scatters.

    Args:
        comm: the collectives.
        numels: padded elements of each bucket, in launch order.
        shards: this rank's slice of each bucket (``FlatLayout.shard_range``).
        num_members: members each bucket waits for before it may launch.
        dtype, device: of the reduce buffers.
        num_buffers: buffers in the pool (see ``zkernels.zero.planning.policy.num_reduce_buffers``).
        transient_buffers: the buffers live only while a round is filling or in flight
            ([Note: transient reduce buffers] in ``reduce_pool.py``).
        on_reduced: ``on_reduced(bucket_index, shard)`` receives each bucket's reduced shard
            (a view into the buffer, valid only during the call); it may return a fence that
            must be waited before the buffer is reused (see ``ReducePool``).
    """

    def __init__(self, comm: Comm, numels: Sequence[int], shards: Sequence[slice],
                 num_members: Sequence[int], dtype: torch.dtype, device: torch.device,
                 num_buffers: int, on_reduced: Callable[[int, torch.Tensor], None],
                 transient_buffers: bool = False) -> None:
        if not (len(numels) == len(shards) == len(num_members)) or not numels:
            raise ValueError("numels, shards and num_members must describe the same, non-empty, "
                             "list of buckets")
        self._numels = list(numels)
        self._shards = list(shards)
        self._num_members = list(num_members)
        self._on_reduced = on_reduced
        self._pool = ReducePool(comm, max(self._numels), dtype, device, num_buffers,
                                transient=transient_buffers)
        self._reset_round()

    @property
    def num_buckets(self) -> int:
        return len(self._numels)

    @property
    def buffers(self) -> List[torch.Tensor]:
        """The pool's reduce buffers held now (for memory accounting)."""
        return list(self._pool.buffers)

    def take_peak_bytes(self) -> int:
        """The most reduce-buffer bytes held at once since the last call."""
        return self._pool.take_peak()

    def _reset_round(self) -> None:
        self._bufs: List[Optional[torch.Tensor]] = [None] * len(self._numels)
        self._done: List[Set[int]] = [set() for _ in self._numels]
        self._next = 0  # first bucket not yet launched this round

    def round_started(self) -> bool:
        """Whether some bucket was filled or launched in this round."""
        return self._next > 0 or any(b is not None for b in self._bufs)

    def seen(self, bucket: int, member: int) -> bool:
        """Whether ``member`` of ``bucket`` already arrived (or its bucket launched) this
        round: the caller must :meth:`flush` before adding it again."""
        return bucket < self._next or member in self._done[bucket]

    def is_done(self, bucket: int, member: int) -> bool:
        return member in self._done[bucket]

    def buffer(self, bucket: int) -> torch.Tensor:
        """The bucket's zeroed reduce buffer for this round ([numel] view), acquired on first
        use."""
        if self._bufs[bucket] is None:
            self._bufs[bucket] = self._pool.acquire(self._numels[bucket])
        return self._bufs[bucket]

    def mark(self, bucket: int, member: int) -> None:
        """``member`` is packed into the bucket's buffer (launches nothing)."""
        self._done[bucket].add(member)

    def complete(self, bucket: int, member: int) -> None:
        """Mark ``member`` packed and launch every bucket that is now ready, in order."""
        self.mark(bucket, member)
        if len(self._done[bucket]) == self._num_members[bucket]:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while (self._next < len(self._numels)
               and len(self._done[self._next]) == self._num_members[self._next]):
            self._launch(self._next)
        if self._next == len(self._numels):
            self._reset_round()

    def _launch(self, bi: int) -> None:
        buf = self.buffer(bi)  # no member at all on this rank: reduce zeros
        # on_reduced's fence (if any) passes through to the pool.
        self._pool.launch(buf, self._shards[bi], lambda s: self._on_reduced(bi, s))
        self._bufs[bi] = None
        self._next = bi + 1

    def flush(self, pack_missing: Callable[[int], None]) -> None:
        """End the round: for every bucket not yet launched, in order, ``pack_missing(bucket)``
        packs what the caller still holds (with :meth:`buffer` and :meth:`mark`), then the
        bucket launches."""
        for bi in range(self._next, len(self._numels)):
            pack_missing(bi)
            self._launch(bi)
        self._reset_round()

    def drain(self) -> None:
        """Finish every reduction in flight (their ``on_reduced`` run); a transient pool then
        gives its buffers back unless a bucket of a new round is filling."""
        self._pool.drain()
        self._pool.trim()

    def discard(self) -> None:
        """Drop the round: finish what is in flight, release filled buffers unlaunched."""
        self._pool.drain()
        for buf in self._bufs:
            if buf is not None:
                self._pool.release(buf)
        self._reset_round()
        self._pool.trim()
