"""Update strategies: own each unit's :class:`ShardState`, decide where it lives, and apply
one fused AdamW per unit shard.

See [Note: parameters and state] in ``units.py``. Placement is the strategy's: offload adds a
host (``host_update.HostUpdate``) and an NVMe (``nvme_update.NvmeUpdate``) strategy with the
same members, chosen once by ``placement.make_update_strategy``; the optimizer's step does not
change. A strategy may hand the stage-2 reducer a ``grad_sink`` (where reduced gradient shards
go during backward: host RAM for CPU offload) and names the OpSet of the gradient shards
(``grad_ops``: clipping sums their squares where they live).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Protocol, Tuple, Union

import torch

from ...ops import OpSet
from .shard_state import ShardState
from ..parameters.units import FlatParamUnit, ShardedParams

GradScale = Union[None, float, torch.Tensor]


class UpdateStrategy(Protocol):
    """What the optimizer and ``state.py`` need from an update strategy."""

    placement: str              # "device", "cpu" or "nvme"
    states: List[ShardState]    # by unit index (NVMe: meta tensors, see state_tensors)
    grad_sink: Optional[object]  # stage 2's grad sink (grad_reducers.GradSink) or None
    grad_ops: OpSet             # ops for the gradient shards update() receives
    last_step: Dict[str, float]  # transfer figures of the last step (offload), for stats()
    resumed: bool               # init_state adopted a kept state (the optimizer re-gathers)

    def init_state(self, unit: FlatParamUnit, initial_master: torch.Tensor) -> ShardState:
        """Allocate ``unit``'s state (where this strategy keeps states)."""

    def sharded_params(self, params, layout, rank: int, compute_shard: torch.Tensor):
        """Stage 3: the gather policy of a unit whose persistent compute shard is
        ``compute_shard`` (on the device): :class:`~zkernels.zero.parameters.units.ShardedParams`, or,
        with ``offload_params``, one that keeps the shard in host RAM
        (``param_offload.HostShardedParams``)."""

    def update(self, unit: FlatParamUnit, grad: torch.Tensor, group: dict,
               grad_scale: GradScale) -> None:
        """Step ``unit``'s state with its reduced gradient shard and write the updated
        parameters into ``unit.compute_shard``."""

    def load_state(self, unit: FlatParamUnit, step: int, master: torch.Tensor,
                   exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Overwrite ``unit``'s state and its compute shard."""

    def finish_step(self) -> None:
        """After every unit's update of a step: transfers done, figures recorded."""

    def state_tensors(self, unit_index: int) -> Tuple[torch.Tensor, torch.Tensor,
                                                      torch.Tensor]:
        """``(master, exp_avg, exp_avg_sq)`` of a unit as tensors (read from disk for NVMe)."""

    def held(self) -> Dict[str, List[torch.Tensor]]:
        """Device tensors held by kind ("master", "optimizer_states") for ``stats()``."""

    def held_host(self) -> Dict[str, List[torch.Tensor]]:
        """Host tensors held by kind (offload) for ``stats()``."""

    def disk_bytes(self) -> Dict[str, int]:
        """Bytes of files held by kind (NVMe offload), measured from the files."""

    def close(self) -> None:
        """Release threads and files (idempotent)."""


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
    grad_sink = None
    resumed = False

    def __init__(self, ops: OpSet) -> None:
        self.ops = self.grad_ops = ops
        self.states: List[ShardState] = []
        self.last_step: Dict[str, float] = {}

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

    def sharded_params(self, params, layout, rank: int,
                       compute_shard: torch.Tensor) -> ShardedParams:
        """Stage 3: the parameter shard stays on the device."""
        return ShardedParams(params, layout, compute_shard)

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

    def finish_step(self) -> None:
        return None

    def state_tensors(self, unit_index: int):
        return self.states[unit_index].tensors()

    def held(self):
        """``{"master": [...], "optimizer_states": [...]}`` tensors held (for ``stats()``)."""
        return {"master": [s.master for s in self.states],
                "optimizer_states": [t for s in self.states for t in (s.exp_avg, s.exp_avg_sq)]}

    def held_host(self) -> Dict[str, List[torch.Tensor]]:
        return {}

    def disk_bytes(self) -> Dict[str, int]:
        return {}

    def close(self) -> None:
        return None

    def adopt(self, num_units: int) -> None:
        raise RuntimeError(f"{type(self).__name__} does not resume kept state")
