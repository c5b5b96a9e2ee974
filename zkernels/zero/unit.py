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
- Save and load. ``state_dict()``, ``zkernels.checkpoint`` and ``model.load_state_dict`` read
  and write k's state through :class:`ZeroUnit` (``read_state`` / ``write_state`` and their
  low-bit, torch-class and whole-matrix forms, through the engine's place: NVMe reads and
  writes the files), then publish as the step does ([Note: the declared checkpoint view]).

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

from typing import Dict, List, Optional, Sequence

import torch

from ..comm.base import Comm, Handle
from .parameters.units import FlatParamUnit
from .state.lowbit_state import dequantized, describe_format, quantized
from .state.matrix_rule import MatrixUnitRule
from .state.places import KINDS
from .state.rule_swap import SwappedRule


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
        self._engine, self._place = engine, engine.place
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
        return self.flat.gather.publish(comm)   # every rank's copy follows the new shard

    # -- its state in and out ([Note: the declared checkpoint view]) --------------------

    @property
    def state_step(self) -> int:
        """Steps applied to its shard (no tensor is read)."""
        return self.state.step

    @property
    def param_steps(self) -> List[int]:
        """Each of its parameters' step counts ([Note: unused parameters])."""
        return list(self.state.param_steps)

    @property
    def state_format(self) -> Optional[dict]:
        """Its low-bit moments' format as a checkpoint names it, or None (fp32 moments)."""
        return describe_format(self.state.fmt)

    def read_state(self):
        """``(step, (master, exp_avg, exp_avg_sq))``, fp32: live tensors, or new ones read
        from the files where on disk (a bf16 master exact, low-bit moments dequantized)."""
        place, rec = self._place, self.state
        place.settle()
        if isinstance(rec.rule, SwappedRule):   # (its master in RAM or in its own file)
            return rec.step, (rec.rule.master_copy(), rec.exp_avg, rec.exp_avg_sq)
        master = place.materialize(rec, "master", rec.master)
        if rec.fmt is not None:   # low-bit moments: their fp32 values (new tensors)
            low = self.read_lowbit_state()
            moments = dequantized(rec.fmt, low["exp_avg"], low["exp_avg_sq"],
                                  low.get("exp_avg_scales"), low.get("exp_avg_sq_scales"))
        else:
            moments = tuple(place.materialize(rec, k, t) for k, t in
                            zip(KINDS[1:], rec.tensors()[1:]))
        return rec.step, (master.float() if master.dtype == torch.bfloat16 else master,
                          ) + moments

    def write_state(self, step: int, master: torch.Tensor, exp_avg: torch.Tensor,
                    exp_avg_sq: torch.Tensor, param_steps: Optional[Sequence[int]] = None
                    ) -> None:
        """Overwrite its state (tensors, files) and rebuild its compute shard from ``master``
        (``param_steps`` None: every parameter's count is ``step``)."""
        place, rec = self._place, self.state
        place.settle()
        rec.set_step(step, param_steps)
        if rec.rule is not None:   # a whole-matrix owner re-reads its master at the next step
            rec.rule.master_written()
        src = dict(zip(KINDS, (master, exp_avg, exp_avg_sq)))
        if rec.fmt is not None:   # fp32 moments into low-bit state: requantized
            at = "cpu" if rec.exp_avg.is_meta else rec.exp_avg.device   # (NVMe: in files)
            src.update(quantized(rec.fmt, exp_avg.to(at), exp_avg_sq.to(at)))
            for k, t in (("exp_avg_scales", rec.exp_avg_scales),
                         ("exp_avg_sq_scales", rec.exp_avg_sq_scales)):
                if t is not None and not t.is_meta:
                    t.copy_(src[k])
        for k, t in zip(KINDS, rec.tensors()):
            if not t.is_meta:
                t.copy_(src[k])
        if isinstance(rec.rule, SwappedRule):   # (a model.load_state_dict: the master only)
            if rec.master.is_meta:
                rec.rule.write_master(master.to("cpu", torch.float32))
        elif rec.rule is None:   # (NVMe: into its files)
            place.fill(rec, src)
        place.write_compute(self.flat, master.to("cpu", torch.float32) if rec.master.is_meta
                            else rec.master)

    def read_lowbit_state(self) -> Optional[Dict[str, torch.Tensor]]:
        """Its low-bit moments as trained (live tensors, or new ones read from the files on
        NVMe), or None (fp32 moments: :meth:`read_state` has them)."""
        live = _lowbit_live(self.state)
        return None if live is None else {
            k: self._place.materialize(self.state, k, t) for k, t in live.items()}

    def write_lowbit_state(self, tensors: Dict[str, torch.Tensor]) -> None:
        """Restore its low-bit moments, bit for bit, from tensors of its own format (after
        :meth:`write_state` restored its master and counts)."""
        self._place.settle()
        rec, live = self.state, _lowbit_live(self.state)
        if live is None or set(live) != set(tensors):
            raise ValueError(f"unit {self.index}: expected low-bit moments "
                             f"{sorted(live or ())}, got {sorted(tensors)}")
        for k, t in live.items():
            if tensors[k].shape != t.shape or tensors[k].dtype != t.dtype:
                raise ValueError(f"unit {self.index}: {k} must be {t.dtype} of shape "
                                 f"{tuple(t.shape)}, got {tensors[k].dtype} of shape "
                                 f"{tuple(tensors[k].shape)}")
        if rec.exp_avg.is_meta:   # NVMe: into the files
            self._place.fill(rec, tensors, kinds=list(tensors))
            return
        for k, t in live.items():
            t.copy_(tensors[k])

    def read_rule_state(self):
        """A torch class's unit: ``(step, master, [state dict per piece])``, the pieces in
        ``flat.param_slices_in_shard()`` order; the fused AdamW's: its moments as pieces."""
        rec = self.state
        if rec.rule is None:
            step, (master, m, v) = self.read_state()
            return step, master, [{"exp_avg": m[s:s + n], "exp_avg_sq": v[s:s + n]}
                                  for _, _, s, n in self.flat.param_slices_in_shard()]
        master = rec.rule.master_copy() if rec.master.is_meta else rec.master
        return rec.step, master, rec.rule.piece_states()

    def write_rule_state(self, step: int, master: torch.Tensor, states) -> None:
        """Restore what :meth:`read_rule_state` gave and rebuild the compute shard."""
        rec = self.state
        if rec.rule is None:
            _, (_, m, v) = self.read_state()
            m, v = m.clone(), v.clone()
            for (_, _, s, n), st in zip(self.flat.param_slices_in_shard(), states):
                m[s:s + n] = st["exp_avg"]
                v[s:s + n] = st["exp_avg_sq"]
            self.write_state(step, master, m, v)
            return
        rec.step = int(step)
        if rec.master.is_meta:   # the master in a file ([Note: rule state on NVMe])
            rec.rule.load(states, self.group, master=master)
            self._place.write_compute(self.flat, master.to("cpu", torch.float32))
            return
        rec.master.copy_(master)
        rec.rule.load(states, self.group)
        self._place.write_compute(self.flat, rec.master)

    def read_owned_state(self) -> Dict[str, dict]:
        """A whole-matrix class's unit: the class's own state of each of its parameters this
        rank owns ([Note: whole matrices on owners]), by name; empty for other units."""
        rule = self.state.rule
        return rule.matrix.owned_states(self.index) if isinstance(rule, MatrixUnitRule) else {}

    def write_owned_state(self, step: int, master: torch.Tensor, states) -> None:
        """Restore :meth:`read_owned_state` (same world size and layout: same owners) and
        its master shard (``MatrixUpdate.load_owned``); rebuild its compute shard."""
        rec = self.state
        rec.step = int(step)
        rec.master.copy_(master)
        rec.rule.matrix.load_owned(self.index, states, self.group)
        self._place.write_compute(self.flat, rec.master)


def _lowbit_live(rec) -> Optional[Dict[str, torch.Tensor]]:
    """A low-bit record's moment tensors (meta tensors where they live in files)."""
    scales = dict(exp_avg_scales=rec.exp_avg_scales, exp_avg_sq_scales=rec.exp_avg_sq_scales)
    return None if rec.fmt is None else dict(exp_avg=rec.exp_avg, exp_avg_sq=rec.exp_avg_sq,
                                             **(scales if rec.fmt.blocked else {}))
