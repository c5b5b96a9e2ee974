"""Reference per-element math of AdEMAMix ([Note: AdEMAMix op order] in
``zkernels/optimizers/ademamix.py``; SEAM35.md's Seam 3)."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from .adamw import sqrt_rn


def _f32(x: float, like: torch.Tensor) -> torch.Tensor:
    """``x`` as a 0-d fp32 tensor on ``like``'s device: a divisor that every device divides by
    with an IEEE division (CUDA multiplies by the reciprocal of a Python or CPU scalar)."""
    return torch.tensor(x, dtype=torch.float32, device=like.device)


def elementwise(p: torch.Tensor, g: torch.Tensor, states: Sequence[Optional[torch.Tensor]],
                c: Sequence[float]) -> Tuple[torch.Tensor, List[Optional[torch.Tensor]]]:
    """One AdEMAMix step on fp32 tensors, in place: every operation a separate torch op,
    rounded once, in the seam's order (no ``add_(x, alpha=)``/``addcmul_``/``lerp_``, which
    torch's CPU kernels contract into multiply-adds).

    Args:
        p, g: fp32 parameter (updated in place) and unscaled fp32 gradient.
        states: fp32 ``exp_avg_fast``, ``exp_avg_slow``, ``exp_avg_sq`` (updated in place).
        c: ``ADEMAMIX.coefficients(h, step)``.

    Returns:
        ``(p, states)``.
    """
    b1, omb1, b2, omb2, b3, omb3, alpha, bc1, sbc2, eps, wd, lr = c
    m1, m2, v = states
    m1.mul_(b1).add_(g * omb1)
    m2.mul_(b3).add_(g * omb3)
    v.mul_(b2).add_((g * g) * omb2)
    d = (sqrt_rn(v) / _f32(sbc2, v)).add_(eps)
    u = (m1 / _f32(bc1, m1)).add_(m2 * alpha).div_(d)
    u.add_(p * wd)
    p.sub_(u * lr)
    return p, [m1, m2, v]
