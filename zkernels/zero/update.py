"""The shard update: one fused AdamW per bucket shard, on the device that holds the shard.

A strategy so that offload (a later issue) can substitute a host-side update at this one
point, with the gradient-shard copy as its other point, without touching the step logic.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from .. import ops
from .buckets import Bucket

GradScale = Union[None, float, torch.Tensor]


class FusedAdamW:
    """AdamW over a bucket's fp32 master shard with ``zkernels.ops.adamw_step``.

    Args:
        write_compute: also write the updated shard, rounded, into the bucket's
            low-precision compute shard (``out=``, same pass), ready for the all-gather.
            False in pure fp32, where the master shard *is* the compute shard.
    """

    def __init__(self, write_compute: bool) -> None:
        self.write_compute = write_compute

    def __call__(self, bucket: Bucket, grad: torch.Tensor, group: dict,
                 grad_scale: GradScale) -> None:
        """Apply one step to ``bucket``.

        Args:
            bucket: its ``master``, ``exp_avg``, ``exp_avg_sq`` ([shard_numel] fp32) change in
                place; ``step`` increments.
            grad: [shard_numel] reduced gradient (fp32/bf16/fp16), to be divided by
                ``grad_scale``.
            group: the bucket's param group (lr, betas, eps, weight_decay read now, so
                schedulers take effect on the next step).
            grad_scale: None, float or 1-element fp32 tensor (1/N, loss scale, clipping).
        """
        beta1, beta2 = group["betas"]
        bucket.step += 1
        out: Optional[torch.Tensor] = bucket.compute_shard if self.write_compute else None
        ops.adamw_step(bucket.master, grad, bucket.exp_avg, bucket.exp_avg_sq,
                       lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
                       eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                       step=bucket.step, grad_scale=grad_scale, out=out)
