"""A fused element-wise optimizer on this rank's shard of one unit (``optimizer="lion"``,
``"sgd"``, or any other definition of ``zkernels.optimizers.REGISTRY`` but the fused AdamW).

[Note: fused element-wise rules]
A group whose optimizer is an element-wise definition (``zkernels.optimizers``: its states,
keywords, checks and per-step scalars, one object) runs ``zkernels.ops.optimizer_step`` (the
OpSet's backend: reference, Triton or the C++ SIMD path) over the unit's fp32 master shard in
one call, as the fused AdamW does: the gradient shard is read as fp32 and divided by the
step's ``grad_scale`` inside the op (no temporary). Its states are flat [shard_numel] buffers,
one per :class:`~zkernels.optimizers.StateSpec` present under the group's hyperparameters
(Lion's ``exp_avg``, SGD's ``momentum_buffer``, none for SGD without momentum), created at the
first step as torch creates its state, so the bytes per parameter are the definition's
``state_bytes`` (``OptimizerSpec.state_bytes``). The group's hyperparameters are resolved by
the definition at every step (a scheduler's lr applies at the next step) and its
``coefficients(h, step)`` are what the op reads. Each parameter keeps its own step count
(SGD's first step sets the buffer to the gradient, as torch.optim.SGD does); a parameter
without a gradient this step is skipped (its piece is not updated), so the op then runs per
live piece. A low-bit form the definition lists (``state_dtype="bf16"``) keeps the buffers in
bf16, which the op widens to fp32 before the math and rounds to nearest even after (the
definition's bf16 form). Checkpoints see the pieces' state under the definition's names with their
``step``, as a torch class's ([Note: torch.optim on pieces]). Nothing here names an
optimizer: a new definition runs through this rule unchanged.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from ...ops import OpSet
from ..planning.optimizer_spec import OptimizerSpec
from .torch_rule import FlatStateRule, load_piece


class FusedShardRule(FlatStateRule):
    """A fused element-wise definition over one unit's shard (see [Note: fused element-wise
    rules]).

    Args:
        spec: the group's :class:`OptimizerSpec` (``spec.definition`` not None).
        master: [shard_numel] fp32 master shard (the state lives beside it).
        slices: ``(start in the shard, length)`` of each piece.
        ops: the OpSet the update runs on (the device's, or the host's with offload).
        fmt: the group's low-bit :class:`~zkernels.zero.planning.state_format.StateFormat`
            (a form the definition lists, checked by ``group_formats``), or None (fp32).

    Attributes:
        flat: state name -> [shard_numel] buffer (after the first step).
    """

    def __init__(self, spec: OptimizerSpec, master: torch.Tensor,
                 slices: List[Tuple[int, int]], ops: OpSet, fmt=None) -> None:
        self.spec, self.master, self.slices, self.ops = spec, master, slices, ops
        self.defn = spec.definition
        self.state_dtype = torch.float32 if fmt is None else fmt.dtype
        self.flat: Dict[str, torch.Tensor] = {}
        self.steps = [0] * len(slices)

    def _call(self, a: int, b: int, grad: torch.Tensor, h: dict, grad_scale,
              step: int) -> None:
        bufs = (self.flat.get(s.name) for s in self.defn.states)
        self.ops.optimizer_step(self.defn, self.master[a:b], grad[a:b],
                                [None if t is None else t[a:b] for t in bufs],
                                self.defn.coefficients(h, step), grad_scale=grad_scale)

    def step(self, grad: torch.Tensor, group: dict, grad_scale,
             live: Optional[List[bool]] = None) -> None:
        """One step from ``grad`` ([shard_numel], divided by ``grad_scale`` in the op);
        ``live``: a flag per piece (None: all have a gradient)."""
        if not self.slices:
            return
        h = self.defn.resolve_group(group)
        for s, present in zip(self.defn.states, self.defn.present(h)):
            if present and s.name not in self.flat:
                self.flat[s.name] = torch.zeros_like(self.master, dtype=self.state_dtype)
        flags = [True] * len(self.slices) if live is None else list(live)
        for k, f in enumerate(flags):
            self.steps[k] += int(bool(f))
        if all(flags) and len(set(self.steps)) == 1:   # one call over the whole shard
            self._call(0, self.master.numel(), grad, h, grad_scale, self.steps[0])
            return
        for (s, n), f, st in zip(self.slices, flags, self.steps):
            if f:
                self._call(s, s + n, grad, h, grad_scale, st)

    def piece_states(self) -> List[Dict[str, torch.Tensor]]:
        """Each piece's state under the definition's names, with its ``step`` (empty before it
        has stepped)."""
        out = []
        for (s, n), st in zip(self.slices, self.steps):
            if st == 0:
                out.append({})
                continue
            d = {k: t[s:s + n] for k, t in self.flat.items()}
            d["step"] = torch.tensor(float(st))
            out.append(d)
        return out

    def load(self, states: List[Dict[str, torch.Tensor]], group: dict) -> None:
        """Set each piece's state as :meth:`piece_states` gave it (in the rule's state dtype:
        fp32 values into a bf16 form round to nearest even)."""
        for k, ((s, n), st) in enumerate(zip(self.slices, states)):
            for key, t in st.items():
                if isinstance(t, torch.Tensor) and t.dim() > 0:
                    load_piece(self.flat, self.master, key, t, s, n, self.state_dtype)
            self.steps[k] = int(float(st["step"])) if "step" in st else \
                (1 if st else 0)
