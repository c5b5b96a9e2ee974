"""Update strategies: own each unit's :class:`ShardState`, decide where it lives, and apply
one fused AdamW per unit shard.

See [Note: parameters and state] in ``units.py``. Placement is the strategy's: offload (a later
issue) adds a host or NVMe strategy with the same members (``placement``, ``states``,
``init_state``, ``update``, ``load_state``), and the optimizer's step does not change.
"""
from __future__ import annotations

from typing import Dict, List, Protocol, Union

import torch

from ..ops import OpSet
from .shard_state import ShardState
from .units import FlatParamUnit

GradScale = Union[None, float, torch.Tensor]


class UpdateStrategy(Protocol):
    """What the optimizer and ``state.py`` need from an update strategy."""

    placement: str              # "device", later "cpu" / "nvme"
    states: List[ShardState]    # by unit index

    def init_state(self, unit: FlatParamUnit, initial_master: torch.Tensor) -> ShardState:
        """Allocate ``unit``'s state (where this strategy keeps states)."""

    def update(self, unit: FlatParamUnit, grad: torch.Tensor, group: dict,
               grad_scale: GradScale) -> None:
        """Step ``unit``'s state with its reduced gradient shard and write the updated
        parameters into ``unit.compute_shard``."""

    def load_state(self, unit: FlatParamUnit, step: int, master: torch.Tensor,
                   exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Overwrite ``unit``'s state and its compute shard."""

    def held(self) -> Dict[str, List[torch.Tensor]]:
        """Tensors held by kind ("master", "optimizer_states") for ``stats()``."""


class DeviceUpdate:
    """States on the unit's device; AdamW with ``OpSet.adamw_step``.

    With a low-precision compute dtype the updated master is written, rounded, into the
    unit's compute shard in the same pass (``out=``), ready for the gather; in pure fp32 the
    master *is* the compute shard (a view), so nothing is written twice.

    Args:
        ops: the optimizer's OpSet.

    Attributes:
        placement: "device".
        states: one :class:`ShardState` per unit, by unit index.
    """

    placement = "device"

    def __init__(self, ops: OpSet) -> None:
        self.ops = ops
        self.states: List[ShardState] = []

    def init_state(self, unit: FlatParamUnit, initial_master: torch.Tensor) -> ShardState:
        """Allocate ``unit``'s state from its fp32 shard values (``build_*_unit``'s second
        result); units must come in index order."""
        if unit.index != len(self.states):
            raise ValueError(f"init_state: unit {unit.index} out of order (expected "
                             f"{len(self.states)})")
        shard = unit.layout.shard_numel
        if unit.compute_dtype == torch.float32:
            master = unit.compute_shard
        else:
            master = initial_master.clone()
        zeros = lambda: torch.zeros(shard, dtype=torch.float32, device=unit.device)  # noqa: E731
        state = ShardState(unit.index, unit.names, unit.layout, unit.rank, master, zeros(),
                           zeros())
        self.states.append(state)
        return state

    def _writes_compute(self, unit: FlatParamUnit) -> bool:
        return unit.compute_dtype != torch.float32

    def update(self, unit: FlatParamUnit, grad: torch.Tensor, group: dict,
               grad_scale: GradScale) -> None:
        """Apply one step to ``unit``'s state and compute shard.

        Args:
            unit: its ``compute_shard`` receives the updated parameters.
            grad: [shard_numel] reduced gradient (fp32/bf16/fp16), to be divided by
                ``grad_scale``.
            group: the unit's param group (lr, betas, eps, weight_decay read now, so
                schedulers take effect on the next step).
            grad_scale: None, float or 1-element fp32 tensor (1/N, loss scale, clipping).
        """
        st = self.states[unit.index]
        beta1, beta2 = group["betas"]
        st.step += 1
        out = unit.compute_shard if self._writes_compute(unit) else None
        self.ops.adamw_step(st.master, grad, st.exp_avg, st.exp_avg_sq,
                            lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
                            eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                            step=st.step, grad_scale=grad_scale, out=out)

    def load_state(self, unit: FlatParamUnit, step: int, master: torch.Tensor,
                   exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Overwrite ``unit``'s state and rewrite its compute shard from the master."""
        st = self.states[unit.index]
        st.step = int(step)
        st.exp_avg.copy_(exp_avg)
        st.exp_avg_sq.copy_(exp_avg_sq)
        st.master.copy_(master)
        if self._writes_compute(unit):
            self.ops.cast(st.master, out=unit.compute_shard)

    def held(self):
        """``{"master": [...], "optimizer_states": [...]}`` tensors held (for ``stats()``)."""
        return {"master": [s.master for s in self.states],
                "optimizer_states": [t for s in self.states for t in (s.exp_avg, s.exp_avg_sq)]}
