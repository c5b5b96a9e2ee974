"""Triton per-element math of Lion (:func:`zkernels.reference.lion.elementwise`'s operations in
its order; run by ``optimizer.py``'s kernel, [Note: the optimizer body]; exact as [Note: exact
optimizer kernels] in ``_step.py`` says)."""
import triton
import triton.language as tl


@triton.jit
def _sign(x):
    """``torch.sign``: (0 < x) - (x < 0); +-0 and NaN give +0."""
    return tl.where(x > 0.0, 1.0, 0.0) - tl.where(x < 0.0, 1.0, 0.0)


@triton.jit
def _lion(p, g, m, s1, s2, beta1, one_minus_beta1, beta2, one_minus_beta2, decay, neg_lr, c6,
          c7, c8, c9, c10, c11, HAS_S0: tl.constexpr, HAS_S1: tl.constexpr,
          HAS_S2: tl.constexpr):
    u = _sign(m * beta1 + g * one_minus_beta1)
    p = p * decay
    p = p + u * neg_lr
    m = m * beta2 + g * one_minus_beta2
    return p, m, s1, s2


BODY = _lion
