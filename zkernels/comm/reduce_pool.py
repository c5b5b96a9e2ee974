"""A small pool of reusable reduce buffers with a bounded number of reductions in flight."""
from __future__ import annotations

from collections import deque
from typing import Callable, Deque, Dict, List, Tuple

import torch

from .base import Comm, Handle


class ReducePool:
    """Bucket-sized buffers for reduce-scatters, reused round robin, shared by the buckets of
    one launch order (``bucketed.ReduceBucket``: a bucket acquires its buffer at its first
    member and launches it; the pool gives it back once that reduction is retired).

    ``acquire`` hands out a zeroed buffer (zero padding and gaps: they must add nothing to the
    sum); ``launch`` starts an in-place reduce-scatter of it (this rank's shard is the output,
    a slice of the input, which NCCL and gloo both support) and queues ``on_done``; when all
    buffers are busy, ``acquire`` first retires the oldest reduction (waits, hands the reduced
    shard to its ``on_done``, frees the buffer). So at most ``num_buffers`` reductions are in
    flight and memory stays at ``num_buffers`` buckets whatever the model size.

    ``on_done`` may return a fence (an object with ``wait()``, e.g. an offload copy still
    reading the shard out of the buffer): the buffer is handed out again only after that
    fence's ``wait()``, which orders the new user (the caller's stream, or the caller on CPU)
    after the reader (see [Note: offload copies] in ``zkernels/zero/state/transfer.py``).

    [Note: transient reduce buffers]
    With ``transient=True`` (stage 3, whose formula must hold between steps as FSDP2's does)
    the pool holds no buffer until the first ``acquire`` of a round, allocates up to
    ``num_buffers`` as they are needed, and gives every buffer back in :meth:`trim` once no
    reduction is in flight and no bucket is filling one (the end of each backward at stage 3,
    see [Note: reduce buffers end with backward] in ``zkernels/zero/gradients/grad_reducers.py``;
    ``step()``'s drain; a discarded round): a unit's buffer lives only while its gradients are
    in flight, and the peak is the persistent pool's (the same ``num_buffers`` at most). Readers' fences are waited first,
    so no copy still reading a buffer (an offload copy) sees its memory reused.
    ``peak_bytes`` is the most buffer bytes held at once since :meth:`take_peak`.

    Args:
        comm: the collectives.
        numel: elements per buffer (the largest bucket).
        dtype: the reduce dtype.
        device: where buffers live.
        num_buffers: buffers in the pool (>= 1).
        transient: allocate buffers per round and release them when idle (see above); False:
            allocate them here and keep them.
    """

    def __init__(self, comm: Comm, numel: int, dtype: torch.dtype, device: torch.device,
                 num_buffers: int, transient: bool = False) -> None:
        if num_buffers < 1:
            raise ValueError(f"num_buffers must be >= 1, got {num_buffers}")
        self._comm = comm
        self._numel, self._dtype, self._device = numel, dtype, device
        self._num_buffers = num_buffers
        self.transient = bool(transient)
        self.buffers: List[torch.Tensor] = [] if self.transient else \
            [torch.zeros(numel, dtype=dtype, device=device) for _ in range(num_buffers)]
        self._free: List[torch.Tensor] = list(self.buffers)
        self._fences: Dict[int, object] = {}  # data_ptr of a free buffer -> its reader's fence
        self._in_flight: Deque[Tuple[torch.Tensor, torch.Tensor, Handle,
                                     Callable[[torch.Tensor], None]]] = deque()
        self.peak_bytes = self.held_bytes()

    def held_bytes(self) -> int:
        """Bytes of the buffers allocated now."""
        return sum(b.untyped_storage().nbytes() for b in self.buffers)

    def take_peak(self) -> int:
        """The most buffer bytes held at once since the last call (then reset to now)."""
        peak, self.peak_bytes = self.peak_bytes, self.held_bytes()
        return peak

    def _grow(self) -> None:
        self.buffers.append(torch.empty(self._numel, dtype=self._dtype, device=self._device))
        self._free.append(self.buffers[-1])
        self.peak_bytes = max(self.peak_bytes, self.held_bytes())

    def acquire(self, numel: int) -> torch.Tensor:
        """A zeroed 1-D view of ``numel`` elements of a free buffer."""
        if not self._free:
            if len(self.buffers) < self._num_buffers:
                self._grow()  # transient: the round's next buffer
            elif self._in_flight:
                self._retire_oldest()
            else:
                # Every buffer holds a filled bucket waiting for an earlier one to be ready
                # (gradients arrived out of bucket order): grow rather than deadlock.
                self._grow()
        base = self._free.pop()
        fence = self._fences.pop(base.data_ptr(), None)
        if fence is not None:
            fence.wait()
        view = base[:numel]
        view.zero_()
        return view

    def release(self, view: torch.Tensor) -> None:
        """Return a buffer that was acquired but will not be launched."""
        self._free.append(self._base(view))

    def launch(self, view: torch.Tensor, shard: slice,
               on_done: Callable[[torch.Tensor], None]) -> None:
        """Start the reduce-scatter of ``view`` (an acquired buffer); ``on_done`` receives this
        rank's reduced shard (a view into the buffer, valid only during the call, or until
        the fence ``on_done`` returns is waited)."""
        out = view[shard]
        handle = self._comm.reduce_scatter(out, view)
        self._in_flight.append((self._base(view), out, handle, on_done))

    def drain(self) -> None:
        """Finish every reduction in flight."""
        while self._in_flight:
            self._retire_oldest()

    def trim(self) -> None:
        """Transient pool: give every buffer back if none is in flight or filling (see
        [Note: transient reduce buffers]); a persistent pool keeps its buffers."""
        if not self.transient or self._in_flight or len(self._free) != len(self.buffers):
            return
        for fence in self._fences.values():
            fence.wait()
        self._fences.clear()
        self.buffers, self._free = [], []

    def _retire_oldest(self) -> None:
        base, out, handle, on_done = self._in_flight.popleft()
        handle.wait()
        fence = on_done(out)
        if fence is not None:
            self._fences[base.data_ptr()] = fence
        self._free.append(base)

    def _base(self, view: torch.Tensor) -> torch.Tensor:
        for b in self.buffers:
            if b.data_ptr() == view.data_ptr():
                return b
        raise ValueError("view does not start a buffer of this pool")
