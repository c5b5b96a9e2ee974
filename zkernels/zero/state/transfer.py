"""Host<->device copies off the compute stream: one object owns the copy stream (GPU) or the
copy thread (CPU), and every copy returns a :class:`Fence`.

[Note: offload copies]
Offload moves gradient shards to the host during backward and updated parameters back during
the step; neither may stall the compute. On CUDA, a :class:`Copier` issues every copy on its
own side stream, after an event recorded on the caller's current stream (so the copy reads
what the producer wrote), with ``non_blocking=True`` from or into pinned host buffers; the
returned fence holds both tensors until it is synchronized (no ``record_stream``: the
caller keeps the fence until the source may be reused, the deterministic lifetime FSDP2 uses).
On a CPU-only machine the "device" is the host itself, so the same calls run ``copy_`` on one
worker thread (copies stay in issue order, as on a stream; torch releases the GIL inside
``copy_``), which is what lets the tests here run the code path the GPU runs.

A fence answers two questions: ``wait()`` orders the caller's *current stream* after the copy
(GPU: an event wait, the host does not block; CPU: it blocks, there is no stream), for a
device consumer such as the all-gather of updated parameters; ``synchronize()`` blocks the
host until the copy is done, for a host consumer such as the CPU AdamW reading a gradient
shard, or before a host staging buffer is overwritten.
"""
from __future__ import annotations

import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import List, Optional, Tuple

import torch


class PinMemoryIgnored(UserWarning):
    """``pin_memory=True`` where no GPU is present: host memory stays pageable."""


PIN_MEMORY_IGNORED = ("OffloadConfig.pin_memory=True (DeepSpeed's offload pin_memory: true) "
                      "but no GPU is present: the offloaded host memory is not pinned "
                      "(page-locked memory is the CUDA driver's; DeepSpeed ignores the hint "
                      "the same way)")


def resolve_pin_memory(pin_memory: Optional[bool], device: torch.device) -> bool:
    """Whether host buffers are pinned: None -> when a GPU is present.

    [Note: pinning is a hint]
    ``pin_memory=True`` where no GPU is present warns (:class:`PinMemoryIgnored`) and pins
    nothing, as DeepSpeed does (its CPU accelerator's ``pin_memory`` returns the tensor as it
    is): transformers' own ZeRO-2/3 example configs say ``"pin_memory": true``, and a config
    that trains on a GPU host must train on a CPU-only one too. ``Tensor.pin_memory()`` fails
    on CPU-only torch, so nothing pins then. Called once per optimizer (its :class:`Copier`);
    the warning's text and category are fixed and it is raised from this one line, so
    Python's default filter shows it once per process, with no state kept here.
    """
    gpu = torch.cuda.is_available()
    if pin_memory is None:
        return gpu and device.type == "cuda"
    if pin_memory and not gpu:
        warnings.warn(PIN_MEMORY_IGNORED, PinMemoryIgnored)
        return False
    return bool(pin_memory)


class Fence:
    """The completion of one copy (see [Note: offload copies])."""

    def __init__(self, *, event=None, start=None, device=None,
                 future: Optional[Future] = None, keep=()) -> None:
        self._event, self._start, self._future, self._keep = event, start, future, keep
        self._device = device
        self._done = event is None and future is None

    def wait(self) -> None:
        """The caller's current stream (GPU) or the caller (CPU) is ordered after the copy."""
        if self._done:
            return
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
        else:
            self.synchronize()

    def synchronize(self) -> None:
        """Block the host until the copy is done (re-raises a failed copy's error)."""
        if self._done:
            return
        if self._event is not None:
            self._event.synchronize()
        else:
            self._future.result()
        self._done = True
        self._keep = ()

    def busy_s(self) -> float:
        """Seconds the copy engine spent on this copy (after :meth:`synchronize`)."""
        if self._event is not None:
            return self._start.elapsed_time(self._event) / 1e3
        if self._future is not None:
            return self._future.result()
        return 0.0


class Copier:
    """Owner of the copy stream (CUDA) or copy thread (CPU) of one device.

    Args:
        device: the compute device (``torch.device``).
        pin_memory: host buffers pinned (see :func:`resolve_pin_memory`).

    Attributes:
        pinned: whether :meth:`host_empty` pins.
        bytes_to_host, bytes_to_device: bytes copied since :meth:`take_counters`.
    """

    def __init__(self, device: torch.device, pin_memory: Optional[bool]) -> None:
        self.device = torch.device(device)
        self.pinned = resolve_pin_memory(pin_memory, self.device)
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=self.device) if self._cuda else None
        self._pool = None if self._cuda else ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="zk-offload-copy")
        self._issued: List[Tuple[str, Fence]] = []
        self._registered: List[torch.Tensor] = []
        self.on_close: List = []   # callables that finish copies the caller tracks itself
        self._closed = False
        self.bytes_to_host = 0
        self.bytes_to_device = 0

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """[numel] host buffer (pinned when :attr:`pinned`: see [Note: exact pinned sizes])."""
        t = torch.empty(numel, dtype=dtype, device="cpu")
        if self.pinned:
            self.pin(t)
        return t

    def pin(self, t: torch.Tensor) -> None:
        """Page-lock ``t``'s memory in place (unlocked at :meth:`close`).

        [Note: exact pinned sizes]
        ``torch.empty(..., pin_memory=True)`` goes through the CUDA caching host allocator,
        which rounds every request up to a power of two: a 12 GiB state would lock up to
        16 GiB, and the NVMe budget would not be a budget. So offload allocates ordinary host
        memory and registers exactly its bytes with ``cudaHostRegister`` (what DeepSpeed's
        pinned swap buffers amount to); a host that refuses (a capped ``ulimit -l``) gets an
        error saying to pass ``pin_memory=False``, not a silent fall back to pageable copies.
        """
        if not self.pinned or t.numel() == 0:
            return
        rt = torch.cuda.cudart()
        err = rt.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {t.numel() * t.element_size()} bytes "
                               f"failed (error {int(err)}): pass OffloadConfig("
                               f"pin_memory=False) on hosts that cap page-locked memory")
        self._registered.append(t)

    def unpin(self, t: torch.Tensor) -> None:
        """Unlock a buffer :meth:`pin` locked (before it is dropped); others: nothing."""
        for i, r in enumerate(self._registered):
            if r.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
                torch.cuda.cudart().cudaHostUnregister(r.data_ptr())
                del self._registered[i]
                return

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Fence:
        """Copy device ``src`` into host ``dst`` (dtype cast allowed) off the compute stream."""
        self.bytes_to_host += src.numel() * src.element_size()
        return self._copy(dst, src, "to_host")

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> Fence:
        """Copy host ``src`` into device ``dst`` off the compute stream."""
        self.bytes_to_device += src.numel() * src.element_size()
        return self._copy(dst, src, "to_device")

    @property
    def stream(self):
        """The CUDA copy stream (None on a CPU-only device: copies run on the copy thread)."""
        return self._stream

    def copy_untracked(self, dst: torch.Tensor, src: torch.Tensor) -> Fence:
        """Copy ``src`` into ``dst`` off the compute stream, outside :meth:`take_counters`:
        the caller keeps the fence and counts the bytes (stage 3's parameter shards come in
        during forward and backward, between steps: ``param_offload.HostStorage``)."""
        return self._copy(dst, src, None)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, direction: Optional[str]) -> Fence:
        if self._closed:
            raise RuntimeError("this ZeroOptimizer was closed (close()): its offloaded state "
                               "is gone, build a new optimizer to train on")
        if self._cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(ready)
                start.record(self._stream)
                dst.copy_(src, non_blocking=True)
                end.record(self._stream)
            fence = Fence(event=end, start=start, device=self.device, keep=(dst, src))
        else:
            fence = Fence(future=self._pool.submit(_timed_copy, dst, src))
        if direction is not None:
            self._issued.append((direction, fence))
        return fence

    def take_counters(self) -> dict:
        """Synchronize every copy issued since the last call; return and reset
        ``{"to_host_bytes", "to_device_bytes", "to_host_busy_s", "to_device_busy_s"}`` (busy:
        seconds the copy stream or thread spent copying)."""
        busy = {"to_host": 0.0, "to_device": 0.0}
        for direction, f in self._issued:
            f.synchronize()
            busy[direction] += f.busy_s()
        out = {"to_host_bytes": self.bytes_to_host, "to_device_bytes": self.bytes_to_device,
               "to_host_busy_s": busy["to_host"], "to_device_busy_s": busy["to_device"]}
        self._issued, self.bytes_to_host, self.bytes_to_device = [], 0, 0
        return out

    def close(self) -> None:
        """Finish every copy and stop the copy thread."""
        self._closed = True
        for finish in self.on_close:
            try:
                finish()
            except Exception:  # noqa: BLE001 - closing: the copy's error was reported already
                pass
        for _, f in self._issued:
            try:
                f.synchronize()
            except Exception:  # noqa: BLE001 - closing: the copy's error was reported already
                pass
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._registered:
            rt = torch.cuda.cudart()
            for t in self._registered:
                rt.cudaHostUnregister(t.data_ptr())
            self._registered = []


def _timed_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
    t0 = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t0
