"""This rank's optimizer state of one unit: the per-unit record the update engine steps.

See [Note: parameters and state] in ``units.py``. The engine (``engine.py``) allocates and
owns these records (its placement decides where their tensors live). A record holds its
unit's *view*, read from the unit and never copied (index, layout, names, rank: so a checkpoint
maps every element of the shard through ``unit.param_slices_in_shard()``), the unit's fp32
master and AdamW moments, its gradient shard (the engine's grad sink fills it) and, with NVMe
offload, its swap files.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from ..parameters.units import FlatParamUnit


@dataclass(eq=False)
class ShardState:
    """Optimizer state of this rank's shard of one unit.

    Attributes:
        unit: the unit (its index, layout, names and shard are read through it).
        master: [shard_numel] fp32; in pure fp32 on the device a view of the unit's compute
            shard; a meta tensor where the master lives in files (read with
            ``ZeroUnit.read_state``).
        exp_avg, exp_avg_sq: [shard_numel] fp32 AdamW moments (meta tensors on NVMe).
        step: AdamW steps applied to the unit (``update`` calls).
        param_steps: each parameter's AdamW step count (it advances only on a step where
            the parameter has a gradient: [Note: unused parameters] in
            ``gradients/presence.py``), by position in ``unit.params``.
        grad: [shard_numel] fp32 gradient shard where the engine's grad sink keeps one
            (device or host RAM), else None.
        files: NVMe offload: the unit's swap files by kind ("master", "exp_avg", ...).
        rule: a torch.optim class's :class:`~zkernels.zero.state.torch_rule.TorchShardRule`
            (which holds that class's state; ``exp_avg``/``exp_avg_sq`` are then empty), the
            fused Lion/SGD's or a whole-matrix class's rule; with NVMe offload the first two
            wrapped in a :class:`~zkernels.zero.state.rule_swap.SwappedRule` (their state,
            and with ``nvme_master`` the master, in files; ``master`` is then a meta tensor),
            a whole-matrix class's owners swapping their own files ([Note: whole matrices on
            NVMe], its shard master in host RAM); or None for the fused AdamW.
        fmt: the group's low-bit :class:`~zkernels.zero.planning.state_format.StateFormat`
            (``exp_avg``/``exp_avg_sq`` bf16, or int8/uint8 codes), or None (fp32 moments);
            see [Note: low-bit state in shards] in ``lowbit_state.py``.
        exp_avg_scales, exp_avg_sq_scales: the int8 format's fp32 block scales, else None.
    """

    unit: FlatParamUnit
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int = 0
    param_steps: List[int] = field(default_factory=list)
    grad: Optional[torch.Tensor] = None
    files: Dict[str, object] = field(default_factory=dict)
    rule: Optional[object] = None
    fmt: Optional[object] = None
    exp_avg_scales: Optional[torch.Tensor] = None
    exp_avg_sq_scales: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if not self.param_steps:
            self.param_steps = [self.step] * len(self.unit.params)

    def set_step(self, step: int, param_steps=None) -> None:
        """Restore the counts (``param_steps`` None: every parameter at ``step``, as a state
        saved before per-parameter counts loads)."""
        self.step = int(step)
        n = len(self.unit.params)
        steps = [self.step] * n if param_steps is None else [int(s) for s in param_steps]
        if len(steps) != n:
            raise ValueError(f"param_steps: expected {n} counts for the unit's parameters "
                             f"{list(self.unit.names)}, got {len(steps)}")
        self.param_steps = steps

    @property
    def unit_index(self) -> int:
        return self.unit.index

    @property
    def numel(self) -> int:
        return self.unit.layout.shard_numel

    def tensors(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(master, exp_avg, exp_avg_sq)``."""
        return self.master, self.exp_avg, self.exp_avg_sq

    def scales(self) -> Tuple[torch.Tensor, ...]:
        """The int8 format's block scales (empty for fp32 and bf16 moments)."""
        return tuple(s for s in (self.exp_avg_scales, self.exp_avg_sq_scales) if s is not None)
