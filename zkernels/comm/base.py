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

[Note: collective errors]
A collective that fails (a peer died: its connection resets at once) or does not complete
within the timeout (a peer is stuck, or raised before reaching the collective and lives on)
raises :class:`CollectiveError` from ``wait()`` (or from the launch, when the backend already
knows), whatever the backend's own exception: the message names the collective, its bytes,
this rank, the caller's ``tag`` (e.g. the stage-3 unit being gathered) and the timeout, so a
user reading one rank's log knows where it stopped and that the cause is on another rank; the
backend's exception is the ``__cause__``. The timeout is the process group's
(``init_process_group(timeout=...)``) unless the comm was made with its own
(``make_comm(timeout=...)``, ``ZeroOptimizer(timeout=...)``), which then bounds every
collective it issues.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Optional, Protocol, Union

import torch


class CollectiveError(RuntimeError):
    """A collective failed or timed out (see [Note: collective errors]).

    Attributes:
        collective: ``"reduce_scatter"``, ``"all_gather"``, ``"all_reduce"`` or
            ``"all_to_all"``.
        nbytes: bytes of the full buffer (the reduce-scatter's input, the all-gather's output,
            the all-reduce's tensor).
        tag: what the caller was doing (e.g. ``"unit blocks.1 forward"``), or None.
    """

    def __init__(self, message: str, *, collective: str, nbytes: int,
                 tag: Optional[str] = None) -> None:
        super().__init__(message)
        self.collective, self.nbytes, self.tag = collective, nbytes, tag


def describe(collective: str, nbytes: int, dtype: torch.dtype, rank: int, world_size: int,
             tag: Optional[str]) -> str:
    """``"all_gather of 4096 bytes (torch.float32) on rank 0 of 2 [unit blocks.1]"``."""
    where = f" [{tag}]" if tag else ""
    return f"{collective} of {nbytes} bytes ({dtype}) on rank {rank} of {world_size}{where}"


def collective_error(what: str, collective: str, nbytes: int, tag: Optional[str],
                     timeout_s: Optional[float], cause: BaseException) -> CollectiveError:
    """The :class:`CollectiveError` for ``cause`` raised while running ``what``."""
    bound = (f"timeout {timeout_s:g}s (ZeroOptimizer(timeout=...))" if timeout_s is not None
             else "the process group's timeout (init_process_group(timeout=...))")
    return CollectiveError(
        f"{what} failed or did not complete within {bound}: another rank died, raised before "
        f"reaching this collective, or is stuck; look at its log. Backend error: {cause}",
        collective=collective, nbytes=nbytes, tag=tag)


def timeout_seconds(timeout: Union[None, float, int, timedelta]) -> Optional[float]:
    """``timeout`` (None, a ``datetime.timedelta`` or seconds) as seconds > 0, or None."""
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"timeout must be None, a datetime.timedelta or a number of seconds, "
                        f"got {type(timeout).__name__}")
    if not seconds > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    return seconds


class Handle(Protocol):
    def wait(self) -> None:
        """Block (CPU) or make the current stream wait (GPU) until the collective is done."""


class Comm(Protocol):
    """A process group's collectives over flat buffers."""

    rank: int
    world_size: int

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *,
                       average: bool = False, tag: Optional[str] = None) -> Handle:
        """``output`` (numel = input.numel() / world_size) receives this rank's slice of the
        sum (or mean) of ``input`` over ranks. ``tag`` names the caller's work in errors."""

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *,
                   tag: Optional[str] = None) -> Handle:
        """``output`` (numel = input.numel() * world_size) receives every rank's ``input``,
        rank r's at ``[r * n, (r + 1) * n)``."""

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *,
                   tag: Optional[str] = None) -> Handle:
        """``input`` and ``output`` (same numel and dtype) in N equal chunks: rank r's chunk q
        lands in rank q's ``output`` at chunk r (``all_to_all_single``). Optional: the quantized
        reduce-scatter (``quantized.py``) needs it; torch_comm, local and the meter have it."""

    def all_reduce(self, tensor: torch.Tensor, *, op: str = "sum",
                   tag: Optional[str] = None) -> Handle:
        """In place sum (``op="sum"``) or max (``op="max"``) over ranks; used for the global
        grad norm and the found-inf flag (tiny tensors)."""
