"""ZeRO stage 1/2/3 optimizer, with CPU/NVMe offload (see ``optimizer.py``).

Building blocks (see [Note: parameters and state] in ``units.py`` and [Note: the stage
registry] in ``policy.py``): ``policy`` (StagePolicy, OffloadPolicy, STAGES, OFFLOADS, RUNGS),
``units`` (FlatParamUnit, ReplicatedParams, ShardedParams), ``shard_state`` (ShardState),
``update`` (DeviceUpdate; offload: ``host_update.HostUpdate``, ``nvme_update.NvmeUpdate``,
built by ``placement``, configured by ``OffloadConfig``), ``grad_reducers`` (gradient
strategies), ``stage3`` (the gather schedule); the bucketed reduce-scatter lives in
``zkernels.comm.bucketed``.
"""
from .nonfinite import NonFiniteGradientError
from .offload_config import OffloadConfig
from .optimizer import ZeroOptimizer, resolve_stage
from .policy import OFFLOADS, RUNGS, STAGES, OffloadPolicy, StagePolicy
from .precision import LossScaleConfig, MixedPrecision

__all__ = ["ZeroOptimizer", "resolve_stage", "OffloadConfig", "LossScaleConfig", "MixedPrecision",
           "StagePolicy", "OffloadPolicy", "STAGES", "OFFLOADS", "RUNGS",
           "NonFiniteGradientError"]
