"""Gradient strategies: what happens to gradients between backward and the optimizer update.

Both reduce bucket by bucket *during* backward: stage 1 (:class:`FullGradReducer`) keeps the
full gradients too; stage 2 (:class:`ShardedGradReducer`) keeps only this rank's shard. The
optimizer talks to either through the same four members: ``sync`` (False inside
``no_sync``), ``finish()``, ``zero_grad()`` and the tensors they hold (for ``stats()``). Stage 3 and offload add strategies here (``GRAD_REDUCERS``) instead of branches
in shared code. Stage 2's launch order and buffers are ``zkernels.comm.bucketed``'s; the number
of reduce buffers is the registry's rule (``policy.num_reduce_buffers``).

[Note: gradient accumulation]
Stage 1 accumulates micro-steps in its flat gradient buffers (param dtype); under ``no_sync``
its hooks do nothing, so nothing is communicated, and the next synced backward reduces each
bucket's accumulated sum once it is complete (see [Note: stage 1 reduces during backward]).
Stage 2 under ``no_sync`` leaves ``param.grad`` alone: full gradients accumulate in the param dtype exactly as in DDP/FSDP's
``no_sync``, and the next synced backward's hooks (or ``step()``) pack the accumulated sum and
reduce it once. The alternative, reducing every micro-step into an fp32 shard (DeepSpeed), would
save the full-gradient memory during accumulation but pay the whole reduce-scatter on every
micro-step; ``no_sync`` is asked to skip communication, so it trades memory for traffic like
DDP. Two synced backwards without ``zero_grad`` add their reduced shards (fp32) as torch adds
gradients. Stage 3 reuses stage 2's strategy over its units, so the same holds there: inside
``no_sync`` full gradients (Ψ in the param dtype) accumulate while the parameters themselves
stay sharded, like FSDP2's ``set_requires_gradient_sync(False)``.

[Note: stage 1 reduces during backward]
A bucket's reduce-scatter starts as soon as backward has accumulated every gradient of the
bucket (and of every bucket before it: launch order is bucket order, see [Note: bucket launch
order] in ``zkernels/comm/bucketed.py``); ``step()`` launches what backward left (unused
parameters, a bucket that waits for one) and waits. The gradients stay in ``param.grad``
(views of the flat buffers), so a reduction is only valid while its buffer is unchanged: each
launch records the buffer's version counter (bumped by every in-place write: autograd's
accumulation, a ``no_sync`` micro-step, ``zero_grad``, a user's ``p.grad.mul_``), and
``step()`` redoes, in bucket order, each reduction whose buffer changed since (e.g. two synced
backwards without ``zero_grad``: the sum of both is reduced, as before). So ``step()`` sees
exactly the gradients that ``param.grad`` holds when it is called, as it did when stage 1
communicated only there. Every rank must run the same program (the same backwards and
gradient writes), as for stage 2's rounds, so that they issue the same collectives. A
reduction superseded while in flight has its input changed under it; its result is thrown
away and it is waited for before ``step()`` returns (its buffers stay alive until then).
"""
from __future__ import annotations

import weakref
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from ...comm.base import Comm
from ...comm.bucketed import BucketedReduceScatter
from ...comm.hybrid import num_averaged
from ...comm.reduce_pool import ReducePool
from ...ops import OpSet
from ..planning.policy import StagePolicy
from .precision import MixedPrecision
from ..parameters.units import FlatParamUnit
from ..state.grad_sink import GradShards as DeviceGradShards


class GradReducer(Protocol):
    """What the optimizer needs from a gradient strategy."""

    sync: bool  # False inside ``no_sync()``: backward must not communicate

    def finish(self) -> Tuple[List[torch.Tensor], float]:
        """Complete the reduction: this rank's gradient shard per bucket ([shard_numel]) and
        the divisor not yet applied to them. Collective."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget accumulated gradients; a full gradient still held becomes None
        (``set_to_none``) or zeros, as ``torch.optim.Optimizer.zero_grad`` does."""

    def held_grads(self) -> List[torch.Tensor]:
        """Gradient storage held between steps (for ``stats()``)."""

    def held_buffers(self) -> List[torch.Tensor]:
        """Reduce/comm scratch buffers held (for ``stats()``)."""

    def take_buffer_peak(self) -> int:
        """The most reduce-buffer bytes held at once since the last call (for ``stats()``'s
        peak)."""


class GradSink(Protocol):
    """Where stage 2's reduced gradient shards go as each bucket's reduce-scatter finishes."""

    shards: List[torch.Tensor]  # [shard_numel] fp32 per bucket
    on_device: bool              # the shards live on the compute device (for ``stats()``)

    def accumulate(self, bucket: int, reduced: torch.Tensor):
        """Take bucket ``bucket``'s reduced shard (a view into a reduce buffer). May return a
        fence that the reduce pool waits before reusing the buffer."""

    def collect(self) -> List[torch.Tensor]:
        """After every reduction finished: the shards, ready for the update (buckets without
        a gradient since ``reset`` hold zeros)."""

    def reset(self) -> None:
        """Forget accumulated shards (``zero_grad``)."""


class FullGradReducer:
    """Stage 1: ``param.grad`` is a view into a flat gradient buffer per bucket (param dtype),
    so autograd accumulates straight into the bucket layout. A post-accumulate-grad hook counts
    each bucket's gradients as backward produces them; a bucket whose gradients are all there
    starts its async reduce-scatter at once, in bucket order, while backward goes on (as stage
    2 and DDP do), with no pack copy when the reduce dtype is the gradient's (fp32 or bf16).
    Otherwise (a different reduce dtype, or fp16 which must be pre-divided: see precision.py's
    Note) the launch casts the bucket, times 1/N, into a pooled reduce buffer first. The full
    gradients stay in ``param.grad``; the reduced shards exist from their launch to the end of
    ``step()``. See [Note: stage 1 reduces during backward].
    """

    def __init__(self, policy: StagePolicy, buckets: Sequence[FlatParamUnit], comm: Comm,
                 precision: MixedPrecision, ops: OpSet) -> None:
        self.sync = True
        self._buckets = list(buckets)
        self._comm = comm
        self._ops = ops
        dev = buckets[0].device
        self.grads = [torch.zeros(b.layout.padded_numel, dtype=precision.param_dtype, device=dev)
                      for b in buckets]
        self._views = [ops.unflatten(g, [p.shape for p in b.params], offsets=b.layout.offsets)
                       for b, g in zip(buckets, self.grads)]
        self._direct = not policy.uses_reduce_pool(precision.param_dtype, precision.reduce_dtype)
        num_groups = len({b.group_index for b in buckets})
        self._pool = None if self._direct else ReducePool(
            comm, max(b.layout.padded_numel for b in buckets), precision.reduce_dtype, dev,
            policy.num_reduce_buffers(len(buckets), num_groups))
        self._where: Dict[int, Tuple[int, int]] = {
            id(p): (b.index, i) for b in buckets for i, p in enumerate(b.params)}
        # Per bucket: the reduced shard (or None), the gradient buffer's version when its
        # reduction was launched (None: not launched), the direct path's handle in flight.
        self._shards: List = [None] * len(buckets)
        self._launched: List = [None] * len(buckets)
        self._handles: List = []
        self._reset_round()
        self._attach(zero_foreign=True)
        _hook_params(self, buckets)

    def _reset_round(self) -> None:
        self._seen = [set() for _ in self._buckets]
        self._next = 0  # first bucket not launched in this round

    def _attach(self, zero_foreign: bool) -> None:
        """Point every ``param.grad`` at its view again. A gradient someone replaced (e.g.
        ``model.zero_grad()`` set it to None, then backward made a new tensor) is copied in."""
        for b, views in zip(self._buckets, self._views):
            for p, v in zip(b.params, views):
                self._attach_one(p, v, zero_foreign)

    @staticmethod
    def _attach_one(p: torch.Tensor, v: torch.Tensor, zero_foreign: bool) -> None:
        g = p.grad
        if g is not None and g.data_ptr() == v.data_ptr():
            return
        if g is None or zero_foreign:
            v.zero_()
        else:
            v.copy_(g)
        p.grad = v

    def _hook(self, p: torch.Tensor) -> None:
        if not self.sync or p.grad is None:
            return
        bi, pi = self._where[id(p)]
        self._attach_one(p, self._views[bi][pi], zero_foreign=False)
        if bi < self._next or pi in self._seen[bi]:
            # A second gradient for a parameter this round (two synced backwards, some
            # parameter unused in the first): a new round; what was launched before is stale
            # once its buffer changes (its version), and is redone.
            self._reset_round()
        self._seen[bi].add(pi)
        while (self._next < len(self._buckets) and
               len(self._seen[self._next]) == len(self._buckets[self._next].params)):
            self._launch(self._next)
            self._next += 1

    def _valid(self, bi: int) -> bool:
        return self._launched[bi] is not None and self._launched[bi] == self.grads[bi]._version

    def _launch(self, bi: int) -> None:
        """Start bucket ``bi``'s reduce-scatter (unless the one launched is still current)."""
        if self._valid(bi):
            return
        b, g = self._buckets[bi], self.grads[bi]
        self._launched[bi] = g._version
        if self._direct:
            out = torch.empty(b.layout.shard_numel, dtype=g.dtype, device=g.device)
            self._handles.append(self._comm.reduce_scatter(out, g))
            self._shards[bi] = out
            return
        n = num_averaged(self._comm)  # all N ranks, also with hybrid sharding
        buf = self._pool.acquire(b.layout.padded_numel)
        self._ops.bucket_pack([g], buf, [0], scale=1.0 / n)
        self._shards[bi] = None
        self._pool.launch(buf, b.shard_slice,
                          lambda s, i=bi: self._shards.__setitem__(i, s.clone()))

    def _drain(self) -> None:
        for h in self._handles:
            h.wait()
        self._handles = []
        if self._pool is not None:
            self._pool.drain()

    def zero_grad(self, set_to_none: bool = True) -> None:
        # param.grad stays a view of the flat buffer either way (zeros): backward accumulates
        # straight into the bucket layout.
        self._drain()  # no reduction may read a buffer while it is zeroed
        self._forget()
        for g in self.grads:
            g.zero_()
        self._attach(zero_foreign=True)

    def _forget(self) -> None:
        self._shards = [None] * len(self._buckets)
        self._launched = [None] * len(self._buckets)
        self._reset_round()

    def finish(self) -> Tuple[List[torch.Tensor], float]:
        """Launch every bucket whose reduction is missing or stale, in order, wait for all.

        Returns:
            this rank's reduced shard per bucket ([shard_numel], reduce dtype) and the divisor
            still to apply (N where the sum was not pre-divided, else 1). They are the
            caller's now: the reducer forgets them, so they live until the step drops them.
        """
        self._attach(zero_foreign=False)
        for bi in range(len(self._buckets)):
            self._launch(bi)
        self._drain()
        shards = list(self._shards)
        self._forget()
        return shards, (float(num_averaged(self._comm)) if self._direct else 1.0)

    def held_grads(self) -> List[torch.Tensor]:
        return list(self.grads)

    def held_buffers(self) -> List[torch.Tensor]:
        return list(self._pool.buffers) if self._pool is not None else []

    def take_buffer_peak(self) -> int:
        return self._pool.take_peak() if self._pool is not None else 0


class ShardedGradReducer:
    """Stage 2: a post-accumulate-grad hook packs each gradient (times 1/N, cast to the reduce
    dtype) into its bucket's pooled reduce buffer as backward produces it and frees the full
    gradient (``param.grad = None``); a bucket whose gradients are all packed starts its async
    reduce-scatter at once, in bucket order (every rank issues the same collectives in the same
    order), while backward goes on. The reduced shard is added into a persistent fp32 gradient
    shard per bucket, the only gradient memory held between steps.
    """

    def __init__(self, policy: StagePolicy, buckets: Sequence[FlatParamUnit], comm: Comm,
                 precision: MixedPrecision, ops: OpSet,
                 grad_sink: Optional["GradSink"] = None) -> None:
        self.sync = True
        self._buckets = list(buckets)
        self._comm = comm
        self._ops = ops
        dev = buckets[0].device
        self.sink = grad_sink if grad_sink is not None else DeviceGradShards(buckets)
        self._where: Dict[int, Tuple[int, int]] = {
            id(p): (b.index, i) for b in buckets for i, p in enumerate(b.params)}
        # [Note: the per-gradient pack] The hook runs once per gradient per step (dozens to
        # thousands of times): it calls the optimizer's OpSet (backend chosen once) with each
        # gradient's offset list built here once. On CPU with the C++ backend, OpSet's copy
        # ops check their arguments natively (ops/_fast.py) before the copy, which measured
        # faster than calling the backend function directly with the checks skipped in Python
        # (1.1 vs 1.4 us at 256 elements, 2.7 vs 3.3 us at 16K, one thread).
        self._offsets = [[[o] for o in b.layout.offsets[:len(b.params)]] for b in buckets]
        self._scale = 1.0 / num_averaged(comm)  # all N ranks, also with hybrid sharding
        # One open (partly filled) bucket per group can wait for an earlier one: see
        # plan_buckets. More buffers than that, or than buckets, would only hold memory.
        # The hooks (and the reduce-scatter's callback) hold the reducer weakly and go away
        # with it, so a dropped optimizer leaves no hooks (and no buffers) behind on the model.
        this = weakref.ref(self)

        def on_reduced(bi: int, shard: torch.Tensor):
            return this().sink.accumulate(bi, shard)

        num_groups = len({b.group_index for b in buckets})
        self._rs = BucketedReduceScatter(
            comm, [b.layout.padded_numel for b in buckets], [b.shard_slice for b in buckets],
            [len(b.params) for b in buckets], precision.reduce_dtype, dev,
            policy.num_reduce_buffers(len(buckets), num_groups), on_reduced,
            transient_buffers=not policy.holds_reduce_buffers)
        _hook_params(self, buckets)

    def _hook(self, p: torch.Tensor) -> None:
        if not self.sync or p.grad is None:
            return
        bi, pi = self._where[id(p)]
        if self._rs.seen(bi, pi):
            # A second gradient for a parameter this round (two backwards, some parameter
            # unused in the first): close the round, start a new one.
            self._flush_round()
        self._pack(bi, pi)
        self._rs.complete(bi, pi)

    def _pack(self, bi: int, pi: int) -> None:
        b = self._buckets[bi]
        p = b.params[pi]
        g = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
        self._ops.bucket_pack([g], self._rs.buffer(bi), self._offsets[bi][pi],
                              scale=self._scale)
        p.grad = None
        self._rs.mark(bi, pi)

    def _pack_held(self, bi: int) -> None:
        for pi, p in enumerate(self._buckets[bi].params):
            if p.grad is not None and not self._rs.is_done(bi, pi):
                self._pack(bi, pi)

    def _flush_round(self) -> None:
        """Launch every bucket not launched this round, packing gradients still held (from
        ``no_sync`` micro-steps, or parameters whose hook has not run)."""
        self._rs.flush(self._pack_held)

    def finish(self) -> Tuple[List[torch.Tensor], float]:
        """Launch what backward left, wait for everything in flight.

        Returns:
            the fp32 gradient shard per bucket ([shard_numel], already divided by N) and 1.0.
        """
        if self._rs.round_started() or any(p.grad is not None for b in self._buckets
                                            for p in b.params):
            self._flush_round()
        self._rs.drain()
        return self.sink.collect(), 1.0

    @property
    def shards(self) -> List[torch.Tensor]:
        """The gradient shards where the sink keeps them (device or host)."""
        return self.sink.shards

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._rs.discard()
        self.sink.reset()
        for b in self._buckets:
            for p in b.params:
                if set_to_none or p.grad is None:
                    p.grad = None
                else:  # a full gradient held (no_sync): zeros, as torch's zero_grad(False)
                    p.grad.detach_()
                    p.grad.zero_()

    def held_grads(self) -> List[torch.Tensor]:
        """Gradient storage on the device (a host sink reports its own, see ``update.py``)."""
        return list(self.sink.shards) if self.sink.on_device else []

    def held_buffers(self) -> List[torch.Tensor]:
        return self._rs.buffers

    def take_buffer_peak(self) -> int:
        return self._rs.take_peak_bytes()


def _hook_params(reducer, buckets: Sequence[FlatParamUnit]) -> None:
    """A post-accumulate-grad hook on every parameter of ``buckets`` that calls
    ``reducer._hook(p)``. The hooks hold the reducer weakly and are removed when it is
    collected, so a dropped optimizer leaves no hooks behind on the model."""
    this = weakref.ref(reducer)

    def hook(p: torch.Tensor) -> None:
        alive = this()
        if alive is not None:
            alive._hook(p)

    handles = [p.register_post_accumulate_grad_hook(hook) for b in buckets for p in b.params]
    weakref.finalize(reducer, _remove_all, handles)


def _remove_all(handles) -> None:
    for h in handles:
        h.remove()


# Stage 3 reduces exactly as stage 2, over its units (blocks, in backward order) instead of
# buckets; freeing the gathered parameters is the gather schedule's (zero/stage3.py).
GRAD_REDUCERS = {1: FullGradReducer, 2: ShardedGradReducer, 3: ShardedGradReducer}


def make_grad_reducer(policy: StagePolicy, units: Sequence[FlatParamUnit], comm: Comm,
                      precision: MixedPrecision, ops: OpSet,
                      grad_sink: Optional[GradSink] = None) -> GradReducer:
    """The gradient strategy of ``policy``'s stage (``GRAD_REDUCERS``; stage 3 registers its
    own). ``grad_sink``: where reduced shards go (the update strategy's, for offload); only
    the stages that shard gradients take one."""
    if policy.stage not in GRAD_REDUCERS:
        raise ValueError(f"no gradient strategy for stage {policy.stage} (have "
                         f"{tuple(GRAD_REDUCERS)})")
    if grad_sink is None:
        return GRAD_REDUCERS[policy.stage](policy, units, comm, precision, ops)
    if not policy.shards_grads:
        raise ValueError(f"{policy.name} keeps full gradients until step(): it takes no "
                         f"grad_sink (offload needs a stage that shards gradients)")
    return GRAD_REDUCERS[policy.stage](policy, units, comm, precision, ops, grad_sink=grad_sink)
