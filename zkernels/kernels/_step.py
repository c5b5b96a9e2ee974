"""The block prologue and epilogue every Triton optimizer kernel shares ([Note: the generic
optimizer step] in zkernels/reference/optimizer.py), on the device and at the launch.

[Note: exact optimizer kernels]
The optimizer kernels launch with ``enable_fp_fusion=False`` so that no product and sum is
contracted into an FMA (which rounds once where the reference rounds twice), divide with
``tl.div_rn`` (``/`` compiles to an approximate division on GPUs) and take ``tl.sqrt_rn``;
every operation is then the reference's, rounded once, in its order. The interpreter computes
in numpy, which never fuses. (The fp32 AdamW kernel launches with fusion on: its reference's
torch lerp/addcmul fuse too, and tests/ops/test_adamw.py compares it within the tolerance
table.)
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from ._rounding import round_to, widen
from ._tables import native_nan

Scalar = Union[float, int, torch.Tensor]


@triton.jit
def step_gate(found_inf_ptr, grad_scale_ptr, grad_scale, GRAD_SCALE_IS_TENSOR: tl.constexpr,
              HAS_FOUND_INF: tl.constexpr):
    """``(run, grad_scale)``: whether this step runs (found_inf zero; decided on the device so
    the host never waits) and the fp32 loss scale (read from the device when a tensor)."""
    run = True
    if HAS_FOUND_INF:
        run = tl.load(found_inf_ptr) == 0
    if GRAD_SCALE_IS_TENSOR:
        grad_scale = tl.load(grad_scale_ptr).to(tl.float32)
    return run, grad_scale


@triton.jit
def load_step(param_ptr, grad_ptr, offs, mask, grad_scale, GRAD_SCALE: tl.constexpr):
    """``(p, g)``: the parameter and the gradient widened to fp32, the gradient divided by
    ``grad_scale`` (IEEE) when ``GRAD_SCALE``."""
    g = widen(tl.load(grad_ptr + offs, mask=mask))
    if GRAD_SCALE:
        g = tl.div_rn(g, grad_scale)
    p = widen(tl.load(param_ptr + offs, mask=mask))
    return p, g


@triton.jit
def store_step(param_ptr, out_ptr, offs, mask, p, HAS_OUT: tl.constexpr,
               NATIVE_NAN: tl.constexpr):
    """Stores fp32 ``p`` into the parameter and, when ``HAS_OUT``, into ``out``, each rounded
    to nearest even in its dtype."""
    tl.store(param_ptr + offs, round_to(p, param_ptr.dtype.element_ty, NATIVE_NAN), mask=mask)
    if HAS_OUT:
        tl.store(out_ptr + offs, round_to(p, out_ptr.dtype.element_ty, NATIVE_NAN), mask=mask)


def step_args(param: torch.Tensor, grad_scale: Optional[Scalar],
              found_inf: Optional[torch.Tensor], out: Optional[torch.Tensor]):
    """The launch's share of the prologue: ``(out, found_inf, grad_scale_ptr, grad_scale,
    flags)``, absent tensors replaced by ``param`` (constexpr flags keep it unread), and the
    flags as keywords (GRAD_SCALE, GRAD_SCALE_IS_TENSOR, HAS_FOUND_INF, HAS_OUT,
    NATIVE_NAN)."""
    gs_is_tensor = isinstance(grad_scale, torch.Tensor)
    flags = dict(GRAD_SCALE=grad_scale is not None, GRAD_SCALE_IS_TENSOR=gs_is_tensor,
                 HAS_FOUND_INF=found_inf is not None, HAS_OUT=out is not None,
                 NATIVE_NAN=native_nan(param.device))
    return (out if out is not None else param,
            found_inf.reshape(-1) if found_inf is not None else param,
            grad_scale.reshape(-1) if gs_is_tensor else param,
            1.0 if gs_is_tensor or grad_scale is None else float(grad_scale), flags)
