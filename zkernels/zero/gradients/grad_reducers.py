"""Gradient strategies: what happens to gradients between backward and the optimizer update.

Both reduce bucket by bucket *during* backward: stage 1 (:class:`FullGradReducer`) keeps the
full gradients too; stages 2-3 (:class:`ShardedGradReducer`) keep only this rank's shard. Each
bucket is one object that owns its step (:class:`FullGradBucket`, :class:`GradBucket`: its
gradient hooks, the pack, its reduce buffer, the launch and the hand-off of the reduced shard),
as FSDP2's ``FSDPParamGroup`` does; the reducers only hold them, their launch order
(``zkernels.comm.bucketed.LaunchOrder``) and the pool. The optimizer talks to either reducer
through the same members: ``sync`` (False inside ``no_sync``), ``finish()``, ``zero_grad()``
and the tensors they hold (for ``stats()``). The number of reduce buffers is the registry's
rule (``policy.num_reduce_buffers``).

[Note: gradient accumulation]
Stage 1 accumulates micro-steps in its flat gradient buffers (param dtype); under ``no_sync`` its
hooks do nothing, so nothing is communicated, and the next synced backward reduces each bucket's
accumulated sum once it is complete (see [Note: stage 1 reduces during backward]). Stage 2 under
``no_sync`` leaves ``param.grad`` alone: full gradients accumulate in the param dtype exactly as in
DDP/FSDP's ``no_sync``, and the next synced backward's hooks (or ``step()``) pack the accumulated
sum and reduce it once. The alternative, reducing every micro-step into an fp32 shard (DeepSpeed),
would save the full-gradient memory during accumulation but pay the whole reduce-scatter on every
micro-step; ``no_sync`` is asked to skip communication, so it trades memory for traffic like DDP.
Two synced backwards without ``zero_grad`` add their reduced shards (fp32) as torch adds gradients.
Stage 3 reuses stage 2's buckets over its units' flats (each GatherUnit's hook calls its flat's
bucket, then counts the gradient to free the unit), so the same holds there: inside ``no_sync``
full gradients (Ψ in the param dtype) accumulate while the parameters themselves stay sharded, like
FSDP2's ``set_requires_gradient_sync(False)``.

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

[Note: reduce buffers end with backward]
Stage 3's reduce buffers (a transient pool: [Note: transient reduce buffers] in
``zkernels/comm/reduce_pool.py``) live only while backward's reductions are in flight. During
backward the pool keeps at most its ``num_buffers``: a bucket that needs one while all are
busy first waits for the oldest reduction and takes its buffer, as FSDP2 keeps only the
previous reduce-scatter's input alive until the next one. At the end of every synced backward
the stage-3 schedule's end-of-backward callback (queued on the autograd engine at the first
pre-backward hook, as FSDP2's post-backward final callback is) calls
:meth:`ShardedGradReducer.end_backward`: every bucket still pending (an unused parameter, a
bucket waiting for one, gradients held from ``no_sync``) packs and launches in order, every
reduction is waited for (``Handle.wait``: on a GPU the current stream waits on the comm stream,
no host sync; the buffers are dropped after that wait, so the caching allocator reuses them
only behind the collective, with no ``record_stream``) and the pool gives its buffers back. So
after backward and before ``step()`` a rank holds its formula (16Ψ/N in fp32) and nothing else;
the peak is unchanged (the same buffers during backward). The reduced shards are in the sink
already, so a second backward before ``step()`` starts a new round whose shards add (exact: a
bucket reduced in the first round adds zeros for its members the first backward left out);
only its traffic differs from reducing both backwards in one round, in the rare case where
the two backwards touch disjoint parameters. A backward that raised runs no callback: its
pending gradients wait for ``step()`` or ``zero_grad()`` as before. Stage 2's pool is
persistent (its buffers are held between steps anyway), so it keeps reducing in ``step()``.
"""
from __future__ import annotations

from typing import List, Optional, Protocol, Sequence, Tuple

import torch

from ...comm.base import Comm
from ...comm.bucketed import LaunchOrder, ReduceBucket
from ...comm.hybrid import num_averaged
from ...comm.reduce_pool import ReducePool
from ...ops import OpSet
from ..planning.policy import StagePolicy
from .precision import MixedPrecision
from .presence import GradPresence
from ..parameters.units import FlatParamUnit, hook_grads
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


class _Reducer:
    """What both strategies share: their buckets in launch order, the order, ``sync``."""

    def __init__(self, buckets: Sequence["_Bucket"], pool: Optional[ReducePool]) -> None:
        self.buckets, self.pool = list(buckets), pool
        self.order = LaunchOrder(self.buckets, pool)
        self._sync = True
        # Which parameters received a gradient ([Note: unused parameters] in presence.py).
        if [b.unit.index for b in self.buckets] != list(range(len(self.buckets))):
            raise ValueError("gradient buckets must come in unit index order")
        self.presence = GradPresence([len(b.unit.params) for b in self.buckets])
        for b in self.buckets:
            b.presence = self.presence

    @property
    def sync(self) -> bool:
        """False inside ``no_sync()``: the buckets' hooks do nothing."""
        return self._sync

    @sync.setter
    def sync(self, value: bool) -> None:
        self._sync = value
        for b in self.buckets:
            b.sync = value

    def held_buffers(self) -> List[torch.Tensor]:
        return list(self.pool.buffers) if self.pool is not None else []

    def take_buffer_peak(self) -> int:
        return self.pool.take_peak() if self.pool is not None else 0


class _Bucket(ReduceBucket):
    """One flat unit's gradients (a bucket at stages 1-2, a unit's flat at stage 3): the
    members are its parameters' positions."""

    def __init__(self, unit: FlatParamUnit, pool: Optional[ReducePool]) -> None:
        super().__init__(pool, unit.layout.padded_numel, unit.shard_slice, len(unit.params))
        self.unit = unit
        self.sync = True
        self._member = {id(p): i for i, p in enumerate(unit.params)}
        self.presence: Optional[GradPresence] = None   # the reducer's, set by it

    def mark(self, p: torch.Tensor) -> int:
        """Record that ``p`` received a gradient (also inside ``no_sync``); its position."""
        pi = self._member[id(p)]
        self.presence.mark(self.unit.index, pi)
        return pi

    def on_grad(self, p: torch.Tensor) -> None:
        """``p``'s gradient is ready: record it; when synced, take it into the bucket (the
        subclass's ``_receive`` before the round check, ``_pack`` after it) and add it to the
        round, starting a new round for a parameter seen twice (``_second_gradient``)."""
        if p.grad is None:
            return
        pi = self.mark(p)
        if not self.sync:
            return
        self._receive(pi, p)
        if self.seen(pi):
            self._second_gradient()
        self._pack(pi, p)
        self.add(pi)

    def _receive(self, pi: int, p: torch.Tensor) -> None:
        """Before the round check: where the gradient must already be in the bucket."""

    def _second_gradient(self) -> None:
        """A second gradient for a parameter this round."""
        raise NotImplementedError

    def _pack(self, pi: int, p: torch.Tensor) -> None:
        """After the round check: where the gradient goes into a (possibly new) round."""


class FullGradBucket(_Bucket):
    """Stage 1's bucket: ``param.grad`` are views into its flat gradient buffer (param dtype),
    so autograd accumulates straight into the bucket layout. Its hook on each parameter counts
    the gradient; once all are in (and every bucket before it launched), it reduce-scatters
    the buffer in place, with no pack copy when the reduce dtype is the gradient's (fp32 or
    bf16); otherwise (a different reduce dtype, or fp16 which must be pre-divided: see
    precision.py's Note) it casts the buffer, times 1/N, into a pooled reduce buffer first.
    See [Note: stage 1 reduces during backward].
    """

    def __init__(self, unit: FlatParamUnit, pool: Optional[ReducePool], comm: Comm, ops: OpSet,
                 dtype: torch.dtype) -> None:
        super().__init__(unit, pool)
        self._comm, self._ops = comm, ops
        self.grad = torch.zeros(unit.layout.padded_numel, dtype=dtype, device=unit.device)
        self._views = ops.unflatten(self.grad, [p.shape for p in unit.params],
                                    offsets=unit.layout.offsets)
        self.result: Optional[torch.Tensor] = None  # the reduced shard, once it is in
        self._version = None  # the buffer's version at the launch (None: not launched)
        self._handles: List = []  # direct reductions in flight (superseded ones included)
        hook_grads(self, unit.params, "on_grad")

    def attach(self, zero_foreign: bool, members: Sequence[int] = ()) -> None:
        """Point ``param.grad`` (of ``members``, default all) at its view again. A gradient
        someone replaced (e.g. ``model.zero_grad()`` set it to None, then backward made a new
        tensor) is copied in."""
        for pi in members or range(len(self._views)):
            p, v, g = self.unit.params[pi], self._views[pi], self.unit.params[pi].grad
            if g is None or g.data_ptr() != v.data_ptr():
                if g is None or zero_foreign:
                    v.zero_()
                else:   # a gradient set by hand (or after model.zero_grad()) counts
                    v.copy_(g)
                    self.presence.mark(self.unit.index, pi)
                p.grad = v

    def _receive(self, pi: int, p: torch.Tensor) -> None:
        self.attach(False, (pi,))

    def _second_gradient(self) -> None:
        # Two synced backwards, some parameter unused in the first: what was launched before
        # is stale once its buffer changes (its version), and is redone.
        self._order().new_round()

    def launch(self) -> None:
        """Start the reduce-scatter, unless the one launched is still current."""
        self.launched = True
        if self._version is not None and self._version == self.grad._version:
            return
        self._version = self.grad._version
        if self.pool is None:
            out = torch.empty(self.unit.layout.shard_numel, dtype=self.grad.dtype,
                              device=self.grad.device)
            self._handles.append(self._comm.reduce_scatter(out, self.grad))
            self.result = out
            return
        buf = self.pool.acquire(self.numel)
        self._ops.bucket_pack([self.grad], buf, [0], scale=1.0 / num_averaged(self._comm))
        self.result = None
        self.pool.launch(buf, self.shard, self.reduced)

    def reduced(self, shard: torch.Tensor) -> None:
        self.result = shard.clone()

    def wait(self) -> None:
        for h in self._handles:
            h.wait()
        self._handles = []

    def take(self) -> Optional[torch.Tensor]:
        """The reduced shard (after the waits); the bucket forgets it and its launch."""
        out, self.result, self._version = self.result, None, None
        return out


class FullGradReducer(_Reducer):
    """Stage 1: one :class:`FullGradBucket` per bucket, launched in bucket order as backward
    completes them, as stage 2 and DDP do. The full gradients stay in ``param.grad``; the
    reduced shards exist from their launch to the end of ``step()``."""

    def __init__(self, policy: StagePolicy, buckets: Sequence[FlatParamUnit], comm: Comm,
                 precision: MixedPrecision, ops: OpSet) -> None:
        direct = not policy.uses_reduce_pool(precision.param_dtype, precision.reduce_dtype)
        pool = None if direct else _pool(policy, buckets, comm, precision)
        super().__init__([FullGradBucket(b, pool, comm, ops, precision.param_dtype)
                          for b in buckets], pool)
        self._comm = comm
        for b in self.buckets:
            b.attach(zero_foreign=True)

    @property
    def grads(self) -> List[torch.Tensor]:
        """The flat gradient buffer of each bucket."""
        return [b.grad for b in self.buckets]

    def held_grads(self) -> List[torch.Tensor]:
        return self.grads

    def _settle(self) -> List[Optional[torch.Tensor]]:
        """Wait for every reduction; take the shards; start a new round."""
        for b in self.buckets:
            b.wait()
        self.order.drain()
        self.order.new_round()
        return [b.take() for b in self.buckets]

    def zero_grad(self, set_to_none: bool = True) -> None:
        # param.grad stays a view of the flat buffer either way (zeros): backward accumulates
        # straight into the bucket layout.
        self._settle()  # no reduction may read a buffer while it is zeroed
        self.presence.reset()
        for b in self.buckets:
            b.grad.zero_()
            b.attach(zero_foreign=True)

    def finish(self) -> Tuple[List[torch.Tensor], float]:
        """Launch every bucket whose reduction is missing or stale, in order, wait for all.

        Returns:
            this rank's reduced shard per bucket ([shard_numel], reduce dtype) and the divisor
            still to apply (N where the sum was not pre-divided, else 1). They are the
            caller's now: the reducer forgets them, so they live until the step drops them.
        """
        for b in self.buckets:
            b.attach(zero_foreign=False)
            b.launch()
        return self._settle(), (float(num_averaged(self._comm)) if self.pool is None else 1.0)


class GradBucket(_Bucket):
    """A bucket of stage 2, or one flat unit's gradients at stage 3: its hook on each
    parameter packs the gradient (times 1/N, cast to the reduce dtype) into the bucket's
    pooled reduce buffer as backward produces it and frees the full gradient (``param.grad =
    None``); once all are packed (and every bucket before it launched: every rank issues the
    same collectives in the same order) it starts its async reduce-scatter while backward goes
    on, and hands the reduced shard to the grad sink (``sink.accumulate(unit.index, shard)``).

    [Note: the per-gradient pack] The hook runs once per gradient per step (dozens to
    thousands of times): it calls the optimizer's OpSet (backend chosen once) with each
    gradient's offset list built here once. On CPU with the C++ backend, OpSet's copy ops
    check their arguments natively (ops/_fast.py) before the copy, which measured faster than
    calling the backend function directly with the checks skipped in Python (1.1 vs 1.4 us at
    256 elements, 2.7 vs 3.3 us at 16K, one thread).

    Args:
        unit: the flat unit.
        pool: the shared reduce pool.
        ops: the optimizer's OpSet.
        scale: 1/N (all N ranks, also with hybrid sharding).
        sink: the :class:`GradSink`.
        hooks: install the hook on each parameter (stage 2); False: the unit's owner calls
            :meth:`on_grad` from its own hook (stage 3's ``GatherUnit``).
    """

    def __init__(self, unit: FlatParamUnit, pool: ReducePool, ops: OpSet, scale: float,
                 sink: "GradSink", hooks: bool = True) -> None:
        super().__init__(unit, pool)
        self._ops, self._scale, self._sink = ops, scale, sink
        self._offsets = [[o] for o in unit.layout.offsets[:len(unit.params)]]
        if hooks:
            hook_grads(self, unit.params, "on_grad")

    def _second_gradient(self) -> None:
        # Two backwards, some parameter unused in the first: close the round, start a new one.
        self._order().flush()

    def _pack(self, pi: int, p: torch.Tensor) -> None:
        g = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
        self._ops.bucket_pack([g], self.buffer(), self._offsets[pi], scale=self._scale)
        p.grad = None
        self.members.add(pi)

    def pack_held(self) -> None:
        """Gradients still held (``no_sync`` micro-steps, parameters whose hook has not run)."""
        for pi, p in enumerate(self.unit.params):
            if p.grad is not None and pi not in self.members:
                self.presence.mark(self.unit.index, pi)
                self._pack(pi, p)

    def reduced(self, shard: torch.Tensor):
        return self._sink.accumulate(self.unit.index, shard)

    def holds_grads(self) -> bool:
        return any(p.grad is not None for p in self.unit.params)

    def zero_grad(self, set_to_none: bool) -> None:
        for p in self.unit.params:
            if set_to_none or p.grad is None:
                p.grad = None
            else:  # a full gradient held (no_sync): zeros, as torch's zero_grad(False)
                p.grad.detach_()
                p.grad.zero_()


class ShardedGradReducer(_Reducer):
    """Stages 2-3: one :class:`GradBucket` per bucket (stage 3: per unit's flat, in backward
    order). The reduced shards go to the grad sink, whose fp32 shard per bucket is the only
    gradient memory held between steps. The pool holds one open (partly filled) bucket per
    param group beyond two (one may wait for an earlier one: see plan_buckets); at stage 3 it
    holds its buffers only while gradients are in flight ([Note: transient reduce buffers]),
    given back at the end of each backward ([Note: reduce buffers end with backward]).

    Args:
        hooks: install each bucket's gradient hooks (stage 2); stage 3's GatherUnits install
            their own and call the buckets (see [Note: stage-3 gather schedule]).
    """

    def __init__(self, policy: StagePolicy, buckets: Sequence[FlatParamUnit], comm: Comm,
                 precision: MixedPrecision, ops: OpSet,
                 grad_sink: Optional["GradSink"] = None, hooks: bool = True) -> None:
        self.sink = grad_sink if grad_sink is not None else \
            DeviceGradShards(buckets, lazy=policy.shards_params)
        pool = _pool(policy, buckets, comm, precision)
        scale = 1.0 / num_averaged(comm)
        super().__init__([GradBucket(b, pool, ops, scale, self.sink, hooks) for b in buckets],
                         pool)

    def finish(self) -> Tuple[List[torch.Tensor], float]:
        """Launch what backward left, wait for everything in flight.

        Returns:
            the fp32 gradient shard per bucket ([shard_numel], already divided by N) and 1.0.
        """
        self._settle()
        return self.sink.collect(), 1.0

    def end_backward(self) -> None:
        """A synced backward ended (stage 3's end-of-backward callback): reduce what it left
        and give the reduce buffers back, so that between backward and ``step()`` a rank holds
        only its formula ([Note: reduce buffers end with backward]). Inside ``no_sync``
        nothing was packed and nothing is done. A persistent pool (stage 2) keeps its
        buffers, so nothing is gained there: stage 2 never calls it."""
        if self.sync:
            self._settle()

    def _settle(self) -> None:
        """Launch what is pending (unused parameters, a bucket that waits for one, gradients
        held from ``no_sync``), in order; wait for everything in flight; trim the pool."""
        if self.order.started() or any(b.holds_grads() for b in self.buckets):
            self.order.flush()
        self.order.drain()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.order.discard()
        self.sink.reset()
        self.presence.reset()
        for b in self.buckets:
            b.zero_grad(set_to_none)

    def held_grads(self) -> List[torch.Tensor]:
        """Gradient storage on the device (a host sink reports its own: ``grad_sink.py``)."""
        return self.sink.held() if self.sink.on_device else []


def _pool(policy: StagePolicy, buckets: Sequence[FlatParamUnit], comm: Comm,
          precision: MixedPrecision) -> ReducePool:
    """The reduce pool of ``buckets``: the registry's number of buffers of the largest one,
    kept between steps or not as the stage says ([Note: transient reduce buffers])."""
    return ReducePool(comm, max(b.layout.padded_numel for b in buckets), precision.reduce_dtype,
                      buckets[0].device, policy.num_reduce_buffers(
                          len(buckets), len({b.group_index for b in buckets})),
                      transient=not policy.holds_reduce_buffers)


GRAD_REDUCERS = {1: FullGradReducer, 2: ShardedGradReducer, 3: ShardedGradReducer}


def make_grad_reducer(policy: StagePolicy, units: Sequence[FlatParamUnit], comm: Comm,
                      precision: MixedPrecision, ops: OpSet,
                      grad_sink: Optional[GradSink] = None) -> GradReducer:
    """The gradient strategy of ``policy``'s stage (``GRAD_REDUCERS``). ``grad_sink``: where
    reduced shards go (the update strategy's, for offload); only the stages that shard
    gradients get one (``ZeroConfig`` puts offload at stage 2 or 3). A stage that shards
    parameters reduces over its units' flats with the hooks left to its units
    (``GatherSchedule`` binds them)."""
    extra = {} if not policy.shards_grads else {"grad_sink": grad_sink,
                                                "hooks": not policy.shards_params}
    return GRAD_REDUCERS[policy.stage](policy, units, comm, precision, ops, **extra)
