"""Public multi-tensor AdamW step and fused sum of squares: checks, then dispatch."""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from . import _checks
from ._backend import Resolve, implementation

Scalar = Union[float, int, torch.Tensor]


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, *, lr: float, beta1: float, beta2: float, eps: float,
               weight_decay: float = 0.0, step: Scalar, decoupled: bool = True,
               grad_scale: Optional[Scalar] = None, found_inf: Optional[torch.Tensor] = None,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One fused AdamW update over a flat fp32 shard. See
    :func:`zkernels.reference.adamw_step` for the arguments."""
    return _adamw_step(implementation, param, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1,
                       beta2=beta2, eps=eps, weight_decay=weight_decay, step=step,
                       decoupled=decoupled, grad_scale=grad_scale, found_inf=found_inf,
                       out=out)


def _adamw_step(resolve: Resolve,
                param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, *, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float = 0.0, step: Scalar, decoupled: bool = True,
                grad_scale: Optional[Scalar] = None, found_inf: Optional[torch.Tensor] = None,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    fp32 = (torch.float32,)
    _checks.tensor("param", param, dtypes=fp32, one_dim=True)
    n, dev = param.numel(), param.device
    _checks.tensor("grad", grad, device=dev, numel=n, one_dim=True)
    _checks.tensor("exp_avg", exp_avg, dtypes=fp32, device=dev, numel=n, one_dim=True)
    _checks.tensor("exp_avg_sq", exp_avg_sq, dtypes=fp32, device=dev, numel=n, one_dim=True)
    if out is not None:
        _checks.tensor("out", out, device=dev, numel=n, one_dim=True)
    if found_inf is not None:
        _checks.tensor("found_inf", found_inf, dtypes=fp32, device=dev, numel=1)
    for name, t in (("step", step), ("grad_scale", grad_scale)):
        if isinstance(t, torch.Tensor):
            _checks.tensor(name, t, dtypes=None, device=dev, numel=1)
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"beta1 must be in [0, 1), got {beta1}")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"beta2 must be in [0, 1), got {beta2}")
    if not isinstance(step, torch.Tensor) and step < 1:
        raise ValueError(f"step must be >= 1 (the step number after incrementing), got {step}")
    if n == 0:
        return param
    return resolve("adamw_step", dev)(
        param, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, step=step, decoupled=decoupled, grad_scale=grad_scale,
        found_inf=found_inf, out=out)


def sum_squares(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum of squares over all elements of all tensors, in fp32, one launch. See
    :func:`zkernels.reference.sum_squares`."""
    return _sum_squares(implementation, tensors)


def _sum_squares(resolve: Resolve,
                 tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    _checks.tensor_list("tensors", tensors, same_dtype=False)
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    return resolve("sum_squares", tensors[0].device)(tensors)
