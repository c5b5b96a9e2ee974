"""Triton per-element math of AdEMAMix ([Note: AdEMAMix op order] in
zkernels/optimizers/ademamix.py; run by ``optimizer.py``'s kernel, [Note: the optimizer body]):
the reference's operations in its order, IEEE divisions and square root, no FMA ([Note: exact
optimizer kernels] in ``_step.py``)."""
import triton
import triton.language as tl


@triton.jit
def _ademamix(p, g, m1, m2, v, beta1, one_minus_beta1, beta2, one_minus_beta2, beta3,
              one_minus_beta3, alpha, bias_correction1, bias_correction2_sqrt, eps,
              weight_decay, lr, HAS_S0: tl.constexpr, HAS_S1: tl.constexpr,
              HAS_S2: tl.constexpr):
    m1 = m1 * beta1 + g * one_minus_beta1
    m2 = m2 * beta3 + g * one_minus_beta3
    v = v * beta2 + (g * g) * one_minus_beta2
    d = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    u = tl.div_rn(tl.div_rn(m1, bias_correction1) + m2 * alpha, d)
    u = u + p * weight_decay
    p = p - u * lr
    return p, m1, m2, v


BODY = _ademamix
