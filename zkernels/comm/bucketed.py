"""Bucketed reduce-scatter in a fixed launch order: buckets fill member by member (e.g. the
gradients of a bucket's parameters as backward produces them) and each launches as soon as it
and every bucket before it is complete.

[Note: bucket launch order]
Every rank must issue the same collectives in the same order, but the order in which a bucket's
members arrive may differ (autograd's order, unused parameters). So buckets launch strictly in
index order: a complete bucket waits for the ones before it (its buffer is held meanwhile, see
``ReducePool``). A round ends when the last bucket has launched. A member arriving twice in a
round, or for a bucket already launched (a second backward, some member unused in the first),
closes the round: the caller flushes (every pending bucket packs what it still holds and
launches, one with no member at all reduces zeros) and a new round begins.

Each :class:`ReduceBucket` owns its members this round, its reduce buffer (from the shared pool,
at its first member) and its launch; a subclass packs. :class:`LaunchOrder` owns the order.
"""
from __future__ import annotations

import weakref
from typing import Optional, Sequence

import torch

from .reduce_pool import ReducePool


class ReduceBucket:
    """One bucket's reduce-scatter; a subclass defines :meth:`reduced` (and may define
    :meth:`pack_held`).

    Args:
        pool: the shared :class:`ReducePool` (None: a subclass that launches without one).
        numel: padded elements of the bucket.
        shard: this rank's slice of it (``FlatLayout.shard_range``).
        num_members: members it waits for before it may launch.
    """

    def __init__(self, pool: Optional[ReducePool], numel: int, shard: slice,
                 num_members: int) -> None:
        self.pool, self.numel, self.shard = pool, numel, shard
        self.num_members = num_members
        self._buf: Optional[torch.Tensor] = None
        self.members: set = set()  # members packed this round
        self.launched = False      # launched this round
        self._order = None         # weakref to the LaunchOrder (set by it)

    @property
    def complete(self) -> bool:
        return len(self.members) == self.num_members

    def seen(self, member) -> bool:
        """Whether ``member`` already arrived (or the bucket launched) this round: the caller
        must flush the order before adding it again."""
        return self.launched or member in self.members

    def buffer(self) -> torch.Tensor:
        """This round's zeroed reduce buffer ([numel] view), acquired on first use."""
        if self._buf is None:
            self._buf = self.pool.acquire(self.numel)
        return self._buf

    def add(self, member) -> None:
        """``member`` is packed; if that completes the bucket, launch every bucket of the
        order that is now ready."""
        self.members.add(member)
        if self.complete:
            self._order().advance()

    def launch(self) -> None:
        """Start the reduce-scatter (no member at all on this rank: it reduces zeros)."""
        buf = self.buffer()
        self._buf, self.launched = None, True
        self.pool.launch(buf, self.shard, self.reduced)

    def reduced(self, shard: torch.Tensor):
        """Receives the reduced shard (a view into the buffer, valid only during the call); may
        return a fence to wait before the buffer is reused (see ``ReducePool``)."""
        raise NotImplementedError

    def pack_held(self) -> None:
        """Before a flush launches it: pack what the owner still holds (default nothing)."""

    def new_round(self) -> None:
        self.members, self.launched = set(), False

    def discard(self) -> None:
        """Give back a buffer filled but not launched."""
        if self._buf is not None:
            self.pool.release(self._buf)
            self._buf = None


class LaunchOrder:
    """The launch order and rounds of a list of buckets ([Note: bucket launch order]).

    Args:
        buckets: the :class:`ReduceBucket` s in launch order.
        pool: their shared reduce pool (None: the buckets launch without one).
    """

    def __init__(self, buckets: Sequence[ReduceBucket], pool: Optional[ReducePool]) -> None:
        if not buckets:
            raise ValueError("a launch order needs at least one bucket")
        self.buckets, self.pool = list(buckets), pool
        self._next = 0  # first bucket not yet launched this round
        for b in self.buckets:
            b._order = weakref.ref(self)

    def started(self) -> bool:
        """Whether some bucket was filled or launched in this round."""
        return self._next > 0 or any(b._buf is not None for b in self.buckets)

    def advance(self) -> None:
        """Launch every bucket that is ready, in order; the round ends after the last."""
        while self._next < len(self.buckets) and self.buckets[self._next].complete:
            self.buckets[self._next].launch()
            self._next += 1
        if self._next == len(self.buckets):
            self.new_round()

    def flush(self) -> None:
        """End the round: every bucket not yet launched, in order, packs what its owner still
        holds (``pack_held``) and launches."""
        for b in self.buckets[self._next:]:
            b.pack_held()
            b.launch()
        self.new_round()

    def new_round(self) -> None:
        """Start a new round (what was launched stays in flight)."""
        self._next = 0
        for b in self.buckets:
            b.new_round()

    def drain(self) -> None:
        """Finish every reduction in flight (their ``reduced`` run); a transient pool then
        gives its buffers back unless a bucket of a new round is filling."""
        if self.pool is not None:
            self.pool.drain()
            self.pool.trim()

    def discard(self) -> None:
        """Drop the round: finish what is in flight, release filled buffers unlaunched."""
        self.pool.drain()
        for b in self.buckets:
            b.discard()
        self.new_round()
        self.pool.trim()
