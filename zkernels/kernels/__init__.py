"""Fused Triton kernels, one module per op (and per optimizer body: ``optimizer.py``
runs ``<name>.py``'s BODY); each launcher has exactly the signature of its reference in
``zkernels.reference`` and is called by ``zkernels.ops`` after validation.

Importing this module needs triton; on CPU tensors the kernels need ``TRITON_INTERPRET=1``
set before the first import (``triton.jit`` reads it when it decorates).
"""
from .adamw import adamw_step, sum_squares
from .adamw_lowbit import adamw_step_lowbit
from .bucket import bucket_pack, bucket_unpack
from .cast import cast, unscale_and_check_
from .flatten import flatten, unflatten
from .optimizer import OPTIMIZER_KINDS, optimizer_step
from .quant import dequantize, dequantize_sum, quantize

__all__ = ["flatten", "unflatten", "bucket_pack", "bucket_unpack", "cast",
           "unscale_and_check_", "adamw_step", "adamw_step_lowbit", "optimizer_step",
           "OPTIMIZER_KINDS",
           "sum_squares", "quantize",
           "dequantize", "dequantize_sum"]
