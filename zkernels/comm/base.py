"""The communication interface the ZeRO layer talks to, with swappable backends.

Backends: ``zkernels.comm.torch_comm`` (torch.distributed: gloo on CPU, NCCL on GPU) and
``zkernels.comm.nccl`` (the native NCCL engine of ``zkernels._C``, where built). Both move
flat 1-D contiguous buffers laid out by ``zkernels.layout.FlatLayout``.

[Note: comm handles]
Every collective is asynchronous and returns a :class:`Handle`. ``wait()`` makes the result
safe to use on the caller's current stream (on GPU: the current stream waits on the comm
stream's event; on CPU: the call blocks until the collective completes), raising instead of
hanging when a peer does not answer within the backend's timeout. Input and output buffers
must stay alive and untouched until ``wait()`` returns: the backend keeps references to them
so the caching allocator never reuses their memory early (no ``record_stream``).
"""
from __future__ import annotations

from typing import Protocol

import torch


class Handle(Protocol):
    def wait(self) -> None:
        """Block (CPU) or make the current stream wait (GPU) until the collective is done."""


class Comm(Protocol):
    """A process group's collectives over flat buffers."""

    rank: int
    world_size: int

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *,
                       average: bool = False) -> Handle:
        """``output`` (numel = input.numel() / world_size) receives this rank's slice of the
        sum (or mean) of ``input`` over ranks."""

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Handle:
        """``output`` (numel = input.numel() * world_size) receives every rank's ``input``,
        rank r's at ``[r * n, (r + 1) * n)``."""

    def all_reduce(self, tensor: torch.Tensor, *, op: str = "sum") -> Handle:
        """In place sum (``op="sum"``) or max (``op="max"``) over ranks; used for the global
        grad norm and the found-inf flag (tiny tensors)."""
