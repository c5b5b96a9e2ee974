"""The "cpp" backend of ``zkernels.ops``: the native CPU kernels of ``zkernels._C``.

Importing this module never fails: ``AVAILABLE`` says whether the extension loaded. Only ops
implemented natively are defined here (the dispatcher checks ``hasattr``). ``ZKERNELS_CPU_ISA``
(``auto``/``scalar``/``avx2``/``avx512``) forces a SIMD path; it is read at call time, here at
the binding boundary, never deeper.
"""
from __future__ import annotations

import os
from typing import Optional, Union

import torch

try:
    from . import _C
except ImportError as _exc:  # no extension built: the reference backend runs instead
    _C = None
    IMPORT_ERROR: Optional[ImportError] = _exc
else:
    IMPORT_ERROR = None

AVAILABLE = _C is not None

Scalar = Union[float, int, torch.Tensor]


def _value(x: Scalar) -> float:
    # step/grad_scale live on the host next to CPU shards: reading them costs no device sync.
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def _isa() -> str:
    return os.environ.get("ZKERNELS_CPU_ISA", "auto").strip().lower() or "auto"


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, *, lr: float, beta1: float, beta2: float, eps: float,
               weight_decay: float = 0.0, step: Scalar, decoupled: bool = True,
               grad_scale: Optional[Scalar] = None, found_inf: Optional[torch.Tensor] = None,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One AdamW update in place, natively, in a single pass over memory: grad read as
    fp32/bf16/fp16, unscaled, AdamW applied, and the updated params written to ``out``
    (fp32/bf16/fp16, round to nearest even) in the same loop. Arguments and result as
    :func:`zkernels.reference.adamw_step`; CPU tensors only.

    Args:
        param, exp_avg, exp_avg_sq: contiguous fp32 CPU buffers of n elements.
        grad: contiguous fp32/bf16/fp16 CPU buffer of n elements.
        step, grad_scale: numbers or 1-element CPU tensors (read on the host).
        found_inf: optional fp32 1-element CPU tensor; nonzero skips the step entirely.
        out: optional contiguous CPU buffer of n elements (fp32/bf16/fp16).

    Returns:
        ``param``.
    """
    if _C is None:
        raise RuntimeError(f"zkernels._C is not built: {IMPORT_ERROR}")
    _C.cpu_adamw_step(
        param, grad, exp_avg, exp_avg_sq, lr=float(lr), beta1=float(beta1),
        beta2=float(beta2), eps=float(eps), weight_decay=float(weight_decay),
        step=_value(step), decoupled=bool(decoupled),
        grad_scale=1.0 if grad_scale is None else _value(grad_scale),
        found_inf=found_inf, out=out, isa=_isa(), num_threads=torch.get_num_threads())
    return param
