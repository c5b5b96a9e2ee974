"""A deliberately wrong AdEMAMix Triton body (beta1 where beta3 belongs), for the ``catches_``
row of tests/ops/test_optimizer_step.py (a module: ``triton.jit`` needs ``tl`` visible)."""
import triton
import triton.language as tl

from zkernels.kernels.ademamix import _ademamix


@triton.jit
def _wrong(p, g, m1, m2, v, b1, omb1, b2, omb2, b3, omb3, alpha, bc1, sbc2, eps, wd, lr,
           HAS_S0: tl.constexpr, HAS_S1: tl.constexpr, HAS_S2: tl.constexpr):
    return _ademamix(p, g, m1, m2, v, b1, omb1, b2, omb2, b1, omb1, alpha, bc1, sbc2, eps, wd,
                     lr, HAS_S0, HAS_S1, HAS_S2)


WRONG_ADEMAMIX = _wrong
