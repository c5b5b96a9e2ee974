"""The one place where a communication backend is chosen."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .base import Comm
from .local import LocalComm

BACKENDS = ("auto", "torch", "nccl")


def resolve_backend(backend: str, device: Optional[torch.device]) -> str:
    """The engine ``backend`` means for buffers on ``device``: ``"torch"`` or ``"nccl"``.

    [Note: the native engine is opt-in]
    ``"auto"`` is torch.distributed everywhere, CUDA included, even where ``_C_nccl`` is
    built: the native engine compiles and links in CI and passes its no-GPU tests, but it has
    not yet passed ``benchmarks/gpu_check.sh`` on a GPU, and a default that has never run
    where it would be used is a guess. ``comm_backend="nccl"`` asks for it explicitly. When
    gpu_check.sh has passed on a GPU (its train check compares both engines with
    torch.optim.AdamW), "auto" can choose the engine for CUDA buffers here, in this one place.
    """
    if backend not in BACKENDS:
        raise ValueError(f"comm_backend must be one of {BACKENDS}, got {backend!r}")
    return "nccl" if backend == "nccl" else "torch"


def make_comm(process_group: Optional["dist.ProcessGroup"] = None,
              device: Optional[torch.device] = None, backend: str = "auto") -> Comm:
    """The :class:`Comm` for ``process_group`` and buffers on ``device``.

    Args:
        process_group: a torch.distributed group, or None for the default group. When
            torch.distributed is not initialized and no group is given, the world is this one
            process (:class:`LocalComm`), whatever ``backend`` says.
        device: device of the flat buffers (CUDA gets a side stream for collectives).
        backend: ``"auto"`` or ``"torch"`` (torch.distributed: gloo/NCCL), or ``"nccl"``
            (opt-in: the native engine of ``zkernels._C_nccl``, its own communicator and comm
            stream, CUDA buffers only); see [Note: the native engine is opt-in].

    Returns:
        an object implementing :class:`zkernels.comm.base.Comm`.
    """
    backend = resolve_backend(backend, device)
    initialized = dist.is_available() and dist.is_initialized()
    if not initialized:
        if process_group is not None:
            raise ValueError("process_group was given but torch.distributed is not initialized")
        return LocalComm()
    if backend == "nccl":
        from .nccl import NcclComm
        return NcclComm(process_group, device=device)
    from .torch_comm import TorchComm
    return TorchComm(process_group, device)
