"""Public SGD step (torch.optim.SGD's rule): checks, then dispatch."""
from __future__ import annotations

from typing import Optional, Union

import torch

from . import _checks
from ._backend import Resolve, implementation

Scalar = Union[float, int, torch.Tensor]


def sgd_step(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: Optional[torch.Tensor],
             *, lr: float, momentum: float = 0.0, dampening: float = 0.0,
             weight_decay: float = 0.0, nesterov: bool = False, step: Scalar,
             grad_scale: Optional[Scalar] = None, found_inf: Optional[torch.Tensor] = None,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One fused SGD update over a flat fp32 shard. See :func:`zkernels.reference.sgd_step`
    for the arguments."""
    return _sgd_step(implementation, param, grad, momentum_buffer, lr=lr, momentum=momentum,
                     dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                     step=step, grad_scale=grad_scale, found_inf=found_inf, out=out)


def _sgd_step(resolve: Resolve, param: torch.Tensor, grad: torch.Tensor,
              momentum_buffer: Optional[torch.Tensor], *, lr: float, momentum: float = 0.0,
              dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
              step: Scalar, grad_scale: Optional[Scalar] = None,
              found_inf: Optional[torch.Tensor] = None,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    _checks.finite("momentum", momentum)
    if momentum < 0.0:
        raise ValueError(f"momentum must be >= 0, got {momentum}")
    if momentum == 0.0 and momentum_buffer is not None:
        raise ValueError("momentum_buffer must be None when momentum == 0 (it would never be "
                         "read nor written)")
    if momentum != 0.0 and momentum_buffer is None:
        raise ValueError(f"momentum_buffer must be an fp32 tensor when momentum != 0 "
                         f"(momentum={momentum})")
    if nesterov and (momentum <= 0.0 or dampening != 0.0):
        raise ValueError(f"nesterov needs momentum > 0 and dampening == 0 (as torch.optim.SGD), "
                         f"got momentum={momentum}, dampening={dampening}")
    n, dev = _checks.step_buffers(param, grad, out, found_inf, grad_scale,
                                  momentum_buffer=momentum_buffer, step=step)
    _checks.finite("lr", lr)
    _checks.finite("dampening", dampening)
    _checks.finite("weight_decay", weight_decay)
    if not isinstance(step, torch.Tensor) and step < 1:
        raise ValueError(f"step must be >= 1 (the step number after incrementing), got {step}")
    if n == 0:
        return param
    return resolve("sgd_step", dev)(
        param, grad, momentum_buffer, lr=lr, momentum=momentum, dampening=dampening,
        weight_decay=weight_decay, nesterov=nesterov, step=step, grad_scale=grad_scale,
        found_inf=found_inf, out=out)
