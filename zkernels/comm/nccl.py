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

from typing import Optional

import torch
import torch.distributed as dist

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
    host; ``synchronize()`` blocks until it is done (raising on failure or timeout)."""

    def __init__(self, work, device: torch.device, *buffers: torch.Tensor):
        self._work = work
        self._device = device
        self._buffers = buffers

    def wait(self) -> None:
        if self._work is None:
            return
        self._work.wait(torch.cuda.current_stream(self._device).cuda_stream)
        self._work, self._buffers = None, ()

    def synchronize(self) -> None:
        if self._work is None:
            return
        self._work.synchronize()
        self._work, self._buffers = None, ()

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
        box = [_C_nccl.unique_id() if self.rank == 0 else None]
        root = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        dist.broadcast_object_list(box, src=root, group=process_group)
        self._engine = _C_nccl.Engine(box[0], self.rank, self.world_size, dev.index,
                                      float(timeout_s))

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *,
                       average: bool = False) -> NcclHandle:
        """``output`` (n) gets this rank's slice of the sum (or mean) over ranks of ``input``
        (n * world_size); same dtype (fp32/bf16/fp16), contiguous, on ``self.device``."""
        work = self._engine.reduce_scatter(output, input, "avg" if average else "sum",
                                           self._stream())
        return NcclHandle(work, self.device, output, input)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> NcclHandle:
        """``output`` (n * world_size) gets every rank's ``input`` (n), rank r's at
        ``[r * n, (r + 1) * n)``."""
        work = self._engine.all_gather(output, input, self._stream())
        return NcclHandle(work, self.device, output, input)

    def all_reduce(self, tensor: torch.Tensor, *, op: str = "sum") -> NcclHandle:
        """In place ``op`` ("sum" or "max") over ranks."""
        if op not in _OPS:
            raise ValueError(f"op must be one of {tuple(_OPS)}, got {op!r}")
        work = self._engine.all_reduce(tensor, _OPS[op], self._stream())
        return NcclHandle(work, self.device, tensor)

    def abort(self, reason: str = "requested") -> None:
        """Abort the communicator now; later calls raise."""
        self._engine.abort(reason)
