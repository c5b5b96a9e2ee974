"""Global gradient norm across shards, overflow detection and the clip coefficient, folded
into one scalar ``grad_scale`` that AdamW divides every gradient by.

[Note: one all-reduce for the norm and the overflow flag]
Each rank sums the squares of its gradient shards (one ``sum_squares`` launch; padding is zero
and tied parameters live once in one bucket, so each gradient element is counted exactly
once across ranks) and ONE all-reduce (sum) gives every rank the global sum. An inf or NaN
anywhere on any rank makes that sum inf or NaN on every rank (squares are >= 0, so an inf
cannot cancel), so the same scalar is the found-inf flag (what an all-reduce(max) of per-rank
flags would give) and every rank skips the same steps. Squares of finite fp32 gradients
overflow only above ~1.8e19 per element, which no trainable gradient reaches.

Since the ``nonfinite`` policy (nonfinite.py's Note) every step needs that flag, so the
all-reduce now runs every step, also where neither clipping nor loss scaling asks for the
norm: one 4-byte all-reduce (fp32 scalar) per step, metered as ``all_reduce`` bytes beside the
2Ψ of reduce-scatter and all-gather, and one host sync (``.item()``) per step on GPU, as
``torch.amp.GradScaler`` pays in fp16. No extra collective where clipping or fp16 already did
it.
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Tuple, Union

import torch

from ...comm.base import Comm
from ...ops import OpSet
from .nonfinite import on_nonfinite

GradScale = Union[None, float, torch.Tensor]


def grad_scale_and_overflow(shards: List[torch.Tensor], comm: Comm, divisor: float,
                            loss_scale: Optional[float], max_grad_norm: Optional[float], ops: OpSet,
                            nonfinite: str = "skip", step: int = 0,
                            where: Callable[[], str] = lambda: "",
                            comm_device: Optional[torch.device] = None,
                            on_norm: Optional[Callable[[float], None]] = None
                            ) -> Tuple[GradScale, bool]:
    """What to divide the gradient shards by, and whether the step must be skipped.

    Args:
        shards: this rank's reduced gradient shards ([shard_numel] each).
        comm: collectives of the data-parallel group.
        divisor: factor not yet divided out of ``shards`` (N or 1; see precision.py's Note).
        loss_scale: the current loss scale (fp16), or None.
        max_grad_norm: clip the global norm to this, or None.
        ops: an OpSet for the shards' device (``sum_squares``).
        nonfinite: without a loss scale, what an inf/NaN gradient does: ``"skip"`` the step
            (logged) or ``"raise"`` (see nonfinite.py's Note).
        step: the 1-based ``step()`` call, for the warning or error.
        where: says where the non-finite element is (called only to raise).
        comm_device: where ``comm``'s buffers live, when not the shards' device (CPU offload
            on a GPU: host shards, an NCCL all-reduce); the sum moves there and back.
        on_norm: called with the global gradient norm before clipping (loss scale and divisor
            taken out) when it is finite; it costs nothing more, the sum is read anyway.

    Returns:
        ``(grad_scale, skip)``: ``grad_scale`` is None (nothing to divide), a float, or a
        1-element fp32 tensor on the shards' device (when clipping); ``skip`` is True when
        any rank has an inf/NaN gradient.

    Raises:
        NonFiniteGradientError: an inf/NaN gradient under ``nonfinite="raise"`` (not fp16).
    """
    scale = divisor * (loss_scale if loss_scale is not None else 1.0)
    sq = ops.sum_squares(shards).reshape(1)
    if comm_device is not None and sq.device != torch.device(comm_device):
        on_comm = sq.to(comm_device)
        comm.all_reduce(on_comm, op="sum").wait()
        sq = on_comm.to(sq.device)
    else:
        comm.all_reduce(sq, op="sum").wait()
    total = float(sq.item())
    if not math.isfinite(total):
        if loss_scale is None:  # fp16's overflows are the loss scaler's business
            on_nonfinite(nonfinite, step, comm.rank, where)
        return None, True
    if on_norm is not None:
        on_norm(math.sqrt(total) / scale)
    if max_grad_norm is None:
        return (None if scale == 1.0 else scale), False
    norm = sq.sqrt() / scale
    # torch.nn.utils.clip_grad_norm_'s coefficient, clamped so clipping never scales up.
    coef = (max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
    return scale / coef, False
