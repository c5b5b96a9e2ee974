"""The Triton step of every element-wise optimizer: one kernel, the shared prologue and
epilogue (``_step.py``) around the definition's ``BODY`` (``zkernels/kernels/<name>.py``), a
``triton.jit`` function passed as a constexpr, so each definition compiles its own kernel.

[Note: the optimizer body]
``BODY(p, g, s0, s1, s2, c0, ..., c11, HAS_S0, HAS_S1, HAS_S2) -> (p, s0, s1, s2)`` on fp32
blocks: ``p`` the parameter, ``g`` the unscaled gradient, ``s*`` the states in the
definition's order (widened to fp32; an absent one, HAS_S* False, holds ``p`` and must not be
read), ``c*`` the coefficients by position (fp32; unused ones 0). The kernel stores what it
returns rounded to nearest even in each buffer's dtype (the bf16 state form included).
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import triton
import triton.language as tl

from .. import optimizers
from ._rounding import round_to, widen
from ._step import load_step, step_args, step_gate, store_step

Scalar = Union[float, int, torch.Tensor]

# The definitions with a BODY here (``zkernels/kernels/<name>.py``); AdamW keeps its kernels.
OPTIMIZER_KINDS = ("lion", "sgd", "ademamix")
MAX_STATES = 3
MAX_COEFFS = 12
# Up to 4 fp32 streams in and 3-4 out per element, as AdamW: 2048 elements over 8 warps keeps
# 8 elements (two 128-bit accesses per stream) per thread with few live registers.
BLOCK = 2048
WARPS = 8


@triton.jit
def _load_state(ptr, offs, mask, p, HAS: tl.constexpr):
    if HAS:
        return widen(tl.load(ptr + offs, mask=mask))
    else:
        return p


@triton.jit
def _store_state(ptr, offs, mask, s, HAS: tl.constexpr, NATIVE_NAN: tl.constexpr):
    if HAS:
        tl.store(ptr + offs, round_to(s, ptr.dtype.element_ty, NATIVE_NAN), mask=mask)


@triton.jit
def _block(param_ptr, grad_ptr, s0_ptr, s1_ptr, s2_ptr, out_ptr, offs, numel, grad_scale,
           c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, BODY: tl.constexpr,
           HAS_S0: tl.constexpr, HAS_S1: tl.constexpr, HAS_S2: tl.constexpr,
           MASKED: tl.constexpr, GRAD_SCALE: tl.constexpr, HAS_OUT: tl.constexpr,
           NATIVE_NAN: tl.constexpr):
    if MASKED:
        mask = offs < numel
    else:
        mask = None
    p, g = load_step(param_ptr, grad_ptr, offs, mask, grad_scale, GRAD_SCALE)
    s0 = _load_state(s0_ptr, offs, mask, p, HAS_S0)
    s1 = _load_state(s1_ptr, offs, mask, p, HAS_S1)
    s2 = _load_state(s2_ptr, offs, mask, p, HAS_S2)
    p, s0, s1, s2 = BODY(p, g, s0, s1, s2, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11,
                         HAS_S0, HAS_S1, HAS_S2)
    _store_state(s0_ptr, offs, mask, s0, HAS_S0, NATIVE_NAN)
    _store_state(s1_ptr, offs, mask, s1, HAS_S1, NATIVE_NAN)
    _store_state(s2_ptr, offs, mask, s2, HAS_S2, NATIVE_NAN)
    store_step(param_ptr, out_ptr, offs, mask, p, HAS_OUT, NATIVE_NAN)


@triton.jit(do_not_specialize=["numel"])  # no recompile per shard size
def _optimizer_step_kernel(param_ptr, grad_ptr, s0_ptr, s1_ptr, s2_ptr, out_ptr, found_inf_ptr,
                           grad_scale_ptr, numel, grad_scale, c0, c1, c2, c3, c4, c5, c6, c7,
                           c8, c9, c10, c11, BODY: tl.constexpr, HAS_S0: tl.constexpr,
                           HAS_S1: tl.constexpr, HAS_S2: tl.constexpr,
                           GRAD_SCALE: tl.constexpr, GRAD_SCALE_IS_TENSOR: tl.constexpr,
                           HAS_FOUND_INF: tl.constexpr, HAS_OUT: tl.constexpr,
                           NATIVE_NAN: tl.constexpr, BLOCK: tl.constexpr):
    """One step of ``BODY``'s optimizer over one BLOCK of the shard, in place (plus the
    rounded copy in ``out``); full blocks unmasked, the tail masked."""
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    run, grad_scale = step_gate(found_inf_ptr, grad_scale_ptr, grad_scale,
                                GRAD_SCALE_IS_TENSOR, HAS_FOUND_INF)
    if run:
        if start + BLOCK <= numel:
            _block(param_ptr, grad_ptr, s0_ptr, s1_ptr, s2_ptr, out_ptr, offs, numel,
                   grad_scale, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, BODY, HAS_S0,
                   HAS_S1, HAS_S2, False, GRAD_SCALE, HAS_OUT, NATIVE_NAN)
        else:
            _block(param_ptr, grad_ptr, s0_ptr, s1_ptr, s2_ptr, out_ptr, offs, numel,
                   grad_scale, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, BODY, HAS_S0,
                   HAS_S1, HAS_S2, True, GRAD_SCALE, HAS_OUT, NATIVE_NAN)


def body(defn):
    """The definition's ``BODY`` ([Note: the optimizer body]).

    Raises:
        ValueError: a definition without one here.
    """
    return optimizers.backend_math(defn, __package__, OPTIMIZER_KINDS, "BODY",
                                   "zkernels.kernels")


def optimizer_step(defn, param: torch.Tensor, grad: torch.Tensor,
                   states: Sequence[Optional[torch.Tensor]], coeffs: Sequence[float], *,
                   grad_scale: Optional[Scalar] = None, found_inf: Optional[torch.Tensor] = None,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One fused step of the element-wise optimizer ``defn``, in place, one pass. Same
    arguments as :func:`zkernels.reference.optimizer_step`; ``grad_scale`` (float or 1-element
    tensor) and ``found_inf`` (1-element fp32 tensor, nonzero: change nothing) may live on the
    device and are then read by the kernel, never by the host.

    Returns:
        ``param``.
    """
    fn = body(defn)
    numel = param.numel()
    if numel == 0:
        return param
    out_arg, found_inf_arg, gs_arg, gs, flags = step_args(param, grad_scale, found_inf, out)
    bufs = list(states) + [None] * (MAX_STATES - len(states))
    cs = [float(c) for c in coeffs] + [0.0] * (MAX_COEFFS - len(coeffs))
    _optimizer_step_kernel[(triton.cdiv(numel, BLOCK),)](
        param, grad, *(param if b is None else b for b in bufs), out_arg, found_inf_arg,
        gs_arg, numel, gs, *cs, BODY=fn, HAS_S0=bufs[0] is not None,
        HAS_S1=bufs[1] is not None, HAS_S2=bufs[2] is not None, BLOCK=BLOCK, num_warps=WARPS,
        enable_fp_fusion=False, **flags)
    return param
