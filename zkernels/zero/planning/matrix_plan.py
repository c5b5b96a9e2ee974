"""Whole-matrix owners and the bytes of their exchanges, planned: which rank of a shard group
owns each parameter of a Muon or Adafactor group, and what the two exchanges send per step
(``state/matrix_rule.py`` runs them, ``estimate.py`` counts them).

[Note: the matrix exchanges in the estimate]
The owners' two exchanges ([Note: whole matrices on owners] in ``state/matrix_rule.py``) are
``all_to_all`` of N equal chunks, each padded to the largest pair's share: the gradient pieces
to the owners, the updated master pieces back. A rank sends ``chunk · 4 · (N − 1)`` bytes in
each (the meter's count of an all-to-all of ``N · chunk`` fp32), where ``chunk`` is the most
elements one rank sends another: so the figure depends on where each matrix's pieces fall
in the shards and on who owns it. With the model's parameters and param groups the estimate
builds the same layouts as the optimizer (``buckets.plan_buckets`` at stages 1-2 with the
same capacities, ``unit_plan.plan_units`` at stage 3, in the same build order) and chooses
the owners with the same rule (:class:`OwnerPlan`), so its figure is the meter's, byte for
byte (tests/zero/test_matrix_traffic.py). With a parameter count only, it counts the balanced
layout: each rank holds 1/N of every matrix and sends each owner its piece,
``2 · 4 · M · (N − 1) / N²`` bytes per step for M matrix elements (no padding). The first
step, and the first after the masters are written from outside a step, also send the master
pieces to the owners (twice the first exchange): not counted, as the estimate is per steady
step.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ...layout import FlatLayout
from .buckets import align_numel, bucket_capacities, plan_buckets
from .unit_plan import plan_units

FP32 = 4


def matrix_cost(name: str, shape: Sequence[int]) -> float:
    """An owner's cost of one parameter: ``m · n · min(m, n)`` for Muon's Newton-Schulz, the
    element count for Adafactor (``name``: the class's name)."""
    n = 1
    for s in shape:
        n *= s
    return float(n) * min(shape) if name == "Muon" else float(n)


class OwnerPlan:
    """The owners of a shard group's matrices, chosen as units are built (see [Note: whole
    matrices on owners]): largest first within each unit; among the ranks that keep the most
    loaded rank's cost as low as the least loaded one taking it would, the one holding the
    largest piece (the least traffic), then the least loaded, then the lowest rank."""

    def __init__(self, world_size: int) -> None:
        self.load = [0.0] * world_size

    def assign(self, costs: Sequence[float], pieces: Sequence[Sequence[int]]) -> List[int]:
        """Owners of one unit's parameters (``costs[i]``; ``pieces[i][r]``: elements of
        parameter i in rank r's shard), in the given order."""
        owners = [-1] * len(costs)
        for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
            c = costs[i]
            bound = max(max(self.load), min(self.load) + c)
            owners[i] = min((r for r in range(len(self.load)) if self.load[r] + c <= bound),
                            key=lambda r: (-pieces[i][r], self.load[r], r))
            self.load[owners[i]] += c
        return owners


def exchange_chunk(items: Sequence[Tuple[int, Sequence[int]]], world_size: int) -> int:
    """Elements of one chunk of an exchange: the most one rank sends another, ``items`` as
    ``(owner, elements in each rank's shard)``."""
    n = world_size
    sizes = [[0] * n for _ in range(n)]
    for owner, pieces in items:
        for r in range(n):
            sizes[r][owner] += pieces[r]
    return max((sizes[r][q] for r in range(n) for q in range(n) if r != q), default=0)


def exchange_bytes(chunk: int, world_size: int) -> int:
    """Bytes a rank sends in one exchange of ``chunk``-element fp32 chunks (as the meter
    counts an all-to-all)."""
    return FP32 * world_size * chunk * (world_size - 1) // world_size


def _layouts(model, world_size: int, stage: int, group_of: Dict[int, int], align: int,
             bucket_bytes, reduce_dtype: torch.dtype, pooled: bool):
    """``(group index, params, FlatLayout)`` of every trainable flat unit, in the order the
    optimizer builds them (``parameters/build.py``, ``parameters/stage3.py``)."""
    if stage == 3:
        specs = plan_units(model, None, [p for p in model.parameters() if id(p) in group_of])
        order = list(range(len(specs)))
        out = []
        for si in order[:-1][::-1] + order[-1:]:
            spec = specs[si]
            for gi in sorted({group_of[id(p)] for p in spec.params}):
                ps = [p for p in spec.params if group_of[id(p)] == gi]
                out.append((gi, ps, FlatLayout.build([p.numel() for p in ps], world_size,
                                                     align)))
        return out
    distinct = {id(p): p for p in model.parameters() if id(p) in group_of}
    first, capacity = bucket_capacities(bucket_bytes, sum(p.numel() for p in distinct.values()),
                                        reduce_dtype, world_size, align, pooled)
    ordered = [(group_of[id(p)], p) for p in model.parameters() if id(p) in group_of]
    return plan_buckets(ordered, capacity, world_size, align, first)


def matrix_exchange_bytes(model, world_size: int, stage: int, param_groups: Sequence[dict],
                          specs: Sequence, *, param_dtype: torch.dtype,
                          reduce_dtype: torch.dtype, bucket_bytes: Optional[int],
                          pooled: bool) -> int:
    """Bytes one rank sends per steady step in the owners' two exchanges (see [Note: the
    matrix exchanges in the estimate]): ``model``'s trainable parameters in ``param_groups``
    (``specs[gi]``: group gi's ``OptimizerSpec``), over ``world_size`` ranks of a shard
    group, at ``stage`` with the optimizer's bucket settings (``pooled``: the stage reduces
    through the reduce pool)."""
    if world_size < 2 or not any(s.matrix for s in specs):
        return 0
    group_of = {id(p): gi for gi, g in enumerate(param_groups) for p in g["params"]}
    align = align_numel(param_dtype, reduce_dtype, torch.float32)
    owners = OwnerPlan(world_size)
    items: List[Tuple[int, List[int]]] = []
    for gi, ps, lay in _layouts(model, world_size, stage, group_of, align, bucket_bytes,
                                reduce_dtype, pooled):
        if not specs[gi].matrix:
            continue
        pieces = [[0] * world_size for _ in ps]
        for r in range(world_size):
            for i, _, _, k in lay.tensor_slices_in_shard(r):
                pieces[i][r] = k
        costs = [matrix_cost(specs[gi].name, tuple(p.shape)) for p in ps]
        items += zip(owners.assign(costs, pieces), pieces)
    return 2 * exchange_bytes(exchange_chunk(items, world_size), world_size)


def balanced_exchange_bytes(matrix_numel: int, world_size: int) -> float:
    """The balanced layout's bytes per step for ``matrix_numel`` matrix elements (a count
    without the model: see the Note)."""
    n = world_size
    return 2 * FP32 * matrix_numel * (n - 1) / (n * n)
