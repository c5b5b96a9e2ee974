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
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from ...comm.base import Comm
from ...ops import OpSet
from .nonfinite import locate, on_nonfinite

GradScale = Union[None, float, torch.Tensor]


@dataclass(frozen=True)
class StepScale:
    """What to divide the gradient shards by, and whether the step must be skipped: fixed per
    optimizer here, the step's values passed to :meth:`__call__`.

    Attributes:
        comm: collectives of the data-parallel group.
        ops: an OpSet for the shards' device (``sum_squares``).
        nonfinite: without a loss scale, what an inf/NaN gradient does: ``"skip"`` the step
            (logged) or ``"raise"`` (see nonfinite.py's Note).
        comm_device: where ``comm``'s buffers live, when not the shards' device (CPU offload
            on a GPU: host shards, an NCCL all-reduce); the sum moves there and back.
        units, model: the optimizer's units and model, to say where a non-finite element is
            (read only to raise).
    """

    comm: Comm
    ops: OpSet
    nonfinite: str = "skip"
    comm_device: Optional[torch.device] = None
    units: Sequence = ()
    model: Optional[nn.Module] = None

    def __call__(self, shards: List[torch.Tensor], divisor: float, loss_scale: Optional[float],
                 max_grad_norm: Optional[float], step: int
                 ) -> Tuple[GradScale, bool, Optional[float]]:
        """One sum of squares, one all-reduce (see the Note).

        Args:
            shards: this rank's reduced gradient shards ([shard_numel] each).
            divisor: factor not yet divided out of ``shards`` (N or 1; precision.py's Note).
            loss_scale: the current loss scale (fp16), or None.
            max_grad_norm: clip the global norm to this, or None.
            step: the 1-based ``step()`` call, for the warning or error.

        Returns:
            ``(grad_scale, skip, norm)``: ``grad_scale`` is None (nothing to divide), a
            float, or a 1-element fp32 tensor on the shards' device (when clipping); ``skip``
            is True when any rank has an inf/NaN gradient; ``norm`` the global gradient norm
            before clipping (loss scale and divisor taken out), None when not finite.

        Raises:
            NonFiniteGradientError: an inf/NaN gradient under ``nonfinite="raise"`` (not fp16).
        """
        scale = divisor * (loss_scale if loss_scale is not None else 1.0)
        sq = self.ops.sum_squares(shards).reshape(1)
        dev = self.comm_device
        if dev is not None and sq.device != torch.device(dev):
            on_comm = sq.to(dev)
            self.comm.all_reduce(on_comm, op="sum").wait()
            sq = on_comm.to(sq.device)
        else:
            self.comm.all_reduce(sq, op="sum").wait()
        total = float(sq.item())
        if not math.isfinite(total):
            if loss_scale is None:  # fp16's overflows are the loss scaler's business
                on_nonfinite(self.nonfinite, step, self.comm.rank, lambda: self._where(shards))
            return None, True, None
        norm = math.sqrt(total) / scale
        if max_grad_norm is None:
            return (None if scale == 1.0 else scale), False, norm
        # torch.nn.utils.clip_grad_norm_'s coefficient, clamped so clipping never scales up.
        coef = (max_grad_norm / (sq.sqrt() / scale + 1e-6)).clamp(max=1.0)
        return scale / coef, False, norm

    def _where(self, shards: List[torch.Tensor]) -> str:
        names = {id(p): n for n, p in self.model.named_parameters()} if self.model else {}
        return locate(shards, self.units, names, self.comm.rank)


def check_max_grad_norm(max_grad_norm) -> Optional[float]:
    """``max_grad_norm`` as a float > 0, or None (no clipping).

    Raises:
        ValueError: not > 0.
    """
    if max_grad_norm is not None and not float(max_grad_norm) > 0.0:
        raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
    return None if max_grad_norm is None else float(max_grad_norm)
