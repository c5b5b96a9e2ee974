"""The one place where a communication backend is chosen."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .base import Comm
from .local import LocalComm

BACKENDS = ("torch",)


def make_comm(process_group: Optional["dist.ProcessGroup"] = None,
              device: Optional[torch.device] = None, backend: str = "torch") -> Comm:
    """The :class:`Comm` for ``process_group`` and buffers on ``device``.

    Args:
        process_group: a torch.distributed group, or None for the default group. When
            torch.distributed is not initialized and no group is given, the world is this one
            process (:class:`LocalComm`).
        device: device of the flat buffers (CUDA gets a side stream for collectives).
        backend: ``"torch"`` (torch.distributed: gloo/NCCL).

    Returns:
        an object implementing :class:`zkernels.comm.base.Comm`.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    initialized = dist.is_available() and dist.is_initialized()
    if not initialized:
        if process_group is not None:
            raise ValueError("process_group was given but torch.distributed is not initialized")
        return LocalComm()
    from .torch_comm import TorchComm
    return TorchComm(process_group, device)
