"""ZeRO stage 1/2 optimizer (see ``optimizer.py``).

Building blocks (see [Note: parameters and state] in ``units.py`` and [Note: the stage
registry] in ``policy.py``): ``policy`` (StagePolicy, OffloadPolicy, STAGES, OFFLOADS, RUNGS),
``units`` (FlatParamUnit, ReplicatedParams, ShardedParams), ``shard_state`` (ShardState),
``update`` (DeviceUpdate), ``grad_reducers`` (gradient strategies); the bucketed
reduce-scatter lives in ``zkernels.comm.bucketed``.
"""
from .nonfinite import NonFiniteGradientError
from .optimizer import ZeroOptimizer, resolve_stage
from .policy import OFFLOADS, RUNGS, STAGES, OffloadPolicy, StagePolicy
from .precision import LossScaleConfig, MixedPrecision

__all__ = ["ZeroOptimizer", "resolve_stage", "LossScaleConfig", "MixedPrecision",
           "StagePolicy", "OffloadPolicy", "STAGES", "OFFLOADS", "RUNGS",
           "NonFiniteGradientError"]
