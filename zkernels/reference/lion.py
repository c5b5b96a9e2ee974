"""Reference Lion step over a flat fp32 shard."""
from __future__ import annotations

from typing import Optional, Union

import torch

Scalar = Union[float, int, torch.Tensor]


def _value(x: Scalar) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


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
    if found_inf is not None and _value(found_inf) != 0.0:
        return param
    g = grad.float()
    if grad_scale is not None:
        g = g / _value(grad_scale)
    update = torch.sign(exp_avg * beta1 + g * (1.0 - beta1))
    param.mul_(1.0 - lr * weight_decay)
    param.add_(update * -lr)
    exp_avg.mul_(beta2).add_(g * (1.0 - beta2))
    if out is not None:
        out.copy_(param)
    return param
