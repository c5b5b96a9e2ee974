"""ZeRO stage 1/2 optimizer (see ``optimizer.py``)."""
from .nonfinite import NonFiniteGradientError
from .optimizer import ZeroOptimizer, resolve_stage
from .precision import LossScaleConfig, MixedPrecision

__all__ = ["ZeroOptimizer", "resolve_stage", "LossScaleConfig", "MixedPrecision",
           "NonFiniteGradientError"]
