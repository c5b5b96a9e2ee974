"""Triton fused Lion step over a flat fp32 shard.

Exactness on a GPU, as in quant.py: the launch passes ``enable_fp_fusion=False`` so that no
product and sum are contracted into an FMA (which rounds once where the reference rounds
twice), and the unscale is ``tl.div_rn``; every operation is then the reference's, rounded
once, in its order. The interpreter computes in numpy, which never fuses.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from ._rounding import round_to
from ._tables import native_nan

Scalar = Union[float, int, torch.Tensor]

# Lion moves 3 streams in and 2-3 out per element (one state less than AdamW): AdamW's block.
LION_BLOCK = 2048
LION_WARPS = 8


@triton.jit
def _sign(x):
    """``torch.sign``: (0 < x) - (x < 0); +-0 and NaN give +0."""
    return tl.where(x > 0.0, 1.0, 0.0) - tl.where(x < 0.0, 1.0, 0.0)


@triton.jit
def _lion_block(param_ptr, grad_ptr, exp_avg_ptr, out_ptr, offs, numel, grad_scale, decay,
                beta1, one_minus_beta1, beta2, one_minus_beta2, neg_lr, MASKED: tl.constexpr,
                GRAD_SCALE: tl.constexpr, HAS_OUT: tl.constexpr, NATIVE_NAN: tl.constexpr):
    if MASKED:
        mask = offs < numel
    else:
        mask = None
    g = tl.load(grad_ptr + offs, mask=mask).to(tl.float32)
    p = tl.load(param_ptr + offs, mask=mask)
    m = tl.load(exp_avg_ptr + offs, mask=mask)
    # The order of operations is the reference's, one rounding per operation (see there).
    if GRAD_SCALE:
        g = tl.div_rn(g, grad_scale)
    u = _sign(m * beta1 + g * one_minus_beta1)
    p = p * decay
    p = p + u * neg_lr
    m = m * beta2 + g * one_minus_beta2
    tl.store(param_ptr + offs, p, mask=mask)
    tl.store(exp_avg_ptr + offs, m, mask=mask)
    if HAS_OUT:
        tl.store(out_ptr + offs, round_to(p, out_ptr.dtype.element_ty, NATIVE_NAN), mask=mask)


@triton.jit(do_not_specialize=["numel"])  # no recompile per shard size
def _lion_step_kernel(param_ptr, grad_ptr, exp_avg_ptr, out_ptr, found_inf_ptr, grad_scale_ptr,
                      numel, grad_scale, decay, beta1, one_minus_beta1, beta2, one_minus_beta2,
                      neg_lr, GRAD_SCALE: tl.constexpr, GRAD_SCALE_IS_TENSOR: tl.constexpr,
                      HAS_FOUND_INF: tl.constexpr, HAS_OUT: tl.constexpr,
                      NATIVE_NAN: tl.constexpr, BLOCK: tl.constexpr):
    """One Lion update of one BLOCK of the shard, in place (plus the cast copy in ``out``)."""
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    run = True
    if HAS_FOUND_INF:
        # An overflow step changes nothing; decided on the device so the host never waits.
        run = tl.load(found_inf_ptr) == 0
    if GRAD_SCALE_IS_TENSOR:
        grad_scale = tl.load(grad_scale_ptr).to(tl.float32)
    if run:
        if start + BLOCK <= numel:
            _lion_block(param_ptr, grad_ptr, exp_avg_ptr, out_ptr, offs, numel, grad_scale, decay,
                        beta1, one_minus_beta1, beta2, one_minus_beta2, neg_lr, False,
                        GRAD_SCALE, HAS_OUT, NATIVE_NAN)
        else:
            _lion_block(param_ptr, grad_ptr, exp_avg_ptr, out_ptr, offs, numel, grad_scale, decay,
                        beta1, one_minus_beta1, beta2, one_minus_beta2, neg_lr, True,
                        GRAD_SCALE, HAS_OUT, NATIVE_NAN)


def lion_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, *, lr: float,
              beta1: float = 0.9, beta2: float = 0.99, weight_decay: float = 0.0,
              grad_scale: Optional[Scalar] = None, found_inf: Optional[torch.Tensor] = None,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One fused Lion update, in place, one pass. Same arguments as
    :func:`zkernels.reference.lion_step`; ``grad_scale`` (float or 1-element tensor) and
    ``found_inf`` (1-element fp32 tensor, nonzero: change nothing) may live on the device and
    are then read by the kernel, never by the host; ``out`` (fp32/bf16/fp16) receives the
    updated params rounded to nearest even.

    Returns:
        ``param``.
    """
    numel = param.numel()
    if numel == 0:
        return param
    gs_is_tensor = isinstance(grad_scale, torch.Tensor)
    dummy = param  # stands in for absent tensors; constexpr flags keep it unread
    _lion_step_kernel[(triton.cdiv(numel, LION_BLOCK),)](
        param, grad, exp_avg, out if out is not None else dummy,
        found_inf.reshape(-1) if found_inf is not None else dummy,
        grad_scale.reshape(-1) if gs_is_tensor else dummy, numel,
        1.0 if gs_is_tensor or grad_scale is None else float(grad_scale),
        1.0 - lr * weight_decay, float(beta1), 1.0 - beta1, float(beta2), 1.0 - beta2,
        -float(lr), GRAD_SCALE=grad_scale is not None, GRAD_SCALE_IS_TENSOR=gs_is_tensor,
        HAS_FOUND_INF=found_inf is not None, HAS_OUT=out is not None,
        NATIVE_NAN=native_nan(param.device), BLOCK=LION_BLOCK, num_warps=LION_WARPS,
        enable_fp_fusion=False)
    return param
