"""An element-wise ``torch.optim`` class run on this rank's shard of one unit.

[Note: torch.optim on pieces]
See [Note: optimizer rules] in ``planning/optimizer_spec.py``. Each parameter overlapping
this rank's shard contributes one *piece*: a 1-D view of the unit's fp32 master shard
(``unit.param_slices_in_shard()``), which is the parameter the class's instance steps. At
each step the gradient shard is copied to fp32 and divided by the step's ``grad_scale`` (1/N,
loss scale, clipping: one temporary of the shard's size, so the shard a later backward may
add to is left as torch leaves ``.grad``), each piece's ``.grad`` is the matching view, and the
instance's one group takes the ZeroOptimizer group's current hyperparameters (a scheduler's
lr applies at the next step, as with torch). The class creates its state lazily at its first
step; after every step each element-wise state tensor (one value per element of the piece)
is moved into one flat [shard_numel] fp32 buffer per state key, so the state is sharded with
the master and counted by ``stats()``; 0-dim state (``step``, ASGD's ``eta``/``mu``) stays
per piece. Classes update their state in place, so after the first step no copy is made
(a class that replaced a tensor would be copied back, still correct). ``foreach`` is left to
the class's own default (torch picks it on CUDA tensors) unless the user sets it.
"""
from __future__ import annotations

import inspect
from typing import Dict, List, Optional, Tuple

import torch

from ..planning.optimizer_spec import OptimizerSpec


def load_piece(flat: Dict[str, torch.Tensor], master: torch.Tensor, key: str,
               t: torch.Tensor, start: int, n: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Copy a piece's element-wise state ``t`` into ``flat[key]`` (a [shard_numel] buffer of
    ``dtype`` beside ``master``, made on first use) at ``start``; return the piece's view of it.

    Raises:
        ValueError: ``t`` does not have the piece's ``n`` elements.
    """
    if t.numel() != n:
        raise ValueError(f"state {key!r} has {t.numel()} elements, the piece {n}")
    if key not in flat:
        flat[key] = torch.zeros_like(master, dtype=dtype)
    view = flat[key][start:start + n]
    view.copy_(t.reshape(-1))
    return view


class FlatStateRule:
    """What the piece rules share: their ``master`` and its ``flat`` state buffers (state
    key -> [shard_numel] fp32), given up and adopted around a swap ([Note: rule state on
    NVMe] in ``rule_swap.py``)."""

    master: torch.Tensor
    flat: Dict[str, torch.Tensor]
    state_dtype: torch.dtype = torch.float32   # the flat buffers' (a fused rule's bf16 form)

    def master_written(self) -> None:
        """The master was written from outside a step (nothing to do: the rule reads it)."""

    def held(self) -> List[torch.Tensor]:
        """The flat state buffers (for ``stats()``)."""
        return list(self.flat.values())

    def detach(self) -> Dict[str, torch.Tensor]:
        """Give up the flat buffers (returned)."""
        flat, self.flat = self.flat, {}
        return flat

    def use_master(self, master: torch.Tensor) -> None:
        """Step ``master`` from now on (read in from its file, or a placeholder)."""
        self.master = master

    def attach(self, flat: Dict[str, torch.Tensor]) -> None:
        """Adopt flat buffers (:meth:`detach`'s, read back)."""
        self.flat = dict(flat)


class TorchShardRule(FlatStateRule):
    """A ``torch.optim`` instance over one unit's pieces (see [Note: torch.optim on pieces]).

    Args:
        spec: the group's :class:`OptimizerSpec` (a torch class).
        master: [shard_numel] fp32 master shard (where the state lives: device or host).
        slices: ``(start in the shard, length)`` of each piece.

    Attributes:
        flat: state key -> [shard_numel] fp32 buffer (after the first step).
    """

    def __init__(self, spec: OptimizerSpec, master: torch.Tensor,
                 slices: List[Tuple[int, int]]) -> None:
        self.spec, self.master, self.slices = spec, master, slices
        self.pieces = [master[s:s + n] for s, n in slices]
        self.flat: Dict[str, torch.Tensor] = {}
        self.inner: Optional[torch.optim.Optimizer] = None   # built at the first step

    def _hparams(self, group: dict) -> dict:
        return {k: group[k] for k in self.spec.defaults if k in group}

    def step(self, grad: torch.Tensor, group: dict, grad_scale,
             live: Optional[List[bool]] = None) -> None:
        """One step of the class on the pieces from ``grad`` ([shard_numel], to be divided
        by ``grad_scale``); ``live``: a flag per piece (its parameter has a gradient this
        step; None: all have), a piece without one keeps ``.grad`` None, so the class skips
        it as torch.optim skips a parameter whose gradient is None."""
        if not self.pieces:
            return
        if self.inner is None:
            self._build(group)
        # A new fp32 tensor (a bf16 shard widened, stage 1's reduce dtype): the class may
        # write its gradients in place (foreach with maximize), the shard stays as it was.
        g = grad.float() if grad.dtype != torch.float32 else grad.clone()
        if grad_scale is not None:
            g.div_(grad_scale)
        self.inner.param_groups[0].update(self._hparams(group))
        for k, (p, (s, n)) in enumerate(zip(self.pieces, self.slices)):
            p.grad = g[s:s + n] if live is None or live[k] else None
        try:
            self.inner.step()
        finally:
            for p in self.pieces:
                p.grad = None
        self._flatten()

    def _flatten(self) -> None:
        for p, (s, n) in zip(self.pieces, self.slices):
            st = self.inner.state[p]
            for k, t in st.items():
                if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.numel() != n:
                    continue
                if k not in self.flat:
                    self.flat[k] = torch.zeros_like(self.master)
                view = self.flat[k][s:s + n]
                if t.data_ptr() != view.data_ptr():
                    view.copy_(t.reshape(-1))
                    st[k] = view.view_as(t)

    def _build(self, group: dict) -> None:
        # (keywords its constructor takes: AdamW's defaults carry one it does not)
        sig = inspect.signature(self.spec.cls.__init__).parameters
        takes_all = any(p.kind is p.VAR_KEYWORD for p in sig.values())
        self.inner = self.spec.cls(self.pieces, **{
            k: v for k, v in self._hparams(group).items() if takes_all or k in sig})

    def piece_states(self) -> List[Dict[str, torch.Tensor]]:
        """Each piece's state as the class keeps it (empty before the first step)."""
        if self.inner is None:
            return [{} for _ in self.pieces]
        return [dict(self.inner.state[p]) for p in self.pieces]

    def load(self, states: List[Dict[str, torch.Tensor]], group: dict) -> None:
        """Set each piece's state (element-wise tensors into the flat buffers, 0-dim ones
        copied), as :meth:`piece_states` gave them."""
        if not self.pieces:
            return
        if self.inner is None:
            self._build(group)
        for p, (s, n), st in zip(self.pieces, self.slices, states):
            new = {}
            for k, t in st.items():
                if isinstance(t, torch.Tensor) and t.dim() > 0:
                    new[k] = load_piece(self.flat, self.master, k, t, s, n)
                else:
                    new[k] = t.clone() if isinstance(t, torch.Tensor) else t
            self.inner.state[p] = new

    def detach(self) -> Dict[str, torch.Tensor]:
        """Give up the flat buffers (returned): the pieces' entries become meta placeholders
        until :meth:`attach` ([Note: rule state on NVMe] in ``rule_swap.py``)."""
        flat = super().detach()
        if self.inner is not None:
            for p in self.pieces:
                st = self.inner.state[p]
                for k in flat:
                    if k in st:
                        st[k] = torch.empty(st[k].shape, dtype=st[k].dtype, device="meta")
        return flat

    def use_master(self, master: torch.Tensor) -> None:
        """Step ``master`` from now on (a master read in from its file, or a placeholder
        between steps: [Note: rule state on NVMe] in ``rule_swap.py``): the pieces keep their
        identity (the class's state is keyed by them) and view it."""
        super().use_master(master)
        if self.inner is None:
            self.pieces = [master[s:s + n] for s, n in self.slices]
            return
        for p, (s, n) in zip(self.pieces, self.slices):
            p.data = master[s:s + n]

    def attach(self, flat: Dict[str, torch.Tensor]) -> None:
        """Adopt flat buffers (:meth:`detach`'s, read back): the pieces' entries view them."""
        super().attach(flat)
        if self.inner is not None:
            for p, (s, n) in zip(self.pieces, self.slices):
                st = self.inner.state[p]
                for k, t in self.flat.items():
                    if k in st:
                        st[k] = t[s:s + n].view(st[k].shape)
