"""Triton fused SGD step (momentum, dampening, nesterov, weight decay) over a flat fp32 shard.

Exact on a GPU as lion.py is: ``enable_fp_fusion=False`` at launch, ``tl.div_rn`` for the
unscale, the reference's operations in its order.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from ._rounding import round_to
from ._tables import native_nan

Scalar = Union[float, int, torch.Tensor]

# SGD with momentum moves 3 streams in and 2-3 out per element: AdamW's block.
SGD_BLOCK = 2048
SGD_WARPS = 8


@triton.jit
def _sgd_block(param_ptr, grad_ptr, buf_ptr, out_ptr, offs, numel, grad_scale, weight_decay,
               momentum, one_minus_dampening, neg_lr, first, MASKED: tl.constexpr,
               GRAD_SCALE: tl.constexpr, HAS_WD: tl.constexpr, HAS_MOMENTUM: tl.constexpr,
               NESTEROV: tl.constexpr, HAS_OUT: tl.constexpr, NATIVE_NAN: tl.constexpr):
    if MASKED:
        mask = offs < numel
    else:
        mask = None
    g = tl.load(grad_ptr + offs, mask=mask).to(tl.float32)
    p = tl.load(param_ptr + offs, mask=mask)
    # The order of operations is the reference's, one rounding per operation (see there).
    if GRAD_SCALE:
        g = tl.div_rn(g, grad_scale)
    if HAS_WD:
        g = g + p * weight_decay
    if HAS_MOMENTUM:
        if first:
            b = g
        else:
            b = tl.load(buf_ptr + offs, mask=mask)
            b = b * momentum + g * one_minus_dampening
        tl.store(buf_ptr + offs, b, mask=mask)
        if NESTEROV:
            g = g + b * momentum
        else:
            g = b
    p = p + g * neg_lr
    tl.store(param_ptr + offs, p, mask=mask)
    if HAS_OUT:
        tl.store(out_ptr + offs, round_to(p, out_ptr.dtype.element_ty, NATIVE_NAN), mask=mask)


@triton.jit(do_not_specialize=["numel", "step"])  # no recompile per shard size or step
def _sgd_step_kernel(param_ptr, grad_ptr, buf_ptr, out_ptr, found_inf_ptr, grad_scale_ptr,
                     step_ptr, numel, step, grad_scale, weight_decay, momentum,
                     one_minus_dampening, neg_lr, GRAD_SCALE: tl.constexpr,
                     GRAD_SCALE_IS_TENSOR: tl.constexpr, STEP_IS_TENSOR: tl.constexpr,
                     HAS_FOUND_INF: tl.constexpr, HAS_WD: tl.constexpr,
                     HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, HAS_OUT: tl.constexpr,
                     NATIVE_NAN: tl.constexpr, BLOCK: tl.constexpr):
    """One SGD update of one BLOCK of the shard, in place (plus the cast copy in ``out``).
    ``step == 1`` (read from ``step_ptr`` when STEP_IS_TENSOR) sets the momentum buffer to the
    gradient, as torch.optim.SGD's first step does."""
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    run = True
    if HAS_FOUND_INF:
        # An overflow step changes nothing; decided on the device so the host never waits.
        run = tl.load(found_inf_ptr) == 0
    if GRAD_SCALE_IS_TENSOR:
        grad_scale = tl.load(grad_scale_ptr).to(tl.float32)
    if STEP_IS_TENSOR:
        step = tl.load(step_ptr).to(tl.int64)
    first = step == 1
    if run:
        if start + BLOCK <= numel:
            _sgd_block(param_ptr, grad_ptr, buf_ptr, out_ptr, offs, numel, grad_scale,
                       weight_decay, momentum, one_minus_dampening, neg_lr, first, False,
                       GRAD_SCALE, HAS_WD, HAS_MOMENTUM, NESTEROV, HAS_OUT, NATIVE_NAN)
        else:
            _sgd_block(param_ptr, grad_ptr, buf_ptr, out_ptr, offs, numel, grad_scale,
                       weight_decay, momentum, one_minus_dampening, neg_lr, first, True,
                       GRAD_SCALE, HAS_WD, HAS_MOMENTUM, NESTEROV, HAS_OUT, NATIVE_NAN)


def sgd_step(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: Optional[torch.Tensor],
             *, lr: float, momentum: float = 0.0, dampening: float = 0.0,
             weight_decay: float = 0.0, nesterov: bool = False, step: Scalar,
             grad_scale: Optional[Scalar] = None, found_inf: Optional[torch.Tensor] = None,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One fused SGD update, in place, one pass. Same arguments as
    :func:`zkernels.reference.sgd_step`; ``step``, ``grad_scale`` and ``found_inf`` may live on
    the device and are then read by the kernel, never by the host; ``out`` (fp32/bf16/fp16)
    receives the updated params rounded to nearest even.

    Returns:
        ``param``.
    """
    numel = param.numel()
    if numel == 0:
        return param
    gs_is_tensor = isinstance(grad_scale, torch.Tensor)
    step_is_tensor = isinstance(step, torch.Tensor)
    has_momentum = momentum != 0.0
    dummy = param  # stands in for absent tensors; constexpr flags keep it unread
    _sgd_step_kernel[(triton.cdiv(numel, SGD_BLOCK),)](
        param, grad, momentum_buffer if has_momentum else dummy,
        out if out is not None else dummy,
        found_inf.reshape(-1) if found_inf is not None else dummy,
        grad_scale.reshape(-1) if gs_is_tensor else dummy,
        step.reshape(-1) if step_is_tensor else dummy, numel,
        0 if step_is_tensor else int(step),
        1.0 if gs_is_tensor or grad_scale is None else float(grad_scale),
        float(weight_decay), float(momentum), 1.0 - dampening, -float(lr),
        GRAD_SCALE=grad_scale is not None, GRAD_SCALE_IS_TENSOR=gs_is_tensor,
        STEP_IS_TENSOR=step_is_tensor, HAS_FOUND_INF=found_inf is not None,
        HAS_WD=weight_decay != 0.0, HAS_MOMENTUM=has_momentum, NESTEROV=bool(nesterov),
        HAS_OUT=out is not None, NATIVE_NAN=native_nan(param.device), BLOCK=SGD_BLOCK,
        num_warps=SGD_WARPS, enable_fp_fusion=False)
    return param
