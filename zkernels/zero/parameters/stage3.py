"""Stage 3's units and their schedule: module hooks that gather each unit just in time (one
all-gather per flat unit, the next one prefetched) and free it as soon as it is not needed.

[Note: stage-3 gather schedule]
Units come from ``unit_plan.py``; each :class:`GatherUnit` is one or more FlatParamUnits (one
per param group, usually one, and its frozen ones) whose gather policy is
:class:`~zkernels.zero.parameters.units.ShardedParams`. The unit owns its step, as FSDP2's
``FSDPParamGroup`` does: it gathers (start, wait), frees, and hooks its own parameters; the
:class:`GatherSchedule` only decides when (order, prefetch, the path check, ``gathered()``'s
pins, the end of backward).

- Forward: a unit's forward pre-hook gathers it (waiting for a prefetch in flight) and
  prefetches the unit predicted to run next (the order of the previous forward, module order
  before the first), if the gathered bytes stay under the bound: the root unit plus two of the
  largest other unit (the one computing and the one prefetched). Its forward hook frees it
  (``reshard_after_forward=True``: 3Ψ per step) or keeps it for backward (False: 2Ψ, every unit
  stays gathered from its forward to its backward; those kept units are outside the bound).
  Without autograd (``torch.no_grad()``, outputs that need no gradient) a unit is always freed
  after its forward, and the root's forward hook frees whatever is still gathered (a prefetch
  that did not run), so eval and generation loops hold nothing between calls.
- Backward: the forward hook registers a multi-grad hook on the unit's outputs; it fires when
  the first gradient reaches them, before the unit's backward, and gathers the unit (and
  prefetches the unit predicted next in backward order: the previous backward's, or the
  reversed forward order). The first one of a backward queues an end-of-backward callback on
  the autograd engine. The unit's one post-accumulate-grad hook on each trainable parameter
  hands the gradient to its flat's gradient bucket (``grad_reducers.GradBucket``: pack into
  the reduce buffer, reduce-scatter once the flat's gradients are all in, hand the shard to
  the state side), then counts it; when all are in, no node of the graph needs the unit's
  parameters any more (a node that saved a parameter computes that parameter's gradient), so
  the unit frees itself. The end-of-backward callback frees every unit still gathered (unused
  parameters, ``no_sync``).
- Activation checkpointing re-runs forwards inside backward: there forward hooks gather but
  never free and register nothing (reentrant checkpointing's nested backward: the gradient
  count frees the unit). ``gathered()`` pins units: hooks neither gather nor free them again.
- Each unit's phase of the step is an explicit state: [Note: unit states] (``unit_state.py``).
- Frozen parameters ([Note: frozen parameters at stage 3] in ``units.py``) ride in their
  unit's gathers, but they break the rule above that frees a unit once its gradients are in:
  a node that saved a frozen parameter computes no gradient for it, only for its other input
  (a frozen norm's weight is needed for the gradient of the block's input after every LoRA
  gradient of the block is in). So a forward pre-hook of a unit holding frozen parameters also
  registers a multi-grad hook (mode "all") on the forward's inputs that need a gradient (again
  in a recompute: reentrant checkpointing backpropagates through fresh inputs); the unit is
  freed once its gradients are in *and* every such hook has fired: then no node of the unit is
  left to run (each one leads to the unit's inputs or to its own parameters). A unit whose
  inputs need no gradient (the first block over a frozen embedding) is freed by its gradient
  count alone (every node of its graph leads to one of its parameters), and one with neither
  (a frozen root) at the end of backward. Such a unit is gathered at every pre-backward.

Every rank must run the same units in the same order: gathers, prefetches and reduce-scatters
are then issued in the same order everywhere (they depend only on the graph).

[Note: divergent paths]
A rank that takes another path (skips a block, stops generating earlier) would issue a
different all-gather than its peers: gloo aborts the process on a size mismatch, NCCL hangs
until its watchdog fires, and two units of one size silently exchange the wrong shards. So
before each all-gather (``check_paths=True``, the default) the ranks all-reduce (max) the pair
``(unit index, -unit index)``, 16 bytes: if the max and the min differ, every rank raises an
error naming its unit and the range of units the others asked for; a rank that issues nothing
leaves the others in that all-reduce, which raises within the process group's timeout (the
error names the unit). The pair is counted in the meter (``all_reduce``: 16 B x 2(N-1)/N per
gather) and costs one small round trip before each gather; on a GPU it also waits for the
device (``.tolist()``), which is why it can be switched off once a model's paths are known
to agree. ``step()`` runs the same check first, with the index ``len(units)``: a rank that
skipped a backward meets its peers' backward gathers there, not with a reduce-scatter.
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Callable, Iterator, List, Optional, Sequence

import torch
import torch.nn as nn

from ...comm.base import CollectiveError, Comm, Handle
from ...layout import FlatLayout
from ...ops import OpSet
from ..planning.unit_plan import ROOT_NAME, plan_units
from .unit_state import SchedulePhase, TrainingState, move
from .units import (FlatParamUnit, build_flat_unit, build_frozen_unit, frozen_compute_dtype,
                    hook_grads, remove_hooks)


class GatherUnit:
    """One stage-3 unit: a module and its FlatParamUnits (one per param group, and its frozen
    ones). It owns its step ([Note: stage-3 gather schedule]): gathers, frees, hooks its own
    parameters, and moves through its ``state`` ([Note: unit states] in ``unit_state.py``);
    the schedule decides when."""

    def __init__(self, name: str, module: nn.Module, flats: Sequence[FlatParamUnit]) -> None:
        self.name = name
        self.module = module
        self.flats = list(flats)
        for i, f in enumerate(self.flats):  # for the errors of [Note: unit states]
            f.gather.name = f"unit {name!r} (flat {i})"
            f.gather.param_names = f.names  # for [Note: reading a freed parameter]
        self.is_root = name == ROOT_NAME
        self.nbytes = sum(f.layout.padded_numel * f.gather.compute_shard.element_size()
                          for f in self.flats)
        # Trainable parameters (their gradients are counted); frozen ones are gathered only.
        self.param_ids = {id(p) for f in self.flats if not f.frozen for p in f.params}
        self.frozen_ids = {id(p) for f in self.flats if f.frozen for p in f.params}
        self.state = TrainingState.IDLE
        self.keep_after_forward = False  # reshard_after_forward=False (set by the schedule)
        self.depth = 0              # its forwards running (a module may call itself)
        self.pins = 0               # gathered() contexts holding it
        self.input_hooks = 0        # frozen: input-gradient hooks registered, not yet fired
        self.accumulated: set = set()  # ids of the parameters whose gradients are in
        self._bucket_of: dict = {}  # id(param) -> its flat's gradient bucket

    def move(self, new: TrainingState) -> None:
        self.state = move(f"unit {self.name!r}", self.state, new)

    @property
    def allocated(self) -> bool:
        """Full buffers allocated (gathered, or a gather in flight)."""
        return any(f.gather.full is not None for f in self.flats)

    @property
    def kept(self) -> bool:
        """Gathered from its forward to its backward, outside the prefetch bound."""
        return self.keep_after_forward and self.state in (TrainingState.POST_FORWARD,
                                                          TrainingState.PRE_BACKWARD)

    @property
    def grads_pending(self) -> bool:
        return len(self.accumulated) < len(self.param_ids)

    @property
    def needs_backward(self) -> bool:
        """A node of backward may still read the unit's parameters."""
        return self.grads_pending or self.input_hooks > 0

    def start(self, comm: Comm) -> List[Handle]:
        """Start gathering every flat not gathered (collective)."""
        return [f.gather.ensure_gathered(comm, tag=f"unit {self.name}") for f in self.flats]

    def wait(self, handles: List[Handle]) -> None:
        try:
            for h in handles:
                h.wait()
        except Exception as exc:  # noqa: BLE001 - re-raised with the unit's name
            raise _with_unit(exc,
                f"stage 3: the all-gather of unit {self.name!r} failed ({exc}). Every rank must "
                f"run the same units in the same order: a rank whose forward or backward takes "
                f"another path (skips or repeats a unit, stops early) leaves the others "
                f"waiting") from exc

    def free(self) -> None:
        """Release the full buffers (and a secondary chunk), unless ``gathered()`` pins it."""
        if self.pins == 0:
            for f in self.flats:
                f.gather.free()

    def begin_forward(self) -> None:  # outside backward; a repeated call keeps POST_FORWARD
        self.move(self.state if self.state is TrainingState.POST_FORWARD
                  else TrainingState.FORWARD)

    def end_forward(self, autograd: bool) -> None:  # autograd: a backward will need it
        if autograd:
            self.move(TrainingState.POST_FORWARD)
        elif self.state is TrainingState.FORWARD and self.depth == 0:
            self.move(TrainingState.IDLE)

    def install_hooks(self, buckets: Sequence) -> None:
        """Hook each trainable parameter (its gradient goes to its flat's bucket, among
        ``buckets``) and, with frozen parameters, the forward's inputs. Held weakly."""
        mine = {id(f) for f in self.flats}
        for b in buckets:
            if id(b.unit) in mine:
                self._bucket_of.update((id(p), b) for p in b.unit.params)
        hook_grads(self, [p for f in self.flats if not f.frozen for p in f.params], "_on_grad")
        if self.frozen_ids:
            this = weakref.ref(self)
            weakref.finalize(self, remove_hooks, [self.module.register_forward_pre_hook(
                lambda m, args, kwargs: this() and this().watch_inputs(args, kwargs),
                with_kwargs=True)])

    def _on_grad(self, p: torch.Tensor) -> None:
        bucket = self._bucket_of.get(id(p))
        if bucket is not None:
            bucket.on_grad(p)  # pack, and launch once the flat's gradients are all in
        self.accumulated.add(id(p))
        self._maybe_done()

    def watch_inputs(self, args, kwargs) -> None:
        """A unit holding frozen parameters: count its forward's inputs' gradients (see
        [Note: stage-3 gather schedule])."""
        if not torch.is_grad_enabled():
            return
        tensors = _grad_tensors(list(args)) + _grad_tensors(dict(kwargs or {}))
        if not tensors:
            return
        self.input_hooks += 1
        this = weakref.ref(self)
        torch.autograd.graph.register_multi_grad_hook(
            tensors, lambda g: this() and this()._on_input_grad(), mode="all")

    def _on_input_grad(self) -> None:
        if self.input_hooks == 0:  # a hook of a backward already closed
            return
        self.input_hooks -= 1
        self._maybe_done()

    def _maybe_done(self) -> None:
        if not self.needs_backward and self.depth == 0:
            self.move(TrainingState.POST_BACKWARD)
            self.free()

    def end_backward(self) -> None:
        """Reset (FORWARD where its forward still runs: a backward inside a forward)."""
        self.accumulated.clear()
        self.input_hooks = 0
        self.state = TrainingState.FORWARD if self.depth else TrainingState.IDLE


class _Order:
    """Predicts the next unit from the previous pass's sequence of units."""

    def __init__(self, initial: List[GatherUnit]) -> None:
        self.prev, self.now, self.ok = list(initial), [], True

    def begin(self, predicted: Optional[List[GatherUnit]] = None) -> None:
        if predicted is not None:
            self.prev = predicted
        self.now, self.ok = [], True

    def observe(self, u: GatherUnit) -> Optional[GatherUnit]:
        k = len(self.now)
        self.now.append(u)
        if self.ok and k < len(self.prev) and self.prev[k] is u:
            return self.prev[k + 1] if k + 1 < len(self.prev) else None
        self.ok = False  # the path changed: no prediction for the rest of this pass
        return None

    def end(self) -> None:
        if self.now:
            self.prev = self.now
        self.now = []


def _grad_tensors(out) -> List[torch.Tensor]:
    """The tensors that need a gradient in a forward's inputs or output, found as FSDP2's
    hooks find them: through tuples (namedtuples), lists, dicts, sets and dataclasses, nested
    (a block that returns a ``@dataclass`` must get its pre-backward hook too, or its
    backward runs on freed parameters)."""
    found: List[torch.Tensor] = []
    stack, seen = [out], set()
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            if o.requires_grad:
                found.append(o)
        elif isinstance(o, (list, tuple, set, frozenset, dict)) or (
                dataclasses.is_dataclass(o) and not isinstance(o, type)):
            if id(o) in seen:  # a structure that holds itself
                continue
            seen.add(id(o))
            if isinstance(o, dict):
                stack.extend(reversed(list(o.values())))
            elif isinstance(o, (list, tuple)):
                stack.extend(reversed(o))
            elif isinstance(o, (set, frozenset)):
                stack.extend(o)
            else:
                stack.extend(reversed([getattr(o, f.name) for f in dataclasses.fields(o)]))
    return found


class GatherSchedule:
    """The module hooks of [Note: stage-3 gather schedule] on one model: when each unit
    gathers and frees (order, prefetch, the path check, pins, the end of backward); the units
    do it.

    Args:
        units: the GatherUnits in module order, the root last.
        comm: the collectives (metered).
        grad_buckets: the gradient strategy's buckets (``grad_reducers.GradBucket``, one per
            trainable flat); each unit binds its own and hooks its parameters.
        reshard_after_forward: free a unit after its forward (True) or keep it for backward
            (False), or an int R: keep a chunk over R ranks for backward ([Note: secondary
            shards] in ``secondary.py``; the units' gather policies hold them).
        check_paths: check before each all-gather that every rank gathers the same unit
            (see [Note: divergent paths]).
        on_end_backward: called at the end of each backward that completed, after the units
            are freed (the gradient strategy's ``end_backward``: [Note: reduce buffers end
            with backward] in ``grad_reducers.py``).
    """

    def __init__(self, units: Sequence[GatherUnit], comm: Comm, reshard_after_forward: bool,
                 check_paths: bool = True,
                 grad_buckets: Sequence = (),
                 on_end_backward: Optional[Callable[[], None]] = None) -> None:
        self.units = list(units)
        self._on_end_backward = on_end_backward
        self._keys_only = 0  # > 0 inside sharded_state_dict_keys()
        self.check_paths = bool(check_paths) and comm.world_size > 1
        self._index = {id(u): i for i, u in enumerate(self.units)}
        self.root = self.units[-1]
        self.comm = comm
        self.reshard_after_forward = bool(reshard_after_forward)
        self.reshard_to = None if isinstance(reshard_after_forward, bool) \
            else int(reshard_after_forward)
        # The bound on gathered bytes a prefetch may bring the total to.
        self.limit_bytes = self.root.nbytes + 2 * max((u.nbytes for u in self.units[:-1]),
                                                      default=0)
        self._fwd = _Order(self.units)  # module order until a forward is seen
        self._bwd = _Order([])
        self.phase = SchedulePhase.IDLE   # [Note: unit states]
        self.gathers = 0
        self.peak_bytes = 0
        this = weakref.ref(self)

        def pre(u):
            return lambda m, args: this() and this()._pre_forward(u)

        def post(u):
            return lambda m, args, out: this() and this()._post_forward(u, out)

        def state_dict_check(module, prefix, keep_vars):
            if this() is not None:
                this()._check_state_dict()

        handles = [self.root.module.register_state_dict_pre_hook(state_dict_check)]
        for u in self.units:
            u.keep_after_forward = not self.reshard_after_forward and bool(u.flats)
            handles.append(u.module.register_forward_pre_hook(pre(u)))
            handles.append(u.module.register_forward_hook(post(u), always_call=True))
            u.install_hooks(grad_buckets)
        weakref.finalize(self, remove_hooks, handles)

    # -- gathering --------------------------------------------------------------------------

    @property
    def in_backward(self) -> bool:
        return self.phase is SchedulePhase.BACKWARD

    def live_bytes(self, transient_only: bool = False) -> int:
        return sum(u.nbytes for u in self.units
                   if u.allocated and not (transient_only and u.kept))

    def _name_at(self, index: int) -> str:
        return "step()" if index == len(self.units) else repr(self.units[index].name)

    def _check_same_point(self, index: int, device: torch.device) -> None:
        """[Note: divergent paths]: every rank is about to gather unit ``index``, or (index ==
        len(units)) to enter ``step()``."""
        what = self._name_at(index)
        doing = "enter step()" if index == len(self.units) else f"gather unit {what}"
        pair = torch.tensor([index, -index], dtype=torch.int64, device=device)
        try:
            self.comm.all_reduce(pair, op="max").wait()
        except Exception as exc:  # noqa: BLE001 - re-raised with the unit's name
            raise _with_unit(exc,
                f"stage 3: rank {self.comm.rank} waited to {doing} and its peers did not join "
                f"({exc}). Every rank must run the same units in the same order: a rank whose "
                f"forward or backward takes another path leaves the others waiting") from exc
        hi, lo = pair.tolist()
        lo = -lo
        if hi != lo:
            raise RuntimeError(
                f"stage 3: ranks disagree on what comes next: rank {self.comm.rank} is about to "
                f"{doing}, the ranks' next points range from {self._name_at(lo)} to "
                f"{self._name_at(hi)} (units in module order, then step()). Every rank must run "
                f"the same units in the same order (a forward that skips or repeats a block on "
                f"some ranks, a backward that one rank skips, or generation that stops at "
                f"different lengths, diverges); gather the model once with opt.gathered() "
                f"around such loops. A block that routes differently per rank on purpose "
                f"(mixture-of-experts experts chosen per rank) must be one unit: pass "
                f"ZeroOptimizer(..., units=[TheMoEBlockClass or the block]) so the whole "
                f"block is gathered at once (DeepSpeed's leaf modules)")

    def check_step(self) -> None:
        """Before ``step()``'s collectives: a rank that skipped a backward (or a forward) would
        otherwise meet its peers' backward gathers with its reduce-scatters ([Note: divergent
        paths]); here both sides raise instead."""
        if self.check_paths:
            device = next((u.flats[0].device for u in self.units if u.flats), None)
            if device is not None:
                self._check_same_point(len(self.units), device)

    def _start(self, u: GatherUnit) -> List[Handle]:
        fresh = sum(f.gather.full is None for f in u.flats)  # flats a gather allocates now
        if fresh and self.check_paths:
            self._check_same_point(self._index[id(u)], u.flats[0].device)
        self.gathers += fresh
        handles = u.start(self.comm)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes())
        return handles

    def gather(self, u: GatherUnit) -> None:
        u.wait(self._start(u))

    def _prefetch(self, u: Optional[GatherUnit]) -> None:
        if u is None or u.allocated or not u.flats:
            return
        if self.live_bytes(transient_only=True) + u.nbytes <= self.limit_bytes:
            self._start(u)

    def free_all(self) -> None:
        for u in self.units:
            if u.allocated and u.depth == 0:
                u.free()

    # -- hooks ------------------------------------------------------------------------------

    def _pre_forward(self, u: GatherUnit) -> None:
        if self.in_backward and torch._C._current_graph_task_id() == -1:
            # A backward that raised never ran its end-of-backward callback: close it now
            # (its gradients wait for step() or zero_grad(), as before).
            self._end_backward(completed=False)
        nxt = None  # in backward: a recompute (activation checkpointing), gathered, never freed
        if not self.in_backward:
            if u.is_root and u.depth == 0:
                self._fwd.begin()
            nxt = self._fwd.observe(u)
            u.begin_forward()
        self.gather(u)
        u.depth += 1
        self._prefetch(nxt)

    def _post_forward(self, u: GatherUnit, out) -> None:
        u.depth -= 1
        if self.in_backward:
            return
        tensors = _grad_tensors(out) if torch.is_grad_enabled() else []
        if tensors:
            this = weakref.ref(self)
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda g: this() and this()._pre_backward(u), mode="any")
        u.end_forward(bool(tensors))
        if u.depth == 0 and not u.kept:
            if self.reshard_to is not None and tensors and u.pins == 0:
                for f in u.flats:   # backward gathers from the secondary group
                    f.gather.reshard()
            else:
                u.free()
        if u.is_root and u.depth == 0:
            self._fwd.end()
            for v in self.units:  # prefetched but not run: nothing stays gathered
                if v.allocated and v.depth == 0 and not v.kept:
                    v.free()

    def _pre_backward(self, u: GatherUnit) -> None:
        if not self.in_backward:
            self.phase = move("the gather schedule", self.phase, SchedulePhase.BACKWARD)
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            if not self._bwd.prev:
                fwd = [v for v in self._fwd.prev if not v.is_root]
                self._bwd.begin([self.root] + fwd[::-1])
            else:
                self._bwd.begin()
        nxt = self._bwd.observe(u)
        u.move(TrainingState.PRE_BACKWARD)
        if u.flats and (u.frozen_ids or u.grads_pending):
            self.gather(u)
        if nxt is not None and nxt.needs_backward:
            self._prefetch(nxt)

    def _end_backward(self, completed: bool = True) -> None:
        self.phase = move("the gather schedule", self.phase, SchedulePhase.IDLE)
        self._bwd.end()
        for u in self.units:
            u.end_backward()
        self.free_all()
        if completed and self._on_end_backward is not None:
            self._on_end_backward()

    @contextlib.contextmanager
    def sharded_state_dict_keys(self) -> Iterator[None]:
        """Allow ``model.state_dict()`` while units are freed, for callers that read only its
        keys, buffers and frozen parameters (zkernels.checkpoint): the sharded parameters are
        empty tensors there, and the caller takes their values from the shards."""
        self._keys_only += 1
        try:
            yield
        finally:
            self._keys_only -= 1

    def _check_state_dict(self) -> None:
        if self._keys_only:
            return
        freed = [u.name for u in self.units if u.flats and not u.allocated]
        if freed:
            raise RuntimeError(
                f"stage 3: model.state_dict() while the parameters are sharded (units "
                f"{freed} are not gathered; their parameters are empty): call it inside "
                f"`with opt.gathered():` on every rank (a collective), or save per shard with "
                f"opt.state_dict()")

    # -- public -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def gathered(self, units: Sequence[GatherUnit]) -> Iterator[None]:
        """Gather ``units`` for the block and free them after (unless still needed)."""
        for u in units:
            u.pins += 1
        try:
            pending = [(u, self._start(u)) for u in units]
            for u, hs in pending:
                u.wait(hs)
            yield
        finally:
            for u in units:
                u.pins -= 1
                if u.pins == 0 and u.depth == 0 and not u.kept and not self.in_backward:
                    u.free()

    def close_step(self) -> dict:
        """This step's gather counters (then reset)."""
        out = {"all_gathers": self.gathers, "peak_gathered_bytes": self.peak_bytes}
        self.gathers = 0
        self.peak_bytes = self.live_bytes()
        return out


def build_units(model: nn.Module, units, group_of: dict, names: dict, world_size: int,
                rank: int, align: int, compute_dtype: torch.dtype, ops: OpSet,
                shard_update, storage, materializer=None) -> tuple:
    """Plan the units of ``model`` (``unit_plan.plan_units``) and build their flat sharded
    buffers, one FlatParamUnit per (unit, param group), each state initialized at once (so only
    one unit's full fp32 copy exists at a time).

    Args:
        group_of: ``id(param) -> param group index`` of every trainable parameter.
        names: ``units.param_names(model)``.
        shard_update: the update strategy: its ``init_state`` is called per flat unit.
        storage: where the persistent parameter shards live ([Note: shard storage] in
            ``storage.py``): it keeps each flat's shard.
        materializer: a :class:`~zkernels.zero.parameters.meta_init.MetaMaterializer` (a
            meta-device model) or None: each unit is materialized just before it is sharded.

    Returns:
        ``(flat_units, gather_units)``: flat units in launch order (backward order: the last
        unit first, the root last: the gradient strategy launches reduce-scatters in it) and
        the GatherUnits in module order, the root last. A GatherUnit's ``flats`` also hold its
        frozen flat units (``FlatParamUnit.frozen``, see [Note: frozen parameters at stage 3]),
        which are not in ``flat_units``.
    """
    specs = plan_units(model, units, [p for p in model.parameters() if id(p) in group_of])
    flats_of: dict = {id(s.module): [] for s in specs}
    # Frozen flat units are numbered in module order, one per unit and dtype the shards keep.
    frozen_by_spec, first_frozen, n_frozen = [], {}, 0
    for spec in specs:
        by_dtype: dict = {}
        for p in spec.frozen:
            by_dtype.setdefault(frozen_compute_dtype(p, compute_dtype), []).append(p)
        frozen_by_spec.append(by_dtype)
        first_frozen[id(spec.module)], n_frozen = n_frozen, n_frozen + len(by_dtype)
    frozen: List[Optional[FlatParamUnit]] = [None] * n_frozen
    flat_units: List[FlatParamUnit] = []
    order = list(range(len(specs)))
    for si in order[:-1][::-1] + order[-1:]:
        spec = specs[si]
        if materializer is not None:  # [Note: meta-device build] in meta_init.py
            materializer.materialize(spec)
        for k, (dtype, ps) in enumerate(frozen_by_spec[si].items()):
            layout = FlatLayout.build([p.numel() for p in ps], world_size, align)
            fi = first_frozen[id(spec.module)] + k
            frozen[fi] = build_frozen_unit(fi, ps, names, layout, rank, dtype, storage)
            flats_of[id(spec.module)].append(frozen[fi])
        mine = []
        for gi in sorted({group_of[id(p)] for p in spec.params}):
            ps = [p for p in spec.params if group_of[id(p)] == gi]
            layout = FlatLayout.build([p.numel() for p in ps], world_size, align)
            unit, initial = build_flat_unit(len(flat_units), gi, ps, names, layout, rank,
                                            compute_dtype, ops, storage)
            shard_update.init_state(unit, initial)
            del initial
            flat_units.append(unit)
            mine.append(unit)
        flats_of[id(spec.module)][:0] = mine
    gather_units = [GatherUnit(s.name, s.module, flats_of[id(s.module)]) for s in specs]
    return flat_units, gather_units


def _with_unit(exc: Exception, message: str) -> Exception:
    """``message`` (which names the unit) as the error to raise from ``exc``: a
    CollectiveError stays one, keeping its collective, bytes and tag; anything else becomes a
    RuntimeError."""
    if isinstance(exc, CollectiveError):
        return CollectiveError(message, collective=exc.collective, nbytes=exc.nbytes,
                               tag=exc.tag)
    return RuntimeError(message)
