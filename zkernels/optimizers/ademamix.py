"""AdEMAMix (Pagliardini, Ablin and Grangier 2024, "The AdEMAMix Optimizer: Better, Faster,
Older"): Adam whose numerator mixes a fast EMA of the gradient with a slow one,
``(m1 / bc1 + alpha * m2) / (sqrt(v) / sqrt(bc2) + eps)``, with the keywords and schedulers of
the authors' reference implementation (apple/ml-ademamix).

[Note: AdEMAMix op order]
Per step t (1-based, the parameter's own count) the scalars are formed in double
(:func:`alpha_at`, :func:`beta3_at`, :data:`ADEMAMIX`'s coefficients); per element, in fp32,
every operation rounded once, in this order, with no fused multiply-add:
``g = grad / grad_scale; m1 = m1*b1 + g*(1-b1); m2 = m2*b3_t + g*(1-b3_t);
v = v*b2 + (g*g)*(1-b2); d = sqrt_rn(v) / sqrt(bc2) + eps; u = (m1 / bc1 + m2*alpha_t) / d;
u = u + p*wd; p = p - u*lr``. The authors' code sets ``m1 = g`` when ``beta1 == 0``; here m1
is kept (12 bytes per element whatever beta1): ``m1*0 + g*1`` is ``g`` for every finite ``m1``.
The bf16 form stores the three moments in bf16, widened to fp32 before the math and rounded
to nearest even after. Weight decay is decoupled as the authors': ``u += wd*p; p -= lr*u``.

:class:`AdEMAMix` is a single-process ``torch.optim.Optimizer`` written from the authors' code
(their torch ops, foreach off): the oracle of the ZeRO parity tests and the unfused baseline of
the bench.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ._definition import (ElementwiseOptimizer, HParam, StateSpec, betas, non_negative,
                          optional_steps)


def alpha_at(step: int, alpha: float, warmup: Optional[int]) -> float:
    """alpha at ``step``: the authors' ``linear_warmup_scheduler`` from 0 over ``warmup`` steps
    (None: constant)."""
    if warmup is None or step >= warmup:
        return alpha
    a = step / float(warmup)
    return (1.0 - a) * 0.0 + a * alpha


def _half_life(beta: float) -> float:
    return math.log(0.5) / math.log(beta + 1e-8) - 1


def beta3_at(step: int, beta1: float, beta3: float, warmup: Optional[int]) -> float:
    """beta3 at ``step``: the authors' ``linear_hl_warmup_scheduler``, linear in the half-life
    from ``beta1`` to ``beta3`` over ``warmup`` steps (None: constant)."""
    if warmup is None or step >= warmup:
        return beta3
    a = step / float(warmup)
    return math.pow(0.5, 1 / ((1.0 - a) * _half_life(beta1) + a * _half_life(beta3) + 1))


def _coefficients(h, t):
    b1, b2, b3 = h["betas"]
    b3_t = beta3_at(t, b1, b3, h["beta3_warmup"])
    return (b1, 1.0 - b1, b2, 1.0 - b2, b3_t, 1.0 - b3_t,
            alpha_at(t, h["alpha"], h["alpha_warmup"]), 1.0 - b1 ** t,
            math.sqrt(1.0 - b2 ** t), h["eps"], h["weight_decay"], h["lr"])


ADEMAMIX = ElementwiseOptimizer(
    name="ademamix",
    states=(StateSpec("exp_avg_fast"), StateSpec("exp_avg_slow"), StateSpec("exp_avg_sq")),
    hparams=(HParam("lr", 1e-3, non_negative),
             HParam("betas", (0.9, 0.999, 0.9999), betas(3, closed=False)),
             HParam("alpha", 2.0, non_negative), HParam("beta3_warmup", None, optional_steps),
             HParam("alpha_warmup", None, optional_steps), HParam("eps", 1e-8, non_negative),
             HParam("weight_decay", 0.0, non_negative)),
    coefficient_names=("beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "beta3",
                       "one_minus_beta3", "alpha", "bias_correction1",
                       "bias_correction2_sqrt", "eps", "weight_decay", "lr"),
    make_coefficients=_coefficients,
    lowbit=("bf16",),
    lowbit_refused={"int8": "no blockwise int8 code is built for AdEMAMix's three moments"},
    doc="AdEMAMix (Pagliardini, Ablin and Grangier 2024)",
)


class AdEMAMix(torch.optim.Optimizer):
    """Single-process AdEMAMix with the authors' semantics (their torch ops, foreach off): the
    oracle of the parity tests and the unfused baseline of the bench. Keywords and checks as
    :data:`ADEMAMIX`; state per parameter ``step``, ``exp_avg_fast``, ``exp_avg_slow``,
    ``exp_avg_sq`` (m1 kept when beta1 == 0, see [Note: AdEMAMix op order])."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=2.0,
                 beta3_warmup=None, alpha_warmup=None, eps=1e-8, weight_decay=0.0):
        h = ADEMAMIX.resolve(lr=lr, betas=betas, alpha=alpha, beta3_warmup=beta3_warmup,
                             alpha_warmup=alpha_warmup, eps=eps, weight_decay=weight_decay)
        super().__init__(params, h)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2, b3_final = group["betas"]
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad, state = p.grad, self.state[p]
                if not state:
                    state["step"] = 0
                    for name in ADEMAMIX.state_names:
                        state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = state["step"]
                b3 = beta3_at(t, b1, b3_final, group["beta3_warmup"])
                alpha = alpha_at(t, group["alpha"], group["alpha_warmup"])
                m1, m2, v = state["exp_avg_fast"], state["exp_avg_slow"], state["exp_avg_sq"]
                m1.mul_(b1).add_(grad, alpha=1 - b1)
                m2.mul_(b3).add_(grad, alpha=1 - b3)
                v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
                denom = (v.sqrt() / math.sqrt(1 - b2 ** t)).add_(eps)
                update = (m1.div(1 - b1 ** t) + alpha * m2) / denom
                update.add_(p, alpha=wd)
                p.add_(-lr * update)
        return loss
