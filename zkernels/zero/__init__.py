"""ZeRO stage 1/2/3 optimizer, with CPU/NVMe offload (see ``optimizer.py``).

The folder follows the design (see [Note: parameters and state] in ``parameters/units.py`` and
[Note: the stage registry] in ``planning/policy.py``):

- ``planning/``: the run's ZeroConfig, the stage and offload registry (StagePolicy,
  OffloadPolicy, STAGES, OFFLOADS, RUNGS), buckets, stage-3 units, the memory estimator and
  the ladder;
- ``parameters/``: param groups, flat parameter units and their gather policies (replicated,
  sharded, host-sharded), stage 3's gather schedule;
- ``gradients/``: the gradient strategies (reduction during backward), precision and loss
  scaling, clipping, the non-finite policy;
- ``state/``: ShardState records and the update engine that places them (device, host
  RAM, NVMe), their configuration and copies, the optimizer's state_dict;
- ``unit.py``: a unit's flat, bucket, state and step; ``optimizer.py`` loops over them;
  ``stats.py`` counts the bytes held. The reduce-scatter is ``zkernels.comm.bucketed``'s.
"""
from .gradients.nonfinite import NonFiniteGradientError
from .planning.offload_config import OffloadConfig
from .optimizer import ZeroOptimizer
from .planning.config import (BucketConfig, OffloadSpec, PrecisionConfig, QuantizeConfig,
                              ShardingConfig, StateConfig, ZeroConfig, resolve_stage)
from .planning.policy import OFFLOADS, RUNGS, STAGES, OffloadPolicy, StagePolicy
from .gradients.precision import LossScaleConfig, MixedPrecision

__all__ = ["ZeroOptimizer", "ZeroConfig", "ShardingConfig", "PrecisionConfig", "OffloadSpec",
           "QuantizeConfig", "BucketConfig", "StateConfig", "resolve_stage", "OffloadConfig",
           "LossScaleConfig", "MixedPrecision", "StagePolicy", "OffloadPolicy", "STAGES",
           "OFFLOADS", "RUNGS", "NonFiniteGradientError"]
