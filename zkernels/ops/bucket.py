"""Public bucket pack / unpack: checks, then dispatch (see ``_backend``)."""
from __future__ import annotations

from typing import Sequence

import torch

from . import _checks, _fast
from ._backend import Resolve, implementation


def _scale(scale) -> float:
    if isinstance(scale, torch.Tensor) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a Python float, got {type(scale).__name__}")
    return float(scale)


def bucket_pack(tensors: Sequence[torch.Tensor], bucket: torch.Tensor, offsets: Sequence[int], *,
                scale: float = 1.0) -> torch.Tensor:
    """Place gradients into a rank-aligned bucket, cast and scaled, in one launch. See
    :func:`zkernels.reference.bucket_pack`."""
    if _fast.bucket_pack(tensors, bucket, offsets, scale, True):
        return bucket
    return _bucket_pack(implementation, tensors, bucket, offsets, scale=scale)


def _bucket_pack(resolve: Resolve,
                 tensors: Sequence[torch.Tensor], bucket: torch.Tensor, offsets: Sequence[int], *,
                 scale: float = 1.0) -> torch.Tensor:
    _checks.tensor("bucket", bucket, one_dim=True)
    numels = _checks.tensor_list("tensors", tensors, device=bucket.device)
    offsets = list(offsets)
    _checks.offsets("offsets", offsets, numels, bucket.numel(), "bucket")
    scale = _scale(scale)
    if not tensors:
        return bucket
    return resolve("bucket_pack", bucket.device)(tensors, bucket, offsets, scale=scale)


def bucket_unpack(bucket: torch.Tensor, outs: Sequence[torch.Tensor], offsets: Sequence[int], *,
                  scale: float = 1.0) -> Sequence[torch.Tensor]:
    """Copy slices of a bucket back into tensors, scaled and cast, in one launch. See
    :func:`zkernels.reference.bucket_unpack`."""
    if _fast.bucket_unpack(bucket, outs, offsets, scale, True):
        return outs
    return _bucket_unpack(implementation, bucket, outs, offsets, scale=scale)


def _bucket_unpack(resolve: Resolve,
                   bucket: torch.Tensor, outs: Sequence[torch.Tensor], offsets: Sequence[int], *,
                   scale: float = 1.0) -> Sequence[torch.Tensor]:
    _checks.tensor("bucket", bucket, one_dim=True)
    numels = _checks.tensor_list("outs", outs, device=bucket.device)
    offsets = list(offsets)
    _checks.offsets("offsets", offsets, numels, bucket.numel(), "bucket")
    scale = _scale(scale)
    if not outs:
        return outs
    return resolve("bucket_unpack", bucket.device)(bucket, outs, offsets, scale=scale)
