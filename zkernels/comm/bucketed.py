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

Each :class:`ReduceBucket` owns its own step: the members it has this round, its reduce buffer
(acquired from the shared pool at its first member, handed back by the pool once its reduction
is retired) and its launch; a subclass says what a member is and how it is packed. The
:class:`LaunchOrder` owns only the order and the rounds.
"""
from __future__ import annotations

import weakref
from typing import Callable, List, Optional, Sequence

import torch

from .reduce_pool import ReducePool


class ReduceBucket:
    """One bucket's reduce-scatter.

    Args:
        pool: the shared :class:`ReducePool` (None: a subclass that launches without one).
        numel: padded elements of the bucket.
        shard: this rank's slice of it (``FlatLayout.shard_range``).
        num_members: members it waits for before it may launch.
        on_reduced: ``on_reduced(shard)`` receives the reduced shard (a view into the buffer,
            valid only during the call); it may return a fence that must be waited before the
            buffer is reused (see ``ReducePool``). Subclasses may override :meth:`reduced`.
    """

    def __init__(self, pool: Optional[ReducePool], numel: int, shard: slice, num_members: int,
                 on_reduced: Optional[Callable[[torch.Tensor], object]] = None) -> None:
        self.pool, self.numel, self.shard = pool, numel, shard
        self.num_members = num_members
        self._on_reduced = on_reduced
        self._buf: Optional[torch.Tensor] = None
        self._in: set = set()      # members packed this round
        self.launched = False      # launched this round
        self._order = None         # weakref to the LaunchOrder (set by it)

    @property
    def order(self) -> "LaunchOrder":
        return self._order()

    @property
    def complete(self) -> bool:
        return len(self._in) == self.num_members

    @property
    def filling(self) -> bool:
        """Holds a buffer filled this round and not launched."""
        return self._buf is not None

    def seen(self, member) -> bool:
        """Whether ``member`` already arrived (or the bucket launched) this round: the caller
        must flush the order before adding it again."""
        return self.launched or member in self._in

    def has(self, member) -> bool:
        return member in self._in

    def buffer(self) -> torch.Tensor:
        """This round's zeroed reduce buffer ([numel] view), acquired on first use."""
        if self._buf is None:
            self._buf = self.pool.acquire(self.numel)
        return self._buf

    def mark(self, member) -> None:
        """``member`` is packed (launches nothing)."""
        self._in.add(member)

    def add(self, member) -> None:
        """Mark ``member`` packed and, if that completes the bucket, launch every bucket of the
        order that is now ready."""
        self.mark(member)
        if self.complete:
            self.order.advance()

    def launch(self) -> None:
        """Start the reduce-scatter (no member at all on this rank: it reduces zeros)."""
        buf = self.buffer()
        self._buf, self.launched = None, True
        self.pool.launch(buf, self.shard, self.reduced)

    def reduced(self, shard: torch.Tensor):
        """The reduced shard arrived (see ``on_reduced``); returns its fence, if any."""
        return self._on_reduced(shard)

    def pack_held(self) -> None:
        """Before a flush launches it: pack what the owner still holds (default nothing)."""

    def new_round(self) -> None:
        self._in = set()
        self.launched = False

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
        self.buckets = list(buckets)
        self.pool = pool
        self._next = 0  # first bucket not yet launched this round
        for b in self.buckets:
            b._order = weakref.ref(self)

    @property
    def buffers(self) -> List[torch.Tensor]:
        """The pool's reduce buffers held now (for memory accounting)."""
        return list(self.pool.buffers) if self.pool is not None else []

    def take_peak_bytes(self) -> int:
        """The most reduce-buffer bytes held at once since the last call."""
        return self.pool.take_peak() if self.pool is not None else 0

    def started(self) -> bool:
        """Whether some bucket was filled or launched in this round."""
        return self._next > 0 or any(b.filling for b in self.buckets)

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
        if self.pool is not None:
            self.pool.drain()
        for b in self.buckets:
            b.discard()
        self.new_round()
        if self.pool is not None:
            self.pool.trim()
