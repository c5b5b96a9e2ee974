"""The native NCCL engine (``zkernels._C_nccl``) as a :class:`zkernels.comm.base.Comm` backend.

The engine owns its communicator and one comm stream (see [Note: engine streams and events]
in csrc/nccl/engine.h): a collective starts on that stream once the caller's current stream
has written the inputs, and ``Handle.wait()`` makes the then-current stream wait for it.
The communicator is bootstrapped through an existing torch ProcessGroup: rank 0 makes the
NCCL unique id and broadcasts it as bytes; everything else is the engine's own.

Importing this module never fails; constructing :class:`NcclComm` raises a clear error
where the extension was built without CUDA/NCCL.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from .base import collective_error, describe

try:
    from .. import _C_nccl
except ImportError as _exc:  # CPU-only build, or libnccl.so.2 not loadable here
    _C_nccl = None
    IMPORT_ERROR: Optional[ImportError] = _exc
else:
    IMPORT_ERROR = None

AVAILABLE = _C_nccl is not None
_OPS = {"sum": "sum", "max": "max"}


class NcclHandle:
    """A launched collective; holds its buffers until :meth:`wait` (see [Note: comm handles]).

    ``wait()`` orders the caller's current stream after the collective without blocking the
    host; ``synchronize()`` blocks until it is done (raising on failure or timeout). Engine
    errors are raised as :class:`zkernels.comm.CollectiveError` naming the collective (see
    [Note: collective errors] in base.py)."""

    def __init__(self, work, device: torch.device, *buffers: torch.Tensor,
                 fail: Optional[Callable[[BaseException], Exception]] = None):
        self._work = work
        self._device = device
        self._buffers = buffers
        self._fail = fail

    def _finish(self, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - the engine's errors, named
            self._work, self._buffers = None, ()
            if self._fail is None:
                raise
            raise self._fail(exc) from exc
        self._work, self._buffers = None, ()

    def wait(self) -> None:
        if self._work is None:
            return
        work = self._work
        self._finish(lambda: work.wait(torch.cuda.current_stream(self._device).cuda_stream))

    def synchronize(self) -> None:
        if self._work is None:
            return
        self._finish(self._work.synchronize)

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


class NcclComm:
    """Collectives over flat CUDA buffers on the native engine.

    Args:
        process_group: torch ProcessGroup used once, to send rank 0's NCCL unique id to the
            others (any backend that can broadcast objects: gloo or NCCL). Default: world.
        device: this rank's CUDA device (default: the current one).
        timeout_s: a collective (or the communicator's creation) not done within this many
            seconds aborts the communicator and raises instead of hanging.
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, *,
                 device: Optional[torch.device] = None, timeout_s: float = 300.0):
        if _C_nccl is None:
            raise RuntimeError(
                "zkernels.comm.nccl needs zkernels._C_nccl, which is not built or cannot load "
                f"here ({IMPORT_ERROR}); build with ZKERNELS_CUDA=1 on a machine with nvcc and "
                "NCCL (pip install nvidia-nccl-cu13), or use zkernels.comm.torch_comm")
        if not dist.is_initialized():
            raise RuntimeError("NcclComm needs torch.distributed initialized (its process "
                               "group carries the NCCL unique id)")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None \
            else torch.device(device)
        if dev.type != "cuda" or dev.index is None:
            raise ValueError(f"device must be a CUDA device with an index, got {dev}")
        self.device = dev
        self.timeout_s = float(timeout_s)
        box = [_C_nccl.unique_id() if self.rank == 0 else None]
        root = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        dist.broadcast_object_list(box, src=root, group=process_group)
        self._engine = _C_nccl.Engine(box[0], self.rank, self.world_size, dev.index,
                                      float(timeout_s))

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def _fail(self, what: str, full: torch.Tensor, tag: Optional[str]):
        nbytes = full.numel() * full.element_size()
        return lambda exc: collective_error(
            describe(what, nbytes, full.dtype, self.rank, self.world_size, tag), what, nbytes,
            tag, self.timeout_s, exc)

    def _start(self, what: str, full: torch.Tensor, tag: Optional[str],
               launch: Callable[[], object], *buffers: torch.Tensor) -> NcclHandle:
        fail = self._fail(what, full, tag)
        try:
            work = launch()
        except RuntimeError as exc:  # an aborted communicator refuses new work
            raise fail(exc) from exc
        return NcclHandle(work, self.device, *buffers, fail=fail)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *,
                       average: bool = False, tag: Optional[str] = None) -> NcclHandle:
        """``output`` (n) gets this rank's slice of the sum (or mean) over ranks of ``input``
        (n * world_size); same dtype (fp32/bf16/fp16), contiguous, on ``self.device``."""
        return self._start("reduce_scatter", input, tag, lambda: self._engine.reduce_scatter(
            output, input, "avg" if average else "sum", self._stream()), output, input)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *,
                   tag: Optional[str] = None) -> NcclHandle:
        """``output`` (n * world_size) gets every rank's ``input`` (n), rank r's at
        ``[r * n, (r + 1) * n)``."""
        return self._start("all_gather", output, tag, lambda: self._engine.all_gather(
            output, input, self._stream()), output, input)

    def all_reduce(self, tensor: torch.Tensor, *, op: str = "sum",
                   tag: Optional[str] = None) -> NcclHandle:
        """In place ``op`` ("sum" or "max") over ranks."""
        if op not in _OPS:
            raise ValueError(f"op must be one of {tuple(_OPS)}, got {op!r}")
        return self._start("all_reduce", tensor, tag, lambda: self._engine.all_reduce(
            tensor, _OPS[op], self._stream()), tensor)

    def abort(self, reason: str = "requested") -> None:
        """Abort the communicator now; later calls raise."""
        self._engine.abort(reason)
