"""Reference step of every element-wise optimizer: the shared prologue and epilogue around the
definition's per-element math (``elementwise`` in ``zkernels/reference/<name>.py``).

[Note: the generic optimizer step]
Every backend runs one step of every element-wise optimizer the same way, around that
optimizer's math: found_inf nonzero changes nothing; the gradient is read as fp32 and divided
by ``grad_scale`` (an IEEE division; the C++ backend multiplies by ``1/grad_scale``, the same
for power-of-two scales); the parameter and the state buffers are widened to fp32 (bf16/fp16
parameters; the bf16 low-bit state form); the definition's math updates them in fp32, reading
``coeffs`` (``defn.coefficients(h, step)``, each rounded to fp32 once, as torch rounds a
Python scalar applied to an fp32 tensor) by position; then the parameter, the states and
``out`` are stored rounded to nearest even in their dtypes. Only the math differs between
optimizers; the signature is written once, here, and every backend's ``optimizer_step`` takes
it.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from .. import optimizers

Scalar = Union[float, int, torch.Tensor]

# The definitions with a per-element math here (``zkernels/reference/<name>.py``'s
# ``elementwise``). AdamW keeps its own ops (adamw.py, adamw_lowbit.py: torch's lerp/addcmul).
OPTIMIZER_KINDS = ("lion", "sgd", "ademamix")


def _value(x: Scalar) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def elementwise(defn):
    """The definition's per-element math ``(p, g, states, coeffs) -> (p, states)``.

    Raises:
        ValueError: a definition without one here.
    """
    return optimizers.backend_math(defn, __package__, OPTIMIZER_KINDS, "elementwise",
                                   "the reference")


def optimizer_step(defn, param: torch.Tensor, grad: torch.Tensor,
                   states: Sequence[Optional[torch.Tensor]], coeffs: Sequence[float], *,
                   grad_scale: Optional[Scalar] = None, found_inf: Optional[torch.Tensor] = None,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One step of the element-wise optimizer ``defn``, in place ([Note: the generic
    optimizer step]).

    Args:
        defn: an :class:`zkernels.optimizers.ElementwiseOptimizer` or its name.
        param: 1-D contiguous fp32/bf16/fp16 buffer (the master shard), updated in place.
        grad: 1-D contiguous, same length, fp32/bf16/fp16; read as fp32, divided by
            ``grad_scale`` when given.
        states: the definition's state buffers in its order (1-D, same length; fp32, or bf16
            in the bf16 low-bit form), None where the state is absent.
        coeffs: ``defn.coefficients(h, step)``, read by position.
        grad_scale: optional loss scale to divide the gradient by, float or 1-element tensor.
        found_inf: optional 1-element tensor; when nonzero the call changes nothing.
        out: optional 1-D buffer (fp32/bf16/fp16), same length, receiving the updated params
            rounded to nearest even.

    Returns:
        ``param``.
    """
    body = elementwise(defn)
    if found_inf is not None and _value(found_inf) != 0.0:
        return param
    g = grad.float()
    if grad_scale is not None:
        g = g / torch.tensor(_value(grad_scale), dtype=torch.float32, device=g.device)
    p = param if param.dtype == torch.float32 else param.float()
    wide = [s if s is None or s.dtype == torch.float32 else s.float() for s in states]
    p, wide = body(p, g, wide, tuple(float(c) for c in coeffs))
    if p is not param:
        param.copy_(p)
    for s, w in zip(states, wide):
        if s is not None and w is not s:
            s.copy_(w)
    if out is not None:
        out.copy_(p)
    return param
