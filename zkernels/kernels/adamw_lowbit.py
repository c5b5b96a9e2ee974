"""Triton fused AdamW over low-bit moments (bf16, or blockwise int8 codes + fp32 scales): one
pass that dequantizes, updates and requantizes, with the arithmetic of
``zkernels/reference/adamw_lowbit.py`` ([Note: low-bit moment formats]).

Each program owns ``ROWS`` whole quantization blocks (a (ROWS, BLOCK) tile), so a block's
absmax is one in-register reduction; the bf16 format uses the same tile with a fixed BLOCK.
The AdamW arithmetic is that of ``kernels/adamw.py`` operation for operation; the block absmax
that of ``kernels/quant.py``, and the 8-bit float codes the reference's integer arithmetic on
the bits (``tl.div_rn``, exact ``_rint``, no FP fusion).
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch
import triton
import triton.language as tl

from ._rounding import round_to, widen
from ._step import load_step, step_args, step_gate, store_step
from .adamw import _pow_int, _split
from .quant import _rint, _scale, _top

Scalar = Union[float, int, torch.Tensor]
TILE = 2048
WARPS = 8
BF16_BLOCK = 256  # the bf16 format has no blocks; this is only its tile's row length
# The 8-bit float codes of [Note: low-bit moment formats] (the reference's CODE_EMIN,
# EXP_AVG_MANT_BITS, EXP_AVG_SQ_MANT_BITS; tests/ops/test_adamw_lowbit.py checks they agree).
CODE_EMIN = -14
EXP_AVG_MANT_BITS = 3
EXP_AVG_SQ_MANT_BITS = 4
_BASE: tl.constexpr = tl.constexpr((127 + CODE_EMIN) << 23)   # the bits of 2**CODE_EMIN


def _code_constants(mant: int):
    """(shift, half - 1, 2**mant, 2**(mant - emin), 2**(emin - mant)) of a code, as constexprs
    (the interpreter does no arithmetic on constexprs inside a kernel)."""
    shift = 23 - mant
    return tuple(tl.constexpr(x) for x in (shift, (1 << (shift - 1)) - 1, 1 << mant,
                                           2.0 ** (mant - CODE_EMIN), 2.0 ** (CODE_EMIN - mant)))


_M_SHIFT, _M_HALF, _M_ONE, _M_UP, _M_STEP = _code_constants(EXP_AVG_MANT_BITS)
_V_SHIFT, _V_HALF, _V_ONE, _V_UP, _V_STEP = _code_constants(EXP_AVG_SQ_MANT_BITS)


@triton.jit
def _encode(y, SHIFT: tl.constexpr, HALF: tl.constexpr, ONE: tl.constexpr, UP: tl.constexpr):
    """``reference.adamw_lowbit.encode_ratio``: int32 codes of fp32 ``y`` in [0, 1]."""
    d = y.to(tl.int32, bitcast=True) - _BASE
    normal = ((d + HALF + ((d >> SHIFT) & 1)) >> SHIFT) + ONE
    sub = _rint(y * UP)
    return tl.where(d >= 0, normal, sub)


@triton.jit
def _decode(c, SHIFT: tl.constexpr, ONE: tl.constexpr, STEP: tl.constexpr):
    """``reference.adamw_lowbit.decode_ratio``: fp32 values of int32 codes ``c`` >= 0."""
    d = c - ONE
    normal = ((d << SHIFT) + _BASE).to(tl.float32, bitcast=True)
    sub = c.to(tl.float32) * STEP
    return tl.where(d >= 0, normal, sub)


@triton.jit
def _adamw_math(p, g, m, v, decay, weight_decay, one_minus_beta1, beta2, one_minus_beta2,
                step_size, bias_correction2_sqrt, eps, DECOUPLED: tl.constexpr,
                HAS_WD: tl.constexpr, LERP_SMALL_WEIGHT: tl.constexpr):
    """``kernels/adamw.py``'s ``_adamw_block`` arithmetic on fp32 tiles (``g`` unscaled):
    (p, m, v) updated."""
    if HAS_WD:
        if DECOUPLED:
            p = p * decay
        else:
            g = g + weight_decay * p
    if LERP_SMALL_WEIGHT:
        m = m + one_minus_beta1 * (g - m)
    else:
        m = g - (g - m) * (1.0 - one_minus_beta1)
    v = v * beta2 + one_minus_beta2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p + (-step_size) * tl.div_rn(m, denom)
    return p, m, v


@triton.jit(do_not_specialize=["numel", "num_blocks"])
def _adamw_lowbit_kernel(param_ptr, grad_ptr, m_ptr, v_ptr, ms_ptr, vs_ptr, out_ptr,
                         found_inf_ptr, grad_scale_ptr, step_ptr, numel, num_blocks, lr,
                         grad_scale, decay, weight_decay, one_minus_beta1, beta2,
                         one_minus_beta2, beta1_hi, beta1_lo, beta2_hi, beta2_lo, step_size,
                         bias_correction2_sqrt, eps, INT8: tl.constexpr,
                         GRAD_SCALE: tl.constexpr, GRAD_SCALE_IS_TENSOR: tl.constexpr,
                         STEP_IS_TENSOR: tl.constexpr, HAS_FOUND_INF: tl.constexpr,
                         DECOUPLED: tl.constexpr, HAS_WD: tl.constexpr,
                         LERP_SMALL_WEIGHT: tl.constexpr, HAS_OUT: tl.constexpr,
                         NATIVE_NAN: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = offs < numel
    run, grad_scale = step_gate(found_inf_ptr, grad_scale_ptr, grad_scale,
                                GRAD_SCALE_IS_TENSOR, HAS_FOUND_INF)
    if STEP_IS_TENSOR:
        t = tl.load(step_ptr).to(tl.int64)
        beta1_f64 = tl.cast(beta1_hi, tl.float64) + tl.cast(beta1_lo, tl.float64)
        beta2_f64 = tl.cast(beta2_hi, tl.float64) + tl.cast(beta2_lo, tl.float64)
        step_size = (tl.cast(lr, tl.float64) / (1.0 - _pow_int(beta1_f64, t))).to(tl.float32)
        bias_correction2_sqrt = tl.sqrt_rn((1.0 - _pow_int(beta2_f64, t)).to(tl.float32))
    if run:
        p, g = load_step(param_ptr, grad_ptr, offs, mask, grad_scale, GRAD_SCALE)
        if INT8:
            row_ok = rows < num_blocks
            sm = tl.load(ms_ptr + rows, mask=row_ok, other=0.0)
            sv = tl.load(vs_ptr + rows, mask=row_ok, other=0.0)
            qm = tl.load(m_ptr + offs, mask=mask, other=0).to(tl.int32)
            m = _decode(tl.abs(qm), _M_SHIFT, _M_ONE, _M_STEP) * sm[:, None]
            m = tl.where(qm < 0, -m, m)
            qv = tl.load(v_ptr + offs, mask=mask, other=0).to(tl.int32)
            r = _decode(qv, _V_SHIFT, _V_ONE, _V_STEP) * sv[:, None]
            v = r * r
        else:
            m = widen(tl.load(m_ptr + offs, mask=mask, other=0.0))
            v = widen(tl.load(v_ptr + offs, mask=mask, other=0.0))
        p, m, v = _adamw_math(p, g, m, v, decay, weight_decay, one_minus_beta1, beta2,
                              one_minus_beta2, step_size, bias_correction2_sqrt, eps,
                              DECOUPLED, HAS_WD, LERP_SMALL_WEIGHT)
        store_step(param_ptr, out_ptr, offs, mask, p, HAS_OUT, NATIVE_NAN)
        if INT8:
            # Lanes past the end hold 0 so they never raise a block's absmax.
            m = tl.where(mask, m, 0.0)
            r = tl.where(mask, tl.sqrt_rn(v), 0.0)
            scale_m, ok_m, div_m = _scale(_top(m), 1)
            scale_v, ok_v, div_v = _scale(_top(r), 1)
            mag = _encode(tl.div_rn(tl.abs(m), div_m[:, None]), _M_SHIFT, _M_HALF, _M_ONE, _M_UP)
            cm = tl.where(ok_m[:, None], tl.where(m < 0, -mag, mag), 0)
            cv = tl.where(ok_v[:, None],
                          _encode(tl.div_rn(r, div_v[:, None]), _V_SHIFT, _V_HALF, _V_ONE, _V_UP),
                          0)
            tl.store(m_ptr + offs, cm.to(tl.int8), mask=mask)
            tl.store(v_ptr + offs, cv.to(tl.uint8), mask=mask)
            tl.store(ms_ptr + rows, scale_m, mask=row_ok)
            tl.store(vs_ptr + rows, scale_v, mask=row_ok)
        else:
            tl.store(m_ptr + offs, round_to(m, tl.bfloat16, NATIVE_NAN), mask=mask)
            tl.store(v_ptr + offs, round_to(v, tl.bfloat16, NATIVE_NAN), mask=mask)


def adamw_step_lowbit(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                      exp_avg_sq: torch.Tensor, exp_avg_scales: Optional[torch.Tensor] = None,
                      exp_avg_sq_scales: Optional[torch.Tensor] = None, *, lr: float,
                      beta1: float, beta2: float, eps: float, weight_decay: float = 0.0,
                      step: Scalar, decoupled: bool = True,
                      grad_scale: Optional[Scalar] = None,
                      found_inf: Optional[torch.Tensor] = None,
                      out: Optional[torch.Tensor] = None, block_size: int = 256) -> torch.Tensor:
    """One fused AdamW update over low-bit moments, in place, one pass. Same arguments as
    :func:`zkernels.reference.adamw_step_lowbit`.

    Returns:
        ``param``.
    """
    numel = param.numel()
    if numel == 0:
        return param
    int8 = exp_avg.dtype == torch.int8
    block = block_size if int8 else BF16_BLOCK
    rows = max(1, TILE // block)
    num_blocks = triton.cdiv(numel, block)
    step_is_tensor = isinstance(step, torch.Tensor)
    if step_is_tensor:
        step_size, bias_correction2_sqrt = 0.0, 1.0
    else:
        step_size = lr / (1.0 - beta1 ** float(step))
        bias_correction2_sqrt = math.sqrt(1.0 - beta2 ** float(step))
    out_arg, found_inf_arg, gs_arg, gs, flags = step_args(param, grad_scale, found_inf, out)
    beta1_hi, beta1_lo = _split(beta1)
    beta2_hi, beta2_lo = _split(beta2)
    dummy = param
    _adamw_lowbit_kernel[(triton.cdiv(num_blocks, rows),)](
        param, grad, exp_avg, exp_avg_sq,
        exp_avg_scales if int8 else dummy, exp_avg_sq_scales if int8 else dummy, out_arg,
        found_inf_arg, gs_arg, step.reshape(-1) if step_is_tensor else dummy, numel,
        num_blocks, float(lr), gs, 1.0 - lr * weight_decay, float(weight_decay), 1.0 - beta1, float(beta2), 1.0 - beta2,
        beta1_hi, beta1_lo, beta2_hi, beta2_lo, float(step_size), float(bias_correction2_sqrt),
        float(eps), INT8=int8, STEP_IS_TENSOR=step_is_tensor, DECOUPLED=bool(decoupled),
        HAS_WD=weight_decay != 0.0, LERP_SMALL_WEIGHT=abs(1.0 - beta1) < 0.5, BLOCK=block,
        ROWS=rows, num_warps=WARPS, enable_fp_fusion=False, **flags)
    return param
