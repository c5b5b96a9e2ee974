"""Plain-PyTorch reference of every fused op: the CPU fallback and the test oracle.

Written for clarity, not speed. Each function has exactly the signature of its Triton launcher
in ``zkernels.kernels`` and of its public entry point in ``zkernels.ops``. Inputs are assumed
valid: argument checks live in ``zkernels.ops``.
"""
from .adamw import adamw_step, sum_squares
from .adamw_lowbit import adamw_step_lowbit
from .bucket import bucket_pack, bucket_unpack
from .cast import cast, unscale_and_check_
from .flatten import flatten, unflatten
from .lion import lion_step
from .optimizer import OPTIMIZER_KINDS, optimizer_step
from .quant import dequantize, dequantize_sum, quantize
from .sgd import sgd_step

__all__ = ["flatten", "unflatten", "bucket_pack", "bucket_unpack", "cast",
           "unscale_and_check_", "adamw_step", "adamw_step_lowbit", "lion_step", "sgd_step",
           "optimizer_step", "OPTIMIZER_KINDS",
           "sum_squares", "quantize",
           "dequantize", "dequantize_sum"]
