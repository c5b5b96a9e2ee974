"""The fused AdamW (``torch.optim.AdamW``'s rule; Adam with L2 when ``decoupled=False``).

Its fp32 body and its low-bit bodies keep their own op order (``zkernels/reference/adamw.py``,
``zkernels/reference/adamw_lowbit.py``: torch's lerp and addcmul, [Note: low-bit moment
formats]); the definition holds its states, keywords, checks and per-step scalars.
"""
from __future__ import annotations

import math

from ._definition import ElementwiseOptimizer, HParam, StateSpec, betas, flag, number


def _coefficients(h, t):
    lr, (b1, b2), wd = h["lr"], h["betas"], h["weight_decay"]
    return (lr, b1, b2, h["eps"], wd, 1.0 - lr * wd, 1.0 - b1, 1.0 - b2,
            lr / (1.0 - b1 ** float(t)), math.sqrt(1.0 - b2 ** float(t)),
            1.0 if h["decoupled"] else 0.0)


ADAMW = ElementwiseOptimizer(
    name="adamw",
    states=(StateSpec("exp_avg"), StateSpec("exp_avg_sq")),
    hparams=(HParam("lr", 1e-3, number), HParam("betas", (0.9, 0.999), betas(2, closed=False)),
             HParam("eps", 1e-8, number), HParam("weight_decay", 0.0, number),
             HParam("decoupled", True, flag)),
    coefficient_names=("lr", "beta1", "beta2", "eps", "weight_decay", "decay",
                       "one_minus_beta1", "one_minus_beta2", "step_size",
                       "bias_correction2_sqrt", "decoupled"),
    make_coefficients=_coefficients,
    lowbit=("bf16", "int8"),
    doc="AdamW (Loshchilov and Hutter 2019), torch.optim.AdamW's op order",
)
