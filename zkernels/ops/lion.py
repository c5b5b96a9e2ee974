"""Public Lion step: checks, then dispatch."""
from __future__ import annotations

from typing import Optional, Union

import torch

from . import _checks
from ._backend import Resolve, implementation

Scalar = Union[float, int, torch.Tensor]


def lion_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, *, lr: float,
              beta1: float = 0.9, beta2: float = 0.99, weight_decay: float = 0.0,
              grad_scale: Optional[Scalar] = None, found_inf: Optional[torch.Tensor] = None,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One fused Lion update over a flat fp32 shard. See :func:`zkernels.reference.lion_step`
    for the arguments."""
    return _lion_step(implementation, param, grad, exp_avg, lr=lr, beta1=beta1, beta2=beta2,
                      weight_decay=weight_decay, grad_scale=grad_scale, found_inf=found_inf,
                      out=out)


def _lion_step(resolve: Resolve, param: torch.Tensor, grad: torch.Tensor,
               exp_avg: torch.Tensor, *, lr: float, beta1: float = 0.9, beta2: float = 0.99,
               weight_decay: float = 0.0, grad_scale: Optional[Scalar] = None,
               found_inf: Optional[torch.Tensor] = None,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    n, dev = _checks.step_buffers(param, grad, out, found_inf, grad_scale, exp_avg=exp_avg)
    _checks.unit_interval("beta1", beta1)
    _checks.unit_interval("beta2", beta2)
    _checks.finite("lr", lr)
    _checks.finite("weight_decay", weight_decay)
    if n == 0:
        return param
    return resolve("lion_step", dev)(
        param, grad, exp_avg, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
        grad_scale=grad_scale, found_inf=found_inf, out=out)
