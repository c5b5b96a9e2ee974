"""The fused Lion and SGD ops on this rank's shard of one unit (``optimizer="lion"`` /
``"sgd"``).

[Note: fused Lion and SGD]
``optimizer="lion"`` and ``optimizer="sgd"`` run ``zkernels.ops.lion_step`` /
``sgd_step`` (the OpSet's backend: reference, Triton or the C++ SIMD path) over the unit's
fp32 master shard in one call, as the fused AdamW does: the gradient shard is read as fp32
and divided by the step's ``grad_scale`` inside the op (no temporary). The state is one flat
[shard_numel] fp32 buffer (Lion's ``exp_avg``, SGD's ``momentum_buffer``; none for SGD
without momentum), created at the first step as torch creates its state, so Lion holds 4
bytes per parameter (``optimizer_spec.KERNELS``). Each parameter keeps its own step count
(SGD's first step sets the buffer to the gradient, as torch.optim.SGD does); a parameter
without a gradient this step is skipped (its piece is not updated), so the op then runs per
live piece. Checkpoints see the pieces' state under torch's keys (``exp_avg``,
``momentum_buffer``) with their ``step``, as a torch class's ([Note: torch.optim on pieces]).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from ...ops import OpSet
from ..planning.optimizer_spec import OptimizerSpec
from .torch_rule import FlatStateRule, load_piece


class FusedShardRule(FlatStateRule):
    """Lion or SGD over one unit's shard (see [Note: fused Lion and SGD]).

    Args:
        spec: the group's :class:`OptimizerSpec` (``spec.kernel`` "lion" or "sgd").
        master: [shard_numel] fp32 master shard (the state lives beside it).
        slices: ``(start in the shard, length)`` of each piece.
        ops: the OpSet the update runs on (the device's, or the host's with offload).

    Attributes:
        flat: state key -> [shard_numel] fp32 buffer (after the first step).
    """

    def __init__(self, spec: OptimizerSpec, master: torch.Tensor,
                 slices: List[Tuple[int, int]], ops: OpSet) -> None:
        self.spec, self.master, self.slices, self.ops = spec, master, slices, ops
        self.key = "exp_avg" if spec.kernel == "lion" else "momentum_buffer"
        self.flat: Dict[str, torch.Tensor] = {}
        self.steps = [0] * len(slices)

    def _has_state(self, group: dict) -> bool:
        return self.spec.kernel == "lion" or bool(group.get("momentum", 0))

    def _call(self, a: int, b: int, grad: torch.Tensor, group: dict, grad_scale,
              step: int) -> None:
        buf = self.flat.get(self.key)
        view = None if buf is None else buf[a:b]
        if self.spec.kernel == "lion":
            b1, b2 = group["betas"]
            self.ops.lion_step(self.master[a:b], grad[a:b], view, lr=float(group["lr"]),
                               beta1=float(b1), beta2=float(b2),
                               weight_decay=float(group["weight_decay"]),
                               grad_scale=grad_scale)
        else:
            self.ops.sgd_step(self.master[a:b], grad[a:b], view, lr=float(group["lr"]),
                              momentum=float(group["momentum"]),
                              dampening=float(group["dampening"]),
                              weight_decay=float(group["weight_decay"]),
                              nesterov=bool(group["nesterov"]), step=step,
                              grad_scale=grad_scale)

    def step(self, grad: torch.Tensor, group: dict, grad_scale,
             live: Optional[List[bool]] = None) -> None:
        """One step from ``grad`` ([shard_numel], divided by ``grad_scale`` in the op);
        ``live``: a flag per piece (None: all have a gradient)."""
        if not self.slices:
            return
        if self._has_state(group) and self.key not in self.flat:
            self.flat[self.key] = torch.zeros_like(self.master)
        flags = [True] * len(self.slices) if live is None else list(live)
        for k, f in enumerate(flags):
            self.steps[k] += int(bool(f))
        if all(flags) and len(set(self.steps)) == 1:   # one call over the whole shard
            self._call(0, self.master.numel(), grad, group, grad_scale, self.steps[0])
            return
        for (s, n), f, st in zip(self.slices, flags, self.steps):
            if f:
                self._call(s, s + n, grad, group, grad_scale, st)

    def piece_states(self) -> List[Dict[str, torch.Tensor]]:
        """Each piece's state under torch's keys, with its ``step`` (empty before it has
        stepped)."""
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
        """Set each piece's state as :meth:`piece_states` gave it."""
        for k, ((s, n), st) in enumerate(zip(self.slices, states)):
            for key, t in st.items():
                if isinstance(t, torch.Tensor) and t.dim() > 0:
                    load_piece(self.flat, self.master, key, t, s, n)
            self.steps[k] = int(float(st["step"])) if "step" in st else \
                (1 if st else 0)
