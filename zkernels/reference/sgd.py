"""Reference SGD step (momentum, dampening, nesterov, weight decay) over a flat fp32 shard."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch

from ..optimizers import SGD
from .optimizer import _value, optimizer_step

Scalar = Union[float, int, torch.Tensor]


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
    h = SGD.resolve(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                    nesterov=nesterov)
    return optimizer_step(SGD, param, grad, (momentum_buffer if momentum != 0.0 else None,),
                          SGD.coefficients(h, int(_value(step))), grad_scale=grad_scale,
                          found_inf=found_inf, out=out)


def elementwise(p: torch.Tensor, g: torch.Tensor, states: Sequence[Optional[torch.Tensor]],
                c: Sequence[float]) -> Tuple[torch.Tensor, List[Optional[torch.Tensor]]]:
    """The SGD math of :func:`sgd_step` on fp32 ``p`` and unscaled fp32 ``g``, in place;
    ``states`` = (momentum_buffer or None,), ``c`` = ``SGD.coefficients(h, step)``. Returns
    ``(p, states)``."""
    weight_decay, momentum, one_minus_dampening, neg_lr, first, nesterov = c
    (buf,) = states
    if weight_decay != 0.0:
        g = g + p * weight_decay
    if buf is not None:
        if first:
            buf.copy_(g)
        else:
            buf.mul_(momentum).add_(g * one_minus_dampening)
        g = g + buf * momentum if nesterov else buf
    p.add_(g * neg_lr)
    return p, [buf]
