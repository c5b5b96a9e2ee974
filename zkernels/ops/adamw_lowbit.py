"""Public fused AdamW over low-bit moments (bf16, or blockwise int8 codes + fp32 scales):
checks, then dispatch. See [Note: low-bit moment formats] in
``zkernels/reference/adamw_lowbit.py``."""
from __future__ import annotations

from typing import Optional, Union

import torch

from . import _checks
from ._backend import Resolve, implementation
from .quant import check_block_size

Scalar = Union[float, int, torch.Tensor]


def adamw_step_lowbit(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                      exp_avg_sq: torch.Tensor, exp_avg_scales: Optional[torch.Tensor] = None,
                      exp_avg_sq_scales: Optional[torch.Tensor] = None, *, lr: float,
                      beta1: float, beta2: float, eps: float, weight_decay: float = 0.0,
                      step: Scalar, decoupled: bool = True,
                      grad_scale: Optional[Scalar] = None,
                      found_inf: Optional[torch.Tensor] = None,
                      out: Optional[torch.Tensor] = None, block_size: int = 256) -> torch.Tensor:
    """One fused AdamW update over low-bit moments. See
    :func:`zkernels.reference.adamw_step_lowbit` for the arguments."""
    return _adamw_step_lowbit(implementation, param, grad, exp_avg, exp_avg_sq, exp_avg_scales,
                              exp_avg_sq_scales, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                              weight_decay=weight_decay, step=step, decoupled=decoupled,
                              grad_scale=grad_scale, found_inf=found_inf, out=out,
                              block_size=block_size)


def _adamw_step_lowbit(resolve: Resolve, param, grad, exp_avg, exp_avg_sq,
                       exp_avg_scales=None, exp_avg_sq_scales=None, *, block_size: int = 256,
                       **kw) -> torch.Tensor:
    _checks.tensor("param", param, dtypes=(torch.float32, torch.bfloat16), one_dim=True)
    n, dev = param.numel(), param.device
    if not isinstance(exp_avg, torch.Tensor) or exp_avg.dtype not in (torch.bfloat16,
                                                                      torch.int8):
        got = exp_avg.dtype if isinstance(exp_avg, torch.Tensor) else type(exp_avg).__name__
        raise TypeError(f"exp_avg must be a bf16 tensor (bf16 moments) or int8 codes (int8 "
                        f"moments), got {got}")
    if exp_avg.dtype == torch.bfloat16:
        _checks.tensor("exp_avg", exp_avg, dtypes=(torch.bfloat16,), device=dev, numel=n,
                       one_dim=True)
        _checks.tensor("exp_avg_sq", exp_avg_sq, dtypes=(torch.bfloat16,), device=dev,
                       numel=n, one_dim=True)
        for name, s in (("exp_avg_scales", exp_avg_scales),
                        ("exp_avg_sq_scales", exp_avg_sq_scales)):
            if s is not None:
                raise ValueError(f"{name} must be None for bf16 moments (they have no scales)")
    else:
        check_block_size(block_size)
        nb = -(-n // block_size)
        _checks.tensor("exp_avg", exp_avg, dtypes=(torch.int8,), device=dev, numel=n,
                       one_dim=True)
        _checks.tensor("exp_avg_sq", exp_avg_sq, dtypes=(torch.uint8,), device=dev, numel=n,
                       one_dim=True)
        for name, s in (("exp_avg_scales", exp_avg_scales),
                        ("exp_avg_sq_scales", exp_avg_sq_scales)):
            if s is None:
                raise ValueError(f"{name} is required with int8 moments (fp32, one per block "
                                 f"of {block_size}: {nb})")
            _checks.tensor(name, s, dtypes=(torch.float32,), device=dev, numel=nb,
                           one_dim=True)
    _check_step_args(n, dev, grad, **kw)
    if n == 0:
        return param
    return resolve("adamw_step_lowbit", dev)(
        param, grad, exp_avg, exp_avg_sq, exp_avg_scales, exp_avg_sq_scales,
        block_size=block_size, **kw)


def _check_step_args(n: int, dev: torch.device, grad, *, lr, beta1, beta2, eps,
                     weight_decay=0.0, step, decoupled=True, grad_scale=None, found_inf=None,
                     out=None) -> None:
    """The checks ``ops/adamw.py`` makes of the arguments the two AdamW ops share."""
    _checks.tensor("grad", grad, device=dev, numel=n, one_dim=True)
    if out is not None:
        _checks.tensor("out", out, device=dev, numel=n, one_dim=True)
    if found_inf is not None:
        _checks.tensor("found_inf", found_inf, dtypes=(torch.float32,), device=dev, numel=1)
    for name, t in (("step", step), ("grad_scale", grad_scale)):
        if isinstance(t, torch.Tensor):
            _checks.tensor(name, t, dtypes=None, device=dev, numel=1)
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"beta1 must be in [0, 1), got {beta1}")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"beta2 must be in [0, 1), got {beta2}")
    if not isinstance(step, torch.Tensor) and step < 1:
        raise ValueError(f"step must be >= 1 (the step number after incrementing), got {step}")
