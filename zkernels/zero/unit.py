"""One unit's whole step: :class:`ZeroUnit` holds, for unit k, its flat storage and gather
policy, its gradient bucket and its slice of optimizer state, and steps them; ``step()`` is a
loop over these objects (``optimizer.py``'s ``_update``).

What happens to unit k (``flat`` is ``opt.units[k]``; its bucket, state record and gradient
shard all carry the same index k):

- Build (``parameters/build.py``). Stages 1-2: k is a bucket of consecutive trainable
  parameters (``planning/buckets.py``) copied into one flat buffer whose full compute copy
  stays on every rank (``ReplicatedParams``: a unit that never frees). Stage 3: k is one
  param group's flat of one module unit (``planning/unit_plan.py``); only this rank's compute
  shard persists (``ShardedParams``), kept by the injected storage: the device, host RAM
  (``offload_params``) or an NVMe file ([Note: shard storage] in ``parameters/storage.py``).
  As k is built, the update engine allocates its ``ShardState`` (master, moments, step counts)
  where the placement keeps it, from k's fp32 shard values (``engine.init_state``).
- Forward. Stages 1-2: nothing (with ``overlap_param_gather`` the first module owning one of
  k's parameters waits for k's last all-gather: [Note: lazy parameter gathers]). Stage 3: the
  forward pre-hook of k's ``GatherUnit`` (``parameters/stage3.py``) gathers all its flats, k
  among them: k's storage moves SHARDED -> UNSHARDING -> UNSHARDED ([Note: unit states] in
  ``parameters/unit_state.py``), the shard read from host RAM or its file first where it lives
  there; the post-forward hook frees it (SHARDED), keeps a secondary chunk
  (``reshard_after_forward=R``: SHARDED_POST_FORWARD, [Note: secondary shards]) or keeps it
  whole for backward ([Note: stage-3 gather schedule]).
- Backward. Each of k's parameters hands its gradient to k's ``bucket``
  (``gradients/grad_reducers.py``): stage 1 accumulates it in place in the flat gradient
  buffer and reduce-scatters the buffer once complete ([Note: stage 1 reduces during
  backward]); stages 2-3 pack it (x 1/N, in the reduce dtype) into a pooled reduce buffer,
  drop ``param.grad``, reduce-scatter once all of k's gradients are in and hand the shard to
  the sink (a device fp32 shard; host RAM with CPU offload, [Note: CPU offload step]). At
  stage 3 the GatherUnit's hook calls the bucket and, once every gradient of the unit is in,
  frees the unit; the end of backward launches what is pending and gives the reduce buffers
  back ([Note: reduce buffers end with backward]). Inside ``no_sync`` nothing is reduced
  ([Note: gradient accumulation]).
- Step. ``reducer.finish()`` waits for k's reduction and gives its gradient shard;
  ``gradients/clip.py`` folds 1/N, the loss scale and the clip coefficient into one scale, and
  the presence all-reduce says which of k's parameters have a gradient ([Note: unused
  parameters] in ``gradients/presence.py``). Then :meth:`ZeroUnit.step`: the engine updates
  k's state where it lives (one fused AdamW, a ``torch.optim`` class on its pieces, or a
  whole-matrix class's result computed on its owner before the loop: [Note: whole matrices on
  owners]; host sub-groups with CPU offload, NVMe slots streamed in index order: [Note: NVMe
  offload step]) and writes k's compute shard (in place where it lives beside the update,
  into its file where it is on disk, else by a copy); then k publishes: stages 1-2 all-gather
  every rank's new shard into the full buffer while the next unit updates, stage 3 frees a full
  copy that is now stale (the next forward gathers the new shards).

[Note: a ZeroUnit per flat]
A stage-3 ``GatherUnit`` may hold several flats: one per param group of its module and its
frozen ones. A :class:`ZeroUnit` is one trainable flat (one ``FlatParamUnit``), not one
GatherUnit: the bucket, the ``ShardState``, the reduced shard, the update (one param group's
hyperparameters and optimizer) and a checkpoint's per-unit entry are all per flat and keyed
by its index, and stages 1-2 have flats only. Frozen flats have no bucket, state or step, so
they have no ZeroUnit; they ride in their GatherUnit's gathers. The gathers stay the
GatherUnit's (driven by the schedule's hooks, prefetch bound and ``gathered()`` pins): one
flat does not gather alone outside that schedule.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..comm.base import Comm, Handle
from .parameters.units import FlatParamUnit


class ZeroUnit:
    """Unit k of this rank: its flat parameters and their storage, its gradient bucket, its
    optimizer state record and its update (see the module's story and [Note: a ZeroUnit per
    flat]). It delegates: the storage to the flat's gather policy, the gradients to the
    bucket, the update to the engine.

    Args:
        flat: the trainable :class:`~zkernels.zero.parameters.units.FlatParamUnit`.
        bucket: its gradient bucket (the gradient strategy's, ``reducer.buckets[k]``).
        engine: the update engine; its ``states[k]`` is this unit's record.
        group: the param group it steps with (the optimizer's own dict: a scheduler's writes
            to it are read at each step).

    Raises:
        ValueError: the bucket or the engine's record belongs to another flat.
    """

    def __init__(self, flat: FlatParamUnit, bucket, engine, group: dict) -> None:
        self.flat, self.bucket, self.group = flat, bucket, group
        self._engine = engine
        if bucket.unit is not flat or engine.states[flat.index].unit is not flat:
            raise ValueError(f"unit {flat.index}: its gradient bucket and state record must "
                             f"be the flat's own (built in the same index order)")

    @property
    def index(self) -> int:
        return self.flat.index

    @property
    def state(self):
        """This unit's :class:`~zkernels.zero.state.shard_state.ShardState`."""
        return self._engine.states[self.flat.index]

    def step(self, grad: torch.Tensor, grad_scale, live: Optional[Sequence[bool]],
             comm: Comm) -> Handle:
        """Update this unit's state and compute shard, then publish its parameters.

        Args:
            grad: its reduced gradient shard (``reducer.finish()``'s k-th).
            grad_scale: the divisor ``clip.py`` folded (None, float or 1-element tensor).
            live: a flag per parameter (it has a gradient this step), or None (all have one).
            comm: the collectives its all-gather goes through.

        Returns:
            the handle of its all-gather (stages 1-2; stage 3 sends nothing).
        """
        self._engine.update(self.flat, grad, self.group, grad_scale, live)
        return self.publish(comm)

    def publish(self, comm: Comm) -> Handle:
        """Make every rank's copy of its parameters follow its updated shard."""
        return self.flat.gather.publish(comm)

