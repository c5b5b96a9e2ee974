"""Flat parameter units: the parameters of one flat, rank-aligned buffer, their names, and the
policy that says where the full compute copy lives (the optimizer state is elsewhere: see
``shard_state.py``).

[Note: parameters and state]
ZeRO's objects are split in two, so that each stage (and offload, and checkpoints) changes one
side only:

- a :class:`FlatParamUnit` is the parameter side: an ordered set of parameters (fully
  qualified names from ``model.named_parameters()``; a tied parameter has one canonical name
  and its aliases), their :class:`~zkernels.layout.FlatLayout`, the compute dtype, and a gather
  policy that owns the compute storage. :class:`ReplicatedParams` (stages 1-2) keeps the full
  compute buffer permanently, the parameters are permanent views of it, ``ensure_gathered`` and
  ``free`` do nothing and ``publish`` (after the update wrote this rank's shard) all-gathers
  the shards into the full buffer. A sharded policy (stage 3) keeps only this rank's compute
  shard persistently and allocates the full buffer in ``ensure_gathered``, frees it in ``free``
  (the interface is :class:`GatherPolicy`); the unit is the same object either way. Where the
  shard's bytes live (device, host RAM, a file) is the policy's composed ``shard``, kept by
  the storage object injected into the builders ([Note: shard storage] in ``storage.py``).
- a :class:`~zkernels.zero.state.shard_state.ShardState` is the optimizer side: this rank's fp32
  master shard, AdamW moments and step count of one unit. The update engine
  (``state/engine.py``) allocates the states from its injected place (the device, host RAM or
  NVMe: [Note: state places] in ``state/places.py``, which also carries the shards' storage),
  receives the reduced gradient shard per unit, and writes the updated compute shard back
  into the unit's ``compute_shard``. In pure fp32 the master *is*
  the unit's compute shard (a view: no extra memory).
- the gradient strategy (``grad_reducers.py``) owns gradient storage and reduce buffers: one
  bucket object per flat unit (or, at stage 3, per unit's trainable flat, called by the
  unit's :class:`~zkernels.zero.parameters.stage3.GatherUnit`) that owns its gradients' step.

A :class:`~zkernels.zero.unit.ZeroUnit` (``zkernels/zero/unit.py``: what happens to unit k)
holds a flat unit, its bucket and its ShardState and steps them; ``step()`` loops over them.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Protocol, Sequence, Tuple

import torch
import torch.nn as nn

from ...comm.base import Comm, Handle
from ...layout import FlatLayout
from ...ops import OpSet
from .freed_guard import guard, unguard
from .storage import DeviceShard
from .unit_state import ShardedState, move

_ALLOCATED = (ShardedState.UNSHARDING, ShardedState.UNSHARDED)


class _Done:
    def wait(self) -> None:
        return None


class GatherPolicy(Protocol):
    """Where a unit's compute copy lives and how it is (re)built. Implemented by
    :class:`ReplicatedParams` (stages 1-2); stage 3's sharded policy implements the same.
    ``is_gathered``: whether ``full`` holds the current parameters."""

    shard: DeviceShard  # this rank's persistent shard, wherever its bytes live (storage.py)
    compute_shard: torch.Tensor  # its ``values``: the update writes them
    full: Optional[torch.Tensor]  # [padded_numel], the parameters are views of it; or None

    @property
    def is_gathered(self) -> bool: ...

    def ensure_gathered(self, comm: Comm, tag: Optional[str] = None) -> Handle:
        """Start building ``full`` (if needed); after ``wait()`` the parameters are views of
        it. ``tag`` names the unit in a collective's error."""

    def free(self) -> None:
        """Give back ``full`` (where the policy may: replicated units keep it)."""

    def publish(self, comm: Comm) -> Handle:
        """``compute_shard`` changed (the update): make every rank's copy current."""

    def held(self) -> List[torch.Tensor]:
        """Parameter storage held now (for ``stats()``)."""


class ReplicatedParams:
    """Stages 1-2: the full compute buffer is permanent and the parameters are permanent views.

    Args:
        full: [padded_numel] compute dtype buffer.
        shard: this rank's slice of it.
    """

    def __init__(self, full: torch.Tensor, shard: slice) -> None:
        self.full = full
        self.shard = DeviceShard(full[shard])
        self.compute_shard = self.shard.values

    @property
    def is_gathered(self) -> bool:
        return True

    def ensure_gathered(self, comm: Comm, tag: Optional[str] = None) -> Handle:
        return _Done()

    def free(self) -> None:
        return None

    def publish(self, comm: Comm) -> Handle:
        """All-gather every rank's updated shard into the full buffer (in place)."""
        return comm.all_gather(self.full, self.compute_shard)

    def held(self) -> List[torch.Tensor]:
        """Parameter storage held between steps (for ``stats()``)."""
        return [self.full]


class _Gathering:
    """The handle of a gather in flight: waiting completes it once (UNSHARDING -> UNSHARDED)."""

    def __init__(self, owner: "ShardedParams", handle: Handle) -> None:
        self._owner, self._handle = owner, handle

    def wait(self) -> None:
        if self._owner._gathering is self:
            self._handle.wait()
            self._owner._gathering = None
            self._owner._move(ShardedState.UNSHARDED)


class ShardedParams:
    """Stage 3's policy: only the compute shard is persistent; the full buffer exists between
    :meth:`ensure_gathered` and :meth:`free` (its ``state``: [Note: unit states]).

    While gathered the parameters are views of one full tensor whose *storage* is released on
    ``free`` and re-allocated on ``ensure_gathered`` (as FSDP1 does), so views that autograd
    saved in forward are valid again once the unit is gathered for backward.

    [Note: freed parameters are empty]
    While freed, each parameter's ``.data`` is an empty (0-element) tensor of the compute dtype:
    reading a view of a storage resized to 0 bytes dereferences a null pointer (a segfault, not
    an error), whereas an empty parameter makes any use fail with a shape error, and
    ``p.numel() == 0`` says it is sharded (FSDP1's flat parameters look the same outside their
    unit). Autograd saves a leaf parameter by reference, so it sees the views again in
    backward; ``.data`` assignment keeps the parameter's version counter. A freed plain
    ``nn.Parameter`` also refuses to be computed with, naming itself: [Note: reading a freed
    parameter] (``freed_guard.py``).

    Args:
        params: the unit's parameters, in layout order; they become views of the full buffer.
        layout: the unit's layout.
        shard: this rank's persistent shard (owned), wherever its bytes live
            (:class:`~zkernels.zero.parameters.storage.DeviceShard` or one overriding it:
            [Note: shard storage]).
    """

    name = "a sharded flat"  # its GatherUnit's name
    param_names: Tuple[str, ...] = ()  # its parameters' names (set with the name)

    def __init__(self, params: Sequence[torch.Tensor], layout: FlatLayout,
                 shard: DeviceShard) -> None:
        compute_shard = shard.values
        if compute_shard.numel() != layout.shard_numel:
            raise ValueError(f"compute_shard has {compute_shard.numel()} elements, the layout's "
                             f"shard {layout.shard_numel}")
        self.shard, self.compute_shard, self.device = shard, compute_shard, shard.device
        self._full = torch.empty(layout.padded_numel, dtype=compute_shard.dtype,
                                 device=self.device)
        self._nbytes = self._full.untyped_storage().nbytes()
        self._params = list(params)
        self._views = [self._full[o:o + p.numel()].view(p.shape)
                       for p, o in zip(params, layout.offsets)]
        self._empty = torch.empty(0, dtype=compute_shard.dtype, device=self.device)
        self._gathering: Optional[_Gathering] = None  # the all-gather in flight (UNSHARDING)
        self.state = ShardedState.UNSHARDED  # built allocated, freed below
        # reshard_after_forward=R: the chunk kept from forward to backward (secondary.py)
        self.secondary = None
        self.free()

    def _move(self, new: ShardedState) -> None:
        self.state = move(self.name, self.state, new)

    @property
    def full(self) -> Optional[torch.Tensor]:
        return self._full if self.state in _ALLOCATED else None

    @property
    def shapes(self) -> List[torch.Size]:
        """The parameters' full shapes (``p.shape`` is empty while the unit is freed)."""
        return [v.shape for v in self._views]

    @property
    def is_gathered(self) -> bool:
        """The full buffer is allocated and no gather into it is in flight."""
        return self.state is ShardedState.UNSHARDED

    def ensure_gathered(self, comm: Comm, tag: Optional[str] = None) -> Handle:
        """Allocate the full buffer and start the all-gather of every rank's shard (after
        ``reshard``, the secondary group's chunks) into it, unless started. Collective."""
        if self.state in _ALLOCATED:
            return self._gathering or _Done()
        self._full.untyped_storage().resize_(self._nbytes)
        unguard(self._params)
        for p, v in zip(self._params, self._views):
            p.data = v
        chunk = self.state is ShardedState.SHARDED_POST_FORWARD  # within the smaller group
        self._move(ShardedState.UNSHARDING)
        self._gathering = _Gathering(self, self.secondary.gather_into(self._full, tag) if chunk
                                     else self.shard.issue_gather(self._full, comm, tag))
        return self._gathering

    def reshard(self) -> None:
        """After forward with ``reshard_after_forward=R``: keep this rank's secondary chunk
        ([Note: secondary shards]), free the full buffer; without one (frozen) :meth:`free`."""
        if self.secondary is None:
            self.free()
        elif self.state in _ALLOCATED:
            if self._gathering is not None:
                self._gathering.wait()
            self.secondary.keep(self._full)
            self._release(ShardedState.SHARDED_POST_FORWARD)

    def free(self) -> None:
        """Release the full buffer (after a gather in flight) and a secondary chunk."""
        self._release(ShardedState.SHARDED)
        if self.secondary is not None:
            self.secondary.drop()

    def _release(self, state: ShardedState) -> None:
        if self._gathering is not None:
            self._gathering.wait()
        for p in self._params:
            p.data = self._empty
        guard(self._params, self)
        self._full.untyped_storage().resize_(0)
        self._move(state)

    def publish(self, comm: Comm) -> Handle:
        """The shard changed: a full copy still held is stale, so it is freed; the next
        ``ensure_gathered`` reads the new shards."""
        self.free()
        return _Done()

    def held(self) -> List[torch.Tensor]:
        """Device parameter storage held (for ``stats()``): the shard where it is on the
        device, the full buffer while gathered, and a secondary chunk while kept."""
        return self.shard.held() + ([self._full] if self.full is not None else []) + \
            (self.secondary.held() if self.secondary is not None else [])


@dataclass
class FlatParamUnit:
    """One flat unit of parameters on this rank.

    Attributes:
        index: position in launch order (also the key of its ShardState and its state_dict
            entry).
        group_index: the param group all its parameters belong to.
        names: canonical fully qualified name of each parameter (``model.named_parameters()``).
        aliases: per parameter, the other names a tied parameter has (often empty).
        params: the parameters; while gathered ``params[i].data`` is a view of ``full`` at
            ``layout.offsets[i]``.
        layout: placement in the flat buffer.
        rank: this rank.
        compute_dtype: dtype of the compute copy (``param_dtype``).
        gather: the :class:`GatherPolicy` that owns the compute storage.
        frozen: stage 3's frozen parameters (``requires_grad=False``): gathered with their
            unit, never reduced or updated; no ShardState, not in ``opt.units`` (see
            [Note: frozen parameters at stage 3]); ``group_index`` is -1.
        shapes: every parameter's full shape (the gather policy's where it keeps them: a
            freed stage-3 parameter is empty).
    """

    index: int
    group_index: int
    names: Tuple[str, ...]
    aliases: Tuple[Tuple[str, ...], ...]
    params: List[torch.Tensor]
    layout: FlatLayout
    rank: int
    compute_dtype: torch.dtype
    gather: GatherPolicy
    frozen: bool = False
    shapes: Tuple[torch.Size, ...] = field(init=False)
    device: torch.device = field(init=False)

    def __post_init__(self) -> None:
        self.shapes = tuple(getattr(self.gather, "shapes", None) or
                            [p.shape for p in self.params])
        # The compute device (a shard whose bytes live elsewhere names it: storage.py).
        self.device = self.gather.shard.device

    @property
    def shard_slice(self) -> slice:
        lo, hi = self.layout.shard_range(self.rank)
        return slice(lo, hi)

    @property
    def compute_shard(self) -> torch.Tensor:
        """[shard_numel] compute-dtype view of this rank's slice (the update's output)."""
        return self.gather.compute_shard

    @property
    def shard(self) -> DeviceShard:
        """This rank's persistent shard: asked where its bytes live ([Note: shard storage])."""
        return self.gather.shard

    @property
    def full(self) -> Optional[torch.Tensor]:
        """[padded_numel] full compute buffer, or None while not gathered."""
        return self.gather.full

    @contextlib.contextmanager
    def shard_values(self, write_back: bool = False) -> Iterator[torch.Tensor]:
        """This rank's compute shard as a tensor with values: the shard itself where it is in
        memory; a host copy read from its file where it is on disk ([Note: parameters on
        NVMe] in ``param_nvme.py``), written back on exit with ``write_back``."""
        values = self.shard.read_values()
        yield values
        if write_back:
            self.shard.load_values(values)

    def param_slices_in_shard(self):
        """For each parameter overlapping this rank's shard, yield ``(name, start_in_param,
        start_in_shard, length)`` (flat element offsets; see
        ``FlatLayout.tensor_slices_in_shard``)."""
        for i, a, s, n in self.layout.tensor_slices_in_shard(self.rank):
            yield self.names[i], a, s, n


def param_names(model: nn.Module) -> Dict[int, Tuple[str, Tuple[str, ...]]]:
    """``id(param) -> (canonical name, aliases)``; the canonical name is the first under which
    ``model.named_parameters()`` yields it, aliases are its other (tied) names."""
    names: Dict[int, List[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return {k: (v[0], tuple(v[1:])) for k, v in names.items()}


def hook_grads(owner, params: Sequence[torch.Tensor], method: str) -> None:
    """A post-accumulate-grad hook on each of ``params`` that calls ``owner.<method>(p)``. The
    hooks hold ``owner`` weakly and are removed when it is collected, so a dropped optimizer
    leaves no hooks behind on the model."""
    this = weakref.ref(owner)

    def hook(p: torch.Tensor) -> None:
        alive = this()
        if alive is not None:
            getattr(alive, method)(p)

    handles = [p.register_post_accumulate_grad_hook(hook) for p in params]
    weakref.finalize(owner, remove_hooks, handles)


def remove_hooks(handles) -> None:
    for h in handles:
        h.remove()


def build_flat_unit(index: int, group_index: int, params: Sequence[torch.Tensor],
                    names: Dict[int, Tuple[str, Tuple[str, ...]]], layout: FlatLayout,
                    rank: int, compute_dtype: torch.dtype, ops: OpSet,
                    storage=None) -> Tuple[FlatParamUnit, torch.Tensor]:
    """Copy ``params`` into a new flat buffer: stages 1-2 (``storage`` None) keep the full
    compute buffer, the parameters views of it (:class:`ReplicatedParams`); stage 3 keeps this
    rank's compute shard only, where ``storage`` keeps it ([Note: shard storage]), in a
    :class:`ShardedParams` built freed.

    Returns:
        ``(unit, initial_master)``: this rank's shard of the original values in fp32 (taken
        before any cast, low-precision ones widened; in pure fp32 the unit's compute shard
        itself), which the update strategy turns into the unit's ShardState.
    """
    lo, hi = layout.shard_range(rank)
    fp32 = torch.zeros(layout.padded_numel, dtype=torch.float32, device=params[0].device)
    # bf16 / fp16 values widen exactly into the unit's fp32 buffer ([Note: low-precision
    # models] in groups.py); a unit of mixed dtypes (an explicit param_dtype allows them)
    # widens tensor by tensor, since one flatten call takes one dtype.
    values = [p.detach().contiguous() for p in params]
    if len({v.dtype for v in values}) > 1:
        values = [v.float() for v in values]
    with torch.no_grad():
        ops.flatten(values, out=fp32, offsets=layout.offsets)
    del values
    if storage is None:
        initial = fp32[lo:hi]
        compute = fp32 if compute_dtype == torch.float32 else ops.cast(fp32, compute_dtype)
        for p, v in zip(params, ops.unflatten(compute, [p.shape for p in params],
                                              offsets=layout.offsets)):
            p.data = v
        return _flat_unit(index, group_index, params, names, layout, rank, compute_dtype,
                          ReplicatedParams(compute, slice(lo, hi))), initial
    initial = fp32[lo:hi].clone()
    del fp32
    compute = initial if compute_dtype == torch.float32 else ops.cast(initial, compute_dtype)
    gather = ShardedParams(params, layout, storage.keep(compute, lo, hi))
    if compute_dtype == torch.float32 and not gather.shard.in_file:
        initial = gather.compute_shard  # the master starts as the (possibly moved) shard
    return _flat_unit(index, group_index, params, names, layout, rank, compute_dtype,
                      gather), initial


def _flat_unit(index, group_index, params, names, layout, rank, dtype, gather,
               frozen=False) -> FlatParamUnit:
    return FlatParamUnit(index, group_index, tuple(names[id(p)][0] for p in params),
                         tuple(names[id(p)][1] for p in params), list(params), layout, rank,
                         dtype, gather, frozen=frozen)


# [Note: frozen parameters at stage 3]
# A LoRA over a frozen base gains nothing from stage 3 unless the base is sharded too, so stage 3
# shards frozen parameters (``requires_grad=False``) like trainable ones, as FSDP2 and
# DeepSpeed ZeRO-3 do: each unit's frozen parameters go into flat units of their own
# (``FlatParamUnit.frozen``, one per compute dtype) that the unit's gathers all-gather and free
# with its trainable ones (one all-gather per flat unit). They have no ShardState, no gradient
# hook, no reduce-scatter and are never updated, so they are not in ``opt.units`` (whose
# indices the gradient and update strategies key on) but in ``opt.frozen_units``. A rank holds
# the compute copy's shard only: ``param_dtype`` where one is given (a frozen fp32 parameter
# under bf16 is kept and gathered in bf16: DeepSpeed's bf16 mode; nothing else computes with
# it), else the parameter's own dtype (a bf16 base stays bf16). Non-floating parameters keep
# their dtype. Stages 1-2 keep frozen parameters whole on every rank, untouched, as DDP does.


def frozen_compute_dtype(param: torch.Tensor, param_dtype: torch.dtype) -> torch.dtype:
    """The dtype stage 3 keeps a frozen parameter in (see [Note: frozen parameters at
    stage 3]): ``param_dtype`` for a floating parameter when it is narrower than fp32, else
    the parameter's own dtype."""
    if param_dtype != torch.float32 and param.is_floating_point():
        return param_dtype
    return param.dtype


def build_frozen_unit(index: int, params: Sequence[torch.Tensor],
                      names: Dict[int, Tuple[str, Tuple[str, ...]]], layout: FlatLayout,
                      rank: int, dtype: torch.dtype, storage) -> FlatParamUnit:
    """Stage 3: keep only this rank's ``dtype`` shard (:func:`frozen_compute_dtype`) of the
    frozen ``params`` (layout order; see [Note: frozen parameters at stage 3]), kept by
    ``storage`` and built freed as in :func:`build_flat_unit`; ``index`` among the optimizer's
    frozen flat units, ``group_index`` -1.
    """
    device = params[0].device
    lo, hi = layout.shard_range(rank)
    shard = torch.zeros(hi - lo, dtype=dtype, device=device)
    with torch.no_grad():
        for p, off in zip(params, layout.offsets):
            a, b = max(lo, off), min(hi, off + p.numel())
            if a < b:
                shard[a - lo:b - lo].copy_(p.detach().reshape(-1)[a - off:b - off])
    return _flat_unit(index, -1, params, names, layout, rank, dtype,
                      ShardedParams(params, layout, storage.keep(shard, lo, hi)), frozen=True)
