"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), the rule of
lucidrains' lion-pytorch: ``p *= 1 - lr*wd; p -= lr * sign(b1*m + (1-b1)*g);
m = b2*m + (1-b2)*g``; the paper's defaults."""
from __future__ import annotations

from ._definition import ElementwiseOptimizer, HParam, StateSpec, betas, finite


def _coefficients(h, t):
    lr, (b1, b2) = h["lr"], h["betas"]
    return (b1, 1.0 - b1, b2, 1.0 - b2, 1.0 - lr * h["weight_decay"], -lr)


LION = ElementwiseOptimizer(
    name="lion",
    states=(StateSpec("exp_avg"),),
    hparams=(HParam("lr", 1e-4, finite), HParam("betas", (0.9, 0.99), betas(2, closed=True)),
             HParam("weight_decay", 0.0, finite)),
    coefficient_names=("beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "decay",
                       "neg_lr"),
    make_coefficients=_coefficients,
    lowbit_refused={"bf16": "no low-bit Lion body is built",
                    "int8": "no low-bit Lion body is built"},
    needs_step=False,
    doc="Lion (Chen et al. 2023)",
)
