"""Reference SGD step (momentum, dampening, nesterov, weight decay) over a flat fp32 shard."""
from __future__ import annotations

from typing import Optional, Union

import torch

Scalar = Union[float, int, torch.Tensor]


def _value(x: Scalar) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def sgd_step(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: Optional[torch.Tensor],
             *, lr: float, momentum: float = 0.0, dampening: float = 0.0,
             weight_decay: float = 0.0, nesterov: bool = False, step: Scalar,
             grad_scale: Optional[Scalar] = None, found_inf: Optional[torch.Tensor] = None,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One SGD update as ``torch.optim.SGD`` defines it, in place:
    ``g += wd*p``; with momentum, ``b = g`` on the first step (torch clones the gradient into
    the new buffer) and ``b = momentum*b + (1-dampening)*g`` after; ``g = g + momentum*b`` with
    nesterov, else ``g = b``; ``p -= lr*g``.

    Every product and sum is its own fp32 operation, rounded once, in this order (torch's
    ``add(x, alpha=a)`` may fuse ``a*x`` into a multiply-add; here it never does), so the Triton
    and C++ paths repeat it bit for bit and torch.optim.SGD agrees to fp32 round-off.

    Args:
        param: 1-D contiguous fp32 buffer (the master shard), updated in place.
        grad: 1-D contiguous, same length, fp32/bf16/fp16; read as fp32, divided by
            ``grad_scale`` when given.
        momentum_buffer: 1-D contiguous fp32, same length, updated in place; may be None when
            ``momentum == 0`` (then it is not read).
        lr, momentum, dampening, weight_decay, nesterov: as ``torch.optim.SGD``.
        step: the step number after incrementing (1 on the first step: the buffer is set to
            the gradient), int or 1-element tensor.
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
    if weight_decay != 0.0:
        g = g + param * weight_decay
    if momentum != 0.0:
        if _value(step) == 1:
            momentum_buffer.copy_(g)
        else:
            momentum_buffer.mul_(momentum).add_(g * (1.0 - dampening))
        g = g + momentum_buffer * momentum if nesterov else momentum_buffer
    param.add_(g * -lr)
    if out is not None:
        out.copy_(param)
    return param
