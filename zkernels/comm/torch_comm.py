"""The torch.distributed backend of :class:`zkernels.comm.base.Comm`: gloo on CPU, NCCL on GPU.

[Note: comm stream]
On CUDA every collective is issued on one side stream that this object owns (FSDP2's
pattern): the side stream first waits for the caller's current stream (the producer of the
input), runs the collective, and records an event; ``Handle.wait()`` makes the caller's
current stream wait for that event. The handle keeps the input and output tensors alive until
``wait()``: their memory belongs to the caller's stream in the caching allocator, and the
caller's stream is ordered after the collective once it has waited, so the memory cannot be
reused early, with no ``record_stream``. On CPU (gloo) collectives are ``async_op=True`` works
and ``wait()`` blocks.

A dead or silent peer makes ``wait()`` raise within the process group's timeout (gloo: the
transport reports a reset connection at once, or the op times out; NCCL: the watchdog aborts
the communicator), never hang.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .base import Handle


def _pick(*names: str) -> Callable:
    """The first collective of ``names`` that this torch has: the ``*_single`` names of
    torch >= 2.13 (whose older names warn), else the ``*_tensor`` names of older torch."""
    for name in names:
        fn = getattr(dist, name, None)
        if fn is not None:
            return fn
    raise RuntimeError(f"torch.distributed has none of {names}")


class _Work:
    """Handle of one collective (see [Note: comm stream])."""

    def __init__(self, work, event, device: torch.device, keep: Sequence[torch.Tensor],
                 after: Optional[Callable[[], None]] = None) -> None:
        self._work, self._event, self._device = work, event, device
        self._keep, self._after = keep, after

    def wait(self) -> None:
        if self._keep is None:
            return
        if self._work is not None:
            self._work.wait()
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
        if self._after is not None:
            self._after()
        self._keep = None


class TorchComm:
    """Collectives of one process group over flat 1-D buffers.

    Args:
        process_group: the group (None: the default world group, which must be initialized).
        device: where the buffers live; CUDA devices get a side stream for collectives.
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device] = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("TorchComm needs an initialized torch.distributed process group "
                               "(dist.init_process_group)")
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        backend = str(dist.get_backend(process_group)).lower()
        # gloo lacks ReduceOp.AVG on some versions and dtypes: average there as SUM + scale.
        self._native_avg = "nccl" in backend
        self._reduce_scatter = _pick("reduce_scatter_single", "reduce_scatter_tensor")
        self._all_gather = _pick("all_gather_single", "all_gather_into_tensor")
        self._stream = (torch.cuda.Stream(device=self.device)
                        if self.device.type == "cuda" else None)

    def _launch(self, run: Callable[[bool], object], keep: Sequence[torch.Tensor],
                after: Optional[Callable[[], None]] = None) -> Handle:
        if self._stream is None:
            return _Work(run(True), None, self.device, keep, after)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            run(False)  # ordered on the side stream; the CPU does not block on NCCL
            event = torch.cuda.Event()
            event.record(self._stream)
        return _Work(None, event, self.device, keep, after)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *,
                       average: bool = False) -> Handle:
        _check(output, input, self.world_size, "reduce_scatter", "output", "input")
        op = dist.ReduceOp.SUM
        after = None
        if average and self._native_avg:
            op = dist.ReduceOp.AVG
        elif average and self.world_size > 1:
            inv = 1.0 / self.world_size
            after = lambda: output.mul_(inv)  # noqa: E731 - runs on the waiter's stream
        return self._launch(lambda async_op: self._reduce_scatter(
            output, input, op=op, group=self.group, async_op=async_op), (output, input), after)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Handle:
        _check(input, output, self.world_size, "all_gather", "input", "output")
        return self._launch(lambda async_op: self._all_gather(
            output, input, group=self.group, async_op=async_op), (output, input))

    def all_reduce(self, tensor: torch.Tensor, *, op: str = "sum") -> Handle:
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
        if op not in ops:
            raise ValueError(f"op must be one of {tuple(ops)}, got {op!r}")
        return self._launch(lambda async_op: dist.all_reduce(
            tensor, op=ops[op], group=self.group, async_op=async_op), (tensor,))


def _check(shard: torch.Tensor, full: torch.Tensor, world_size: int, what: str,
           shard_name: str, full_name: str) -> None:
    for name, t in ((shard_name, shard), (full_name, full)):
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{what}: {name} must be a contiguous 1-D tensor, got shape "
                             f"{tuple(t.shape)}")
    if full.numel() != shard.numel() * world_size:
        raise ValueError(f"{what}: {full_name} must have {world_size} x {shard_name}.numel() "
                         f"= {shard.numel() * world_size} elements, got {full.numel()}")
    if shard.dtype != full.dtype:
        raise TypeError(f"{what}: {shard_name} is {shard.dtype} but {full_name} is {full.dtype}")
