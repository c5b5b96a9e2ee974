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

[Note: timeouts on torch.distributed]
A dead or silent peer makes ``wait()`` raise :class:`CollectiveError` (see [Note: collective
errors] in base.py), never hang. gloo reports a peer killed mid-collective at once (its TCP
connection resets) and a stuck peer when the op's timeout expires: by default the process
group's, or this comm's own ``timeout``. gloo's ``Work.wait(timeout)`` does not bound the wait
(measured on torch 2.13: it returned after the group's timeout, not the one given), so the own
timeout goes where gloo reads it, the collective's options (``opts.timeout``), which the public
``dist.*`` functions do not expose: with a timeout, CPU collectives are issued through the
group's own methods (``ProcessGroup.reduce_scatter_single`` or, on torch < 2.13,
``_reduce_scatter_base``; the same for all-gather; ``allreduce``), exactly what the public
functions call. On CUDA the NCCL watchdog enforces the process group's timeout (the CPU does
not block on NCCL here, so there is no wait to bound): set it with
``init_process_group(timeout=...)``.

[Note: reduce-scatter over gloo]
gloo's reduce-scatter (``reduce_scatter_single``) is slow on CPU: measured on the 2-core dev
machine at 2 ranks, a 0.5 MiB fp32 bucket took ~0.7-1.1 ms, an all-reduce of the same bucket
~0.5-0.9 ms and an ``all_to_all_single`` of it ~0.3-0.5 ms (a 3.3 MiB one: ~5-8, ~3 and
~1.4 ms). So on gloo a reduce-scatter is an all-to-all followed by a local sum: rank r
receives chunk r of every rank's input (rank order) into a receive buffer the size of the
input, then adds them, in rank order, into the output (which may be rank r's chunk of the
input itself). Each rank sends exactly what a ring reduce-scatter sends, (N-1)/N of the input
(the meter's convention), and the sum is the same: for two ranks ``a + b`` is exactly what
gloo computes; for more ranks the order is rank order where gloo's ring order depends on the
rank (within round-off). The receive buffer is transient (allocated at launch, freed at
``wait()``), like the scratch buffers gloo's own collectives allocate; the CPU work is the
sum, (N-1)/N of the input's elements. NCCL keeps its native reduce-scatter.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .base import Handle, collective_error, describe, timeout_seconds


def _pick(*names: str) -> Callable:
    """The first collective of ``names`` that this torch has: the ``*_single`` names of
    torch >= 2.13 (whose older names warn), else the ``*_tensor`` names of older torch."""
    for name in names:
        fn = getattr(dist, name, None)
        if fn is not None:
            return fn
    raise RuntimeError(f"torch.distributed has none of {names}")


class _Work:
    """Handle of one collective (see [Note: comm stream]); a failure raises ``fail(exc)``."""

    def __init__(self, work, event, device: torch.device, keep: Sequence[torch.Tensor],
                 after: Optional[Callable[[], None]],
                 fail: Callable[[BaseException], Exception]) -> None:
        self._work, self._event, self._device = work, event, device
        self._keep, self._after, self._fail = keep, after, fail

    def done(self) -> bool:
        """Whether the collective is complete, without blocking (``wait()`` still finishes
        it: the gloo reduce-scatter's sum runs there). Hybrid sharding asks, to start the
        cross-group all-reduce early (see ``zkernels/comm/hybrid.py``)."""
        if self._keep is None:
            return True
        if self._work is not None:
            return self._work.is_completed()
        return self._event is None or self._event.query()

    def wait(self) -> None:
        if self._keep is None:
            return
        if self._work is not None:
            try:
                self._work.wait()
            except Exception as exc:  # noqa: BLE001 - every backend error, named
                self._keep = None
                raise self._fail(exc) from exc
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
        if self._after is not None:
            self._after()
        self._keep = None


def _raw_ops(group: dist.ProcessGroup, timeout_s: float):
    """reduce_scatter(output, input, op), all_gather(output, input), all_reduce(tensor, op)
    on ``group`` with ``opts.timeout`` (see [Note: timeouts on torch.distributed])."""
    from torch._C._distributed_c10d import (AllgatherOptions, AllreduceOptions,
                                            AllToAllOptions, ReduceScatterOptions)
    limit = timedelta(seconds=timeout_s)
    rs = getattr(group, "reduce_scatter_single", None) or group._reduce_scatter_base
    ag = getattr(group, "all_gather_single", None) or group._allgather_base

    def opts(cls, op=None):
        o = cls()
        o.timeout = limit
        if op is not None:
            o.reduceOp = op
        return o

    return (lambda out, inp, op: rs(out, inp, opts(ReduceScatterOptions, op)),
            lambda out, inp: ag(out, inp, opts(AllgatherOptions)),
            lambda t, op: group.allreduce([t], opts(AllreduceOptions, op)),
            lambda out, inp: group.alltoall_base(out, inp, [], [], opts(AllToAllOptions)))


class TorchComm:
    """Collectives of one process group over flat 1-D buffers.

    Args:
        process_group: the group (None: the default world group, which must be initialized).
        device: where the buffers live; CUDA devices get a side stream for collectives.
        timeout: None (the process group's timeout), or a ``datetime.timedelta`` or seconds
            that bounds every CPU collective (see [Note: timeouts on torch.distributed]).
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device] = None, timeout=None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("TorchComm needs an initialized torch.distributed process group "
                               "(dist.init_process_group)")
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.timeout_s = timeout_seconds(timeout)
        backend = str(dist.get_backend(process_group)).lower()
        # gloo lacks ReduceOp.AVG on some versions and dtypes: average there as SUM + scale.
        self._native_avg = "nccl" in backend
        self._stream = (torch.cuda.Stream(device=self.device)
                        if self.device.type == "cuda" else None)
        if self.timeout_s is not None and self._stream is None:
            group = process_group if process_group is not None else dist.group.WORLD
            self._reduce_scatter, self._all_gather, self._all_reduce, self._all_to_all = \
                _raw_ops(group, self.timeout_s)
        else:
            rs = _pick("reduce_scatter_single", "reduce_scatter_tensor")
            ag = _pick("all_gather_single", "all_gather_into_tensor")
            g = self.group
            self._reduce_scatter = lambda out, inp, op, a=True: rs(out, inp, op=op, group=g,
                                                                  async_op=a)
            self._all_gather = lambda out, inp, a=True: ag(out, inp, group=g, async_op=a)
            self._all_reduce = lambda t, op, a=True: dist.all_reduce(t, op=op, group=g,
                                                                    async_op=a)
            self._all_to_all = lambda out, inp, a=True: dist.all_to_all_single(
                out, inp, group=g, async_op=a)
        # See [Note: reduce-scatter over gloo].
        self._exchange_reduce_scatter = ("gloo" in backend and self._stream is None
                                         and self.world_size > 1)

    def _launch(self, run: Callable[..., object], keep: Sequence[torch.Tensor], what: str,
                tag: Optional[str], after: Optional[Callable[[], None]] = None) -> Handle:
        full = keep[-1]  # the full buffer, whose bytes the meter counts too
        nbytes = full.numel() * full.element_size()

        def fail(exc: BaseException) -> Exception:
            return collective_error(describe(what, nbytes, full.dtype, self.rank,
                                             self.world_size, tag),
                                    what, nbytes, tag, self.timeout_s, exc)

        try:
            if self._stream is None:
                return _Work(run(), None, self.device, keep, after, fail)
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                run(a=False)  # ordered on the side stream; the CPU does not block on NCCL
                event = torch.cuda.Event()
                event.record(self._stream)
        except dist.DistBackendError as exc:  # a broken group; misuse raises as it is
            raise fail(exc) from exc
        return _Work(None, event, self.device, keep, after, fail)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *,
                       average: bool = False, tag: Optional[str] = None) -> Handle:
        _check(output, input, self.world_size, "reduce_scatter", "output", "input")
        op = dist.ReduceOp.SUM
        after = None
        if average and self._native_avg:
            op = dist.ReduceOp.AVG
        elif average and self.world_size > 1:
            inv = 1.0 / self.world_size
            after = lambda: output.mul_(inv)  # noqa: E731 - runs on the waiter's stream
        if self._exchange_reduce_scatter:
            return self._exchange_and_sum(output, input, tag, after)
        return self._launch(lambda **kw: self._reduce_scatter(output, input, op, **kw),
                            (output, input), "reduce_scatter", tag, after)

    def _exchange_and_sum(self, output: torch.Tensor, input: torch.Tensor,
                          tag: Optional[str], then: Optional[Callable[[], None]]) -> Handle:
        """gloo's reduce-scatter as an all-to-all and a local sum in rank order (see
        [Note: reduce-scatter over gloo])."""
        received = torch.empty_like(input)
        chunks = received.view(self.world_size, -1)

        def add_up() -> None:
            output.copy_(chunks[0])
            for chunk in chunks[1:]:
                output.add_(chunk)
            if then is not None:
                then()

        return self._launch(lambda **kw: self._all_to_all(received, input, **kw),
                            (output, input), "reduce_scatter", tag, add_up)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *,
                   tag: Optional[str] = None) -> Handle:
        _check(input, output, self.world_size, "all_gather", "input", "output")
        return self._launch(lambda **kw: self._all_gather(output, input, **kw),
                            (input, output), "all_gather", tag)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *,
                   tag: Optional[str] = None) -> Handle:
        """``output`` (same numel and dtype as ``input``, N equal chunks) receives, at chunk q,
        rank q's chunk ``self.rank`` (``all_to_all_single`` with equal splits; gloo and
        NCCL)."""
        _check(output, input, 1, "all_to_all", "output", "input")
        if input.numel() % self.world_size:
            raise ValueError(f"all_to_all: input has {input.numel()} elements, not divisible "
                             f"by the {self.world_size} ranks")
        return self._launch(lambda **kw: self._all_to_all(output, input, **kw),
                            (output, input), "all_to_all", tag)

    def all_reduce(self, tensor: torch.Tensor, *, op: str = "sum",
                   tag: Optional[str] = None) -> Handle:
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
        if op not in ops:
            raise ValueError(f"op must be one of {tuple(ops)}, got {op!r}")
        return self._launch(lambda **kw: self._all_reduce(tensor, ops[op], **kw), (tensor,),
                            "all_reduce", tag)


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
