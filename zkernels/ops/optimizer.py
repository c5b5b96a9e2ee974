"""Public step of every element-wise optimizer, by definition: checks, then dispatch ([Note:
the generic optimizer step] in ``zkernels/reference/optimizer.py``)."""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch

from .. import optimizers
from . import _checks
from ._backend import optimizer_implementation

Scalar = Union[float, int, torch.Tensor]
# ``resolve(defn, fp32, device) -> implementation``: how the checked op finds its backend.
ResolveOptimizer = Callable[[optimizers.ElementwiseOptimizer, bool, torch.device], Callable]
_FP32 = (torch.float32,)


def optimizer_step(defn, param: torch.Tensor, grad: torch.Tensor,
                   states: Sequence[Optional[torch.Tensor]], coeffs: Sequence[float], *,
                   grad_scale: Optional[Scalar] = None, found_inf: Optional[torch.Tensor] = None,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One fused step of the element-wise optimizer ``defn`` over a flat shard, in place. See
    :func:`zkernels.reference.optimizer_step` for the arguments.

    Raises:
        ValueError / TypeError: an unknown definition, a tensor of the wrong dtype, device,
            length or layout, a wrong number of states or coefficients (each names the
            argument). RuntimeError: a forced backend that does not implement ``defn``.
    """
    return _optimizer_step(optimizer_implementation, defn, param, grad, states, coeffs,
                           grad_scale=grad_scale, found_inf=found_inf, out=out)


def _optimizer_step(resolve: ResolveOptimizer, defn, param, grad, states, coeffs, *,
                    grad_scale=None, found_inf=None, out=None) -> torch.Tensor:
    try:
        defn = optimizers.get(defn)
    except ValueError as exc:
        raise ValueError(f"defn: {exc}") from None
    n, dev = _checks.step_buffers(param, grad, out, found_inf, grad_scale,
                                  param_dtypes=_checks.FLOAT_DTYPES)
    fp32 = check_states(defn, states, n, dev) and param.dtype == torch.float32
    check_coefficients(defn, coeffs)
    if n == 0:
        return param
    return resolve(defn, fp32, dev)(defn, param, grad, states, coeffs, grad_scale=grad_scale,
                                    found_inf=found_inf, out=out)


def check_states(defn: optimizers.ElementwiseOptimizer, states, n: int,
                 device: torch.device) -> bool:
    """``states``: a list or tuple of the definition's buffers in its order, each None or a
    1-D contiguous tensor of ``n`` elements on ``device``, all fp32, or all bf16 where the
    definition has the bf16 low-bit form. Returns whether they are fp32.

    Raises:
        TypeError / ValueError naming ``states[i] (<state name>)``.
    """
    if isinstance(states, torch.Tensor) or not isinstance(states, (list, tuple)):
        raise TypeError(f"states must be a list or tuple of {len(defn.states)} tensors or None "
                        f"({', '.join(defn.state_names)}), got {type(states).__name__}")
    if len(states) != len(defn.states):
        raise ValueError(f"states must hold {len(defn.states)} entries for "
                         f"optimizer={defn.name!r} ({', '.join(defn.state_names)}), got "
                         f"{len(states)}")
    dtypes = _FP32 + ((torch.bfloat16,) if "bf16" in defn.lowbit else ())
    first = None
    for i, (spec, buf) in enumerate(zip(defn.states, states)):
        if buf is None:
            continue
        name = f"states[{i}] ({spec.name})"
        _checks.tensor(name, buf, dtypes=dtypes, device=device, numel=n, one_dim=True)
        if first is not None and buf.dtype != first:
            raise TypeError(f"{name} has dtype {buf.dtype} but the states before it {first}: "
                            f"one state form per call")
        first = buf.dtype
    return first in (None, torch.float32)


def check_coefficients(defn: optimizers.ElementwiseOptimizer, coeffs) -> None:
    """``coeffs``: the definition's ``coefficients(h, step)``, real numbers in its order.

    Raises:
        ValueError naming ``coeffs`` (and the entry).
    """
    names = defn.coefficient_names
    if isinstance(coeffs, (str, bytes)) or not isinstance(coeffs, Sequence) or \
            len(coeffs) != len(names):
        raise ValueError(f"coeffs must be the {len(names)} numbers of "
                         f"optimizer={defn.name!r}'s coefficients(h, step) ({', '.join(names)}), "
                         f"got {coeffs!r}")
    for i, c in enumerate(coeffs):
        if not isinstance(c, (int, float)) or isinstance(c, bool):
            raise ValueError(f"coeffs[{i}] ({names[i]}) must be a real number, got {c!r}")


# The per-optimizer keyword forms of the op (kept for their callers: ZeRO's fused rule, the
# bench, scripts): the definition's resolve checks the keywords, its coefficients form the
# scalars, and the generic op runs the step.

def lion_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, *, lr: float,
              beta1: float = 0.9, beta2: float = 0.99, weight_decay: float = 0.0,
              grad_scale: Optional[Scalar] = None, found_inf: Optional[torch.Tensor] = None,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One fused Lion update over a flat shard: :func:`optimizer_step` of
    :data:`zkernels.optimizers.LION`. See :func:`zkernels.reference.lion_step` for the
    arguments."""
    return _lion_step(optimizer_implementation, param, grad, exp_avg, lr=lr, beta1=beta1,
                      beta2=beta2, weight_decay=weight_decay, grad_scale=grad_scale,
                      found_inf=found_inf, out=out)


def _lion_step(resolve: ResolveOptimizer, param, grad, exp_avg, *, lr, beta1=0.9, beta2=0.99,
               weight_decay=0.0, grad_scale=None, found_inf=None, out=None) -> torch.Tensor:
    h = optimizers.LION.resolve(lr=lr, betas=(beta1, beta2), weight_decay=weight_decay)
    return _optimizer_step(resolve, optimizers.LION, param, grad, [exp_avg],
                           optimizers.LION.coefficients(h), grad_scale=grad_scale,
                           found_inf=found_inf, out=out)


def sgd_step(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: Optional[torch.Tensor],
             *, lr: float, momentum: float = 0.0, dampening: float = 0.0,
             weight_decay: float = 0.0, nesterov: bool = False, step: Scalar,
             grad_scale: Optional[Scalar] = None, found_inf: Optional[torch.Tensor] = None,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One fused SGD update over a flat shard: :func:`optimizer_step` of
    :data:`zkernels.optimizers.SGD`. See :func:`zkernels.reference.sgd_step` for the
    arguments; a tensor ``step`` is read on the host (its only use is whether it is 1)."""
    return _sgd_step(optimizer_implementation, param, grad, momentum_buffer, lr=lr,
                     momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                     nesterov=nesterov, step=step, grad_scale=grad_scale, found_inf=found_inf,
                     out=out)


def _sgd_step(resolve: ResolveOptimizer, param, grad, momentum_buffer, *, lr, momentum=0.0,
              dampening=0.0, weight_decay=0.0, nesterov=False, step, grad_scale=None,
              found_inf=None, out=None) -> torch.Tensor:
    h = optimizers.SGD.resolve(lr=lr, momentum=momentum, dampening=dampening,
                              weight_decay=weight_decay, nesterov=nesterov)
    if h["momentum"] == 0.0 and momentum_buffer is not None:
        raise ValueError("momentum_buffer must be None when momentum == 0 (it would never be "
                         "read nor written)")
    if h["momentum"] != 0.0 and momentum_buffer is None:
        raise ValueError(f"momentum_buffer must be an fp32 tensor when momentum != 0 "
                         f"(momentum={momentum})")
    if isinstance(step, torch.Tensor):
        _checks.tensor("step", step, dtypes=None, device=param.device, numel=1)
    if isinstance(step, bool) or not isinstance(step, (int, float, torch.Tensor)) or \
            not isinstance(step, torch.Tensor) and step < 1:
        raise ValueError(f"step must be >= 1 (the step number after incrementing), got {step}")
    t = int(step.item()) if isinstance(step, torch.Tensor) else int(step)
    return _optimizer_step(resolve, optimizers.SGD, param, grad, [momentum_buffer],
                           optimizers.SGD.coefficients(h, t), grad_scale=grad_scale,
                           found_inf=found_inf, out=out)
