"""Fused ops, public: one module per op, each checking its arguments and dispatching to
Triton (CUDA tensors), the C++ extension (CPU tensors, where built) or the reference.
``for_device`` builds an :class:`OpSet` whose backend is chosen once (``opset.py``)."""
from ._backend import available, choose
from .adamw import adamw_step, sum_squares
from .adamw_lowbit import adamw_step_lowbit
from .bucket import bucket_pack, bucket_unpack
from .cast import cast, unscale_and_check_
from .flatten import flatten, unflatten
from .opset import OpSet, for_device
from .optimizer import lion_step, optimizer_step, sgd_step
from .quant import dequantize, dequantize_sum, quantize

__all__ = ["flatten", "unflatten", "bucket_pack", "bucket_unpack", "cast",
           "unscale_and_check_", "adamw_step", "adamw_step_lowbit", "lion_step", "sgd_step",
           "optimizer_step", "sum_squares", "quantize",
           "dequantize", "dequantize_sum", "available", "choose", "OpSet", "for_device"]
