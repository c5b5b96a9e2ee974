"""Stages 1-2 with ``overlap_param_gather=True``: ``step()`` returns with each unit's parameter
all-gather in flight, and the next forward waits for a unit's gather only when the first
module that owns one of its parameters runs.

[Note: lazy parameter gathers]
After the update, a replicated unit (``ReplicatedParams``) all-gathers every rank's new shard
into its full buffer, of which the parameters are views. Waiting for all of them inside
``step()`` leaves the network idle during the next forward and the cores idle during the
gathers. With ``overlap_param_gather=True`` the optimizer hands each gather's handle to a
:class:`ParamGatherWaiter` instead; a forward pre-hook on every module that owns parameters
(``parameters(recurse=False)``) waits for the gathers of the units those parameters belong to
(FSDP's rule for its prefetch), so the first layers compute while the last units still arrive.
The optimizer updates and gathers units in forward order (the reverse of the bucket order) so
that the gathers land in the order forward needs them.

The rule for code that reads parameters between steps: a module's own forward, its
``state_dict()`` and ``load_state_dict()`` wait (pre-hooks here), and so do the optimizer's
``step()``, ``state_dict()``, ``load_state_dict()`` and ``wait_params()``; anything else that
reads parameter values after ``step()`` (an EMA of the weights, logging a norm, a parameter
used by a module that does not own it) must call ``opt.wait_params()`` first. With the default
``overlap_param_gather=False``, ``step()`` is complete when it returns, as a
``torch.optim.Optimizer``'s is. Stage 3's units gather before their forward anyway (its own
hooks); this module is for replicated units only.
"""
from __future__ import annotations

import weakref
from typing import Dict, Sequence, Tuple

import torch.nn as nn

from ...comm.base import Handle
from .units import FlatParamUnit, remove_hooks


class ParamGatherWaiter:
    """Gathers in flight per unit, and the module hooks that wait for them.

    Args:
        model: the module whose parameters the units hold.
        units: the optimizer's units (replicated).
    """

    def __init__(self, model: nn.Module, units: Sequence[FlatParamUnit]) -> None:
        unit_of = {id(p): u.index for u in units for p in u.params}
        self._pending: Dict[int, Handle] = {}  # unit index -> handle, in launch order
        this = weakref.ref(self)
        handles = []
        for mod in model.modules():
            idx = tuple(sorted({unit_of[id(p)] for p in mod.parameters(recurse=False)
                                if id(p) in unit_of}))
            if not idx:
                continue
            handles.append(mod.register_forward_pre_hook(_Wait(this, idx)))
            handles.append(mod.register_state_dict_pre_hook(_Wait(this, idx)))
            handles.append(mod.register_load_state_dict_pre_hook(_Wait(this, idx)))
        # The hooks hold the waiter weakly and go with it (a dropped optimizer leaves none).
        weakref.finalize(self, remove_hooks, handles)

    def add(self, unit_index: int, handle: Handle) -> None:
        """``unit_index``'s gather is in flight (a previous one is waited for first)."""
        self.wait((unit_index,))
        self._pending[unit_index] = handle

    def wait(self, unit_indices: Tuple[int, ...]) -> None:
        for i in unit_indices:
            h = self._pending.pop(i, None)
            if h is not None:
                h.wait()

    def wait_all(self) -> None:
        """Every gather in flight, in launch order."""
        while self._pending:
            self.wait((next(iter(self._pending)),))

    @property
    def in_flight(self) -> int:
        return len(self._pending)


class _Wait:
    """A module hook (any signature) that waits for its units' gathers."""

    def __init__(self, waiter: "weakref.ref[ParamGatherWaiter]", unit_indices: Tuple[int, ...]):
        self._waiter, self._idx = waiter, unit_indices

    def __call__(self, *args, **kwargs) -> None:
        waiter = self._waiter()
        if waiter is not None and waiter._pending:
            waiter.wait(self._idx)
