"""Reference Lion step over a flat fp32 shard."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch

from ..optimizers import LION
from .optimizer import optimizer_step

Scalar = Union[float, int, torch.Tensor]


def lion_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, *, lr: float,
              beta1: float = 0.9, beta2: float = 0.99, weight_decay: float = 0.0,
              grad_scale: Optional[Scalar] = None, found_inf: Optional[torch.Tensor] = None,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One Lion update (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"; the
    rule of lucidrains' lion-pytorch), in place:
    ``p *= 1 - lr*wd; p -= lr * sign(b1*m + (1-b1)*g); m = b2*m + (1-b2)*g``.

    Every product and sum is its own fp32 operation, rounded once, in this order (no fused
    multiply-add), so the Triton and C++ paths can repeat it bit for bit. ``sign`` is
    ``torch.sign``: +-0 and NaN give 0.

    Args:
        param, exp_avg: 1-D contiguous fp32 buffers of equal length (the master shard and its
            momentum), updated in place.
        grad: 1-D contiguous, same length, fp32/bf16/fp16; read as fp32, divided by
            ``grad_scale`` when given.
        lr, beta1, beta2: hyperparameters (the paper's defaults for the betas).
        weight_decay: decoupled decay, applied as ``p *= 1 - lr*wd``.
        grad_scale: optional loss scale to divide the gradient by, float or 1-element tensor.
        found_inf: optional 1-element tensor; when nonzero the call changes nothing.
        out: optional 1-D buffer (fp32/bf16/fp16), same length, receiving the updated params
            cast (round to nearest even) to its dtype.

    Returns:
        ``param``.
    """
    return optimizer_step(LION, param, grad, (exp_avg,),
                          LION.coefficients(dict(lr=lr, betas=(beta1, beta2),
                                                 weight_decay=weight_decay)),
                          grad_scale=grad_scale, found_inf=found_inf, out=out)


def elementwise(p: torch.Tensor, g: torch.Tensor, states: Sequence[Optional[torch.Tensor]],
                c: Sequence[float]) -> Tuple[torch.Tensor, List[Optional[torch.Tensor]]]:
    """The Lion math of :func:`lion_step` on fp32 ``p`` and unscaled fp32 ``g``, in place;
    ``states`` = (exp_avg,), ``c`` = ``LION.coefficients(h)``. Returns ``(p, states)``."""
    b1, omb1, b2, omb2, decay, neg_lr = c
    (m,) = states
    update = torch.sign(m * b1 + g * omb1)
    p.mul_(decay)
    p.add_(update * neg_lr)
    m.mul_(b2).add_(g * omb2)
    return p, [m]
