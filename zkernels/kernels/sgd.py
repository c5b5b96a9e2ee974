"""Triton per-element math of SGD (:func:`zkernels.reference.sgd.elementwise`'s operations in
its order; run by ``optimizer.py``'s kernel, [Note: the optimizer body]; exact as [Note: exact
optimizer kernels] in ``_step.py`` says). The momentum buffer is state 0, absent (HAS_S0
False) when momentum is 0; ``first_step`` sets it to the gradient, as torch.optim.SGD's first
step does."""
import triton
import triton.language as tl


@triton.jit
def _sgd(p, g, b, s1, s2, weight_decay, momentum, one_minus_dampening, neg_lr, first_step,
         nesterov, c6, c7, c8, c9, c10, c11, HAS_S0: tl.constexpr, HAS_S1: tl.constexpr,
         HAS_S2: tl.constexpr):
    if weight_decay != 0.0:
        g = g + p * weight_decay
    if HAS_S0:
        if first_step != 0.0:
            b = g
        else:
            b = b * momentum + g * one_minus_dampening
        if nesterov != 0.0:
            g = g + b * momentum
        else:
            g = b
    p = p + g * neg_lr
    return p, b, s1, s2


BODY = _sgd
