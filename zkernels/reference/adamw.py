"""Reference multi-tensor AdamW over flat fp32 shards, the fused sum of squares, and the
correctly rounded fp32 square root every reference takes.

[Note: correctly rounded sqrt]
The references take fp32 square roots with :func:`sqrt_rn`, not ``Tensor.sqrt``. torch's CPU
``sqrt`` on fp32 runs MKL's vector sqrt (VML), which on AVX-512 CPUs is not correctly rounded:
1 ulp off for ~0.6-0.7% of inputs (measured, torch 2.13: 98,955 of the 2**24 floats in
[1, 4)); MKL's AVX2 code is exact, and so is CUDA's (nvcc's default ``-prec-sqrt=true``). The
backends take the IEEE root: the C++ paths ``std::sqrt`` / ``_mm256_sqrt_ps`` /
``_mm512_sqrt_ps`` (csrc/cpu_adam, csrc/cpu_adam_lowbit), the Triton kernels ``tl.sqrt_rn``.
So that every backend compares with the reference bit for bit on every CPU, the reference
rounds the root correctly too, as ``x.double().sqrt().float()``: the fp32 input widens
exactly, the fp64 root is correctly rounded, and rounding it again to fp32 is innocuous, since
double rounding of a square root from ``p`` to ``q`` bits is exact when ``p >= 2q + 2``
(53 >= 2*24 + 2; Figueroa, "When is double rounding innocuous?", 1995); subnormal inputs
included (their roots are normal). tests/ops/test_adamw.py checks it against numpy's IEEE
sqrt on every float in [1, 4) (a step of 2 in the exponent scales the root exactly), on the
subnormals and on random bit patterns, which also checks torch's fp64 root.
Cost: the fp64 root is taken in pieces of ``SQRT_CHUNK`` (2**20) elements into the fp32
result, so the transient beyond the result is at most 8 MiB (the fp64 copy, rooted in
place), whatever the shard's size; the time is about twice ``Tensor.sqrt``'s (2**24
elements on 1 thread: 124 ms against 64 ms, shared 2-core AVX-512 VM): acceptable for the
oracle and the no-extension CPU fallback, which are not the fast path.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch

Scalar = Union[float, int, torch.Tensor]
SQRT_CHUNK = 1 << 20  # elements per fp64 piece of sqrt_rn


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """The fp32 square root of fp32 ``x``, correctly rounded (IEEE round to nearest even), as a
    new tensor of ``x``'s shape ([Note: correctly rounded sqrt]). NaN for negative inputs,
    ``sqrt(-0) = -0``, ``sqrt(inf) = inf``, as ``Tensor.sqrt``."""
    flat = x.reshape(-1)
    root = torch.empty_like(flat, dtype=torch.float32)
    for i in range(0, flat.numel(), SQRT_CHUNK):
        root[i:i + SQRT_CHUNK] = flat[i:i + SQRT_CHUNK].double().sqrt_()
    return root.view(x.shape)


def _value(x: Scalar) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, *, lr: float, beta1: float, beta2: float, eps: float,
               weight_decay: float = 0.0, step: Scalar, decoupled: bool = True,
               grad_scale: Optional[Scalar] = None, found_inf: Optional[torch.Tensor] = None,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One AdamW (``decoupled=True``) or Adam-with-L2 (``decoupled=False``) update, in place.

    The arithmetic follows ``torch.optim.AdamW`` (single-tensor path) step for step:
    ``p *= 1 - lr*wd; m = lerp(m, g, 1-b1); v = b2*v + (1-b2)*g*g;
    p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)``, except that ``sqrt(v)`` is
    correctly rounded ([Note: correctly rounded sqrt]; torch's CPU sqrt may be 1 ulp off).

    Args:
        param, exp_avg, exp_avg_sq: 1-D contiguous fp32 buffers of equal length (the master
            shard and its moments), updated in place.
        grad: 1-D contiguous, same length, fp32/bf16/fp16; read as fp32, divided by
            ``grad_scale`` when given.
        lr, beta1, beta2, eps, weight_decay: hyperparameters.
        step: the step number after incrementing (1 on the first step), int or tensor.
        decoupled: AdamW decay when True; classic L2 (``g += wd * p``) when False.
        grad_scale: optional loss scale to divide the gradient by, float or 1-element tensor.
        found_inf: optional 1-element tensor; when nonzero the call changes nothing.
        out: optional 1-D buffer (fp32/bf16/fp16), same length, receiving the updated params
            cast (round to nearest even) to its dtype.

    Returns:
        ``param``.
    """
    if found_inf is not None and _value(found_inf) != 0.0:
        return param
    t = _value(step)
    g = grad.float()
    if grad_scale is not None:
        g = g / _value(grad_scale)
    if decoupled:
        param.mul_(1.0 - lr * weight_decay)
    elif weight_decay != 0.0:
        g = g.add(param, alpha=weight_decay)
    exp_avg.lerp_(g, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    bias_correction1 = 1.0 - beta1 ** t
    bias_correction2 = 1.0 - beta2 ** t
    step_size = lr / bias_correction1
    denom = (sqrt_rn(exp_avg_sq) / math.sqrt(bias_correction2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
    if out is not None:
        out.copy_(param)
    return param


def sum_squares(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of all elements of all ``tensors``, accumulated in fp32.

    Args:
        tensors: contiguous tensors (fp32/bf16/fp16), one device.

    Returns:
        0-d fp32 tensor on that device (for a global norm: ``sqrt`` of the all-reduced sum).
    """
    dev = tensors[0].device if len(tensors) else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=dev)
    for t in tensors:
        total += t.float().pow(2).sum()
    return total
