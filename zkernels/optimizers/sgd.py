"""SGD as ``torch.optim.SGD`` defines it (momentum, dampening, nesterov, weight decay): with
momentum the buffer is the gradient on the first step, ``momentum*b + (1-dampening)*g``
after."""
from __future__ import annotations

from ._definition import ElementwiseOptimizer, HParam, StateSpec, finite, flag


def _momentum(name: str, x) -> float:
    x = finite(name, x)
    if x < 0.0:
        raise ValueError(f"{name} must be >= 0, got {x}")
    return x


def _cross_check(h) -> None:
    if h["nesterov"] and (h["momentum"] <= 0.0 or h["dampening"] != 0.0):
        raise ValueError(f"nesterov needs momentum > 0 and dampening == 0 (as torch.optim.SGD), "
                         f"got momentum={h['momentum']}, dampening={h['dampening']}")


def _coefficients(h, t):
    return (h["weight_decay"], h["momentum"], 1.0 - h["dampening"], -h["lr"],
            1.0 if t == 1 else 0.0, 1.0 if h["nesterov"] else 0.0)


SGD = ElementwiseOptimizer(
    name="sgd",
    states=(StateSpec("momentum_buffer", present=lambda h: h["momentum"] != 0.0),),
    hparams=(HParam("lr", 1e-3, finite), HParam("momentum", 0.0, _momentum),
             HParam("dampening", 0.0, finite), HParam("weight_decay", 0.0, finite),
             HParam("nesterov", False, flag)),
    coefficient_names=("weight_decay", "momentum", "one_minus_dampening", "neg_lr",
                       "first_step", "nesterov"),
    make_coefficients=_coefficients,
    lowbit_refused={"bf16": "no low-bit SGD body is built",
                    "int8": "no low-bit SGD body is built"},
    cross_check=_cross_check,
    doc="SGD (torch.optim.SGD's rule)",
)
