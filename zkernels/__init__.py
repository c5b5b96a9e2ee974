"""zkernels: ZeRO stage 1/2/3 sharded optimizer for PyTorch with fused kernels.

Importing this package has no side effects: no backend is probed, no extension is loaded and
no environment variable is read until an op runs.
"""
from . import checkpoint, ops
from .layout import FlatLayout
from .zero import (BucketConfig, OffloadSpec, PrecisionConfig, QuantizeConfig, ShardingConfig,
                   StateConfig, ZeroConfig, ZeroOptimizer)
from .zero.planning.estimate import MemoryEstimate, estimate_memory

__version__ = "0.1.0"
__all__ = ["checkpoint", "ops", "FlatLayout", "ZeroOptimizer", "ZeroConfig", "ShardingConfig",
           "PrecisionConfig", "OffloadSpec", "QuantizeConfig", "BucketConfig", "StateConfig", "MemoryEstimate",
           "estimate_memory", "__version__"]
