"""Until ``zkernels._cpu.optimizer_step`` (native35's generic binding, SEAM35.md's Seam 2) is
built: the cpp backend's Lion and SGD through their per-optimizer bindings, taking the generic
op's arguments. Delete this module once ``zkernels._cpu`` has ``optimizer_step`` (then
``_backend.has_optimizer`` never picks it).

The per-optimizer bindings take the keywords (lr, weight_decay, dampening, ...) and round
``1 - lr*wd``, ``-lr``, ``1 - dampening`` to fp32 themselves; the keywords given here are
recovered from the coefficients so that those fp32 values equal ``coeffs``' entries rounded to
fp32 (checked per call; where no such keyword exists the reference runs instead, which the
native paths equal bit for bit for power-of-two grad scales).
"""
from __future__ import annotations

import struct

from ._backend import _module

KINDS = ("lion", "sgd")


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def supports(name: str) -> bool:
    mod = _module("cpp")
    return (name in KINDS and mod is not None and not hasattr(mod, "optimizer_step")
            and hasattr(mod, f"{name}_step"))


def optimizer_step(defn, param, grad, states, coeffs, *, grad_scale=None, found_inf=None,
                   out=None):
    """The generic op's signature over ``zkernels._cpu.lion_step`` / ``sgd_step``."""
    cpu = _module("cpp")
    kw = dict(grad_scale=grad_scale, found_inf=found_inf, out=out)
    if defn.name == "lion":
        b1, _, b2, _, decay, neg_lr = coeffs
        lr = -neg_lr
        wd = 0.0 if lr == 0.0 else (1.0 - decay) / lr
        if _f32(1.0 - lr * wd) == _f32(decay):
            return cpu.lion_step(param, grad, states[0], lr=lr, beta1=b1, beta2=b2,
                                 weight_decay=wd, **kw)
    else:
        wd, momentum, one_minus_dampening, neg_lr, first, nesterov = coeffs
        dampening = 1.0 - one_minus_dampening
        if _f32(1.0 - dampening) == _f32(one_minus_dampening):
            return cpu.sgd_step(param, grad, states[0], lr=-neg_lr,
                                momentum=momentum if states[0] is not None else 0.0,
                                dampening=dampening, weight_decay=wd,
                                nesterov=bool(nesterov), step=1 if first else 2, **kw)
    from ..reference import optimizer_step as reference_step
    return reference_step(defn, param, grad, states, coeffs, **kw)
