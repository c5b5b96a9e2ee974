"""The parameter side of one optimizer, built once: flat units and (stage 3) gather units.

Stages 1-2 cut the trainable parameters into buckets (``planning/buckets.py``), each a
:class:`~zkernels.zero.parameters.units.FlatParamUnit` whose full compute copy stays on every
rank; stage 3 cuts the model into units (``planning/unit_plan.py``) whose flat buffers are
sharded and gathered just in time (``stage3.py``). Either way every unit's state is handed to
the update engine as the unit is built (``engine.init_state``), so only one unit's full fp32
copy exists at a time.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ...ops import OpSet
from ..planning.buckets import align_numel, bucket_capacities, plan_buckets
from ..planning.policy import StagePolicy
from ..planning.unit_plan import plan_units
from .groups import frozen_params
from .meta_init import MetaMaterializer
from .stage3 import GatherUnit, build_units
from .units import FlatParamUnit, build_flat_unit, param_names


def build_parameter_side(policy: StagePolicy, model: nn.Module, param_groups: Sequence[dict],
                         param_dtype: torch.dtype, reduce_dtype: torch.dtype, world_size: int,
                         rank: int, ops: OpSet, engine, storage, units=None,
                         bucket_bytes: Optional[int] = None, device: Optional[torch.device] = None,
                         param_init=None, seed: Optional[int] = None
                         ) -> Tuple[List[FlatParamUnit], List[FlatParamUnit], List[GatherUnit]]:
    """Build the flat units of ``model``'s trainable parameters.

    Args:
        policy: the stage's policy (``shards_params``: stage 3's units, else buckets).
        param_groups: the optimizer's groups (their order numbers the units' groups).
        engine: the update engine: ``init_state(unit, initial_master)`` per unit, and its
            ``block_align``.
        storage: stage 3: where the persistent parameter shards live, injected ([Note: shard
            storage] in ``storage.py``).
        units: stage 3's unit choice (see [Note: stage-3 units] in ``unit_plan.py``).
        bucket_bytes: stages 1-2's bucket size (None: from the model; see [Note: buckets
            sized from the model] in ``buckets.py``).
        device, param_init, seed: a model with meta-device tensors is materialized on
            ``device`` unit by unit from base seed ``seed`` ([Note: meta-device build] in
            ``meta_init.py``); ``device`` None: nothing to materialize.

    Returns:
        ``(units, frozen_units, gather_units)``: the trainable flat units in launch order,
        stage 3's frozen flat units and its GatherUnits (both empty below stage 3).
    """
    group_of = {id(p): gi for gi, g in enumerate(param_groups) for p in g["params"]}
    names = param_names(model)
    align = align_numel(param_dtype, reduce_dtype, torch.float32)
    # Low-bit int8 state: no quantization block crosses a parameter or a shard ([Note:
    # low-bit state in shards] in state/lowbit_state.py); block sizes are powers of two.
    align = max(align, engine.block_align)
    materializer = None
    if device is not None:
        trainable = [p for p in model.parameters() if id(p) in group_of]
        materializer = MetaMaterializer(model, device, param_init,
                                        plan_units(model, units, trainable), seed)
    if policy.shards_params:
        frozen_params(model, device or next(
            p for g in param_groups for p in g["params"]).device)  # sharded with their unit
        # Stage 3: units are blocks (unit_plan.py), not buckets; bucket_bytes is unused.
        flat, gather_units = build_units(model, units, group_of, names, world_size, rank,
                                         align, param_dtype, ops, engine, storage, materializer)
        return flat, [f for g in gather_units for f in g.flats if f.frozen], gather_units
    if materializer is not None:  # replicated: the whole model, unit by unit, in module order
        for spec in materializer.specs:
            materializer.materialize(spec)
    num_trainable = sum(p.numel() for p in {id(p): p for g in param_groups
                                            for p in g["params"]}.values())
    first_capacity, capacity = bucket_capacities(
        bucket_bytes, num_trainable, reduce_dtype, world_size, align,
        pooled=policy.uses_reduce_pool(param_dtype, reduce_dtype))
    ordered = [(group_of[id(p)], p) for p in model.parameters() if id(p) in group_of]
    flat = []
    for i, (gi, ps, lay) in enumerate(plan_buckets(ordered, capacity, world_size, align,
                                                   first_capacity)):
        unit, initial_master = build_flat_unit(i, gi, ps, names, lay, rank, param_dtype, ops)
        engine.init_state(unit, initial_master)
        flat.append(unit)
        del initial_master  # the full fp32 copy goes before the next unit is built
    return flat, [], []
