"""This rank's optimizer state of one unit: fp32 master shard, AdamW moments, step count.

See [Note: parameters and state] in ``units.py``. The update strategy (``update.py``) allocates
and owns these (it decides where their tensors live); a state knows its unit's layout and this
rank, so a checkpoint can map every element of the shard to ``(parameter name, range)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Tuple

import torch

from ...layout import FlatLayout


@dataclass
class ShardState:
    """Optimizer state of ``rank``'s shard of one unit.

    Attributes:
        unit_index: the unit's ``index``.
        names: the unit's canonical parameter names (in layout order).
        layout: the unit's layout; this state covers ``layout.shard_range(rank)``.
        rank: the rank whose shard this is.
        master: [shard_numel] fp32; in pure fp32 a view of the unit's compute shard.
        exp_avg, exp_avg_sq: [shard_numel] fp32 AdamW moments.
        step: AdamW steps applied.
    """

    unit_index: int
    names: Tuple[str, ...]
    layout: FlatLayout
    rank: int
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int = 0

    @property
    def shard_range(self) -> Tuple[int, int]:
        """``[start, end)`` of the unit's flat buffer this state covers."""
        return self.layout.shard_range(self.rank)

    def param_slices(self) -> Iterator[Tuple[str, int, int, int]]:
        """For each parameter overlapping the shard: ``(name, start_in_param, start_in_shard,
        length)``, flat element offsets (``master[start_in_shard:start_in_shard + length]`` is
        ``param.view(-1)[start_in_param:start_in_param + length]``)."""
        for i, a, s, n in self.layout.tensor_slices_in_shard(self.rank):
            yield self.names[i], a, s, n

    def tensors(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(master, exp_avg, exp_avg_sq)``."""
        return self.master, self.exp_avg, self.exp_avg_sq
