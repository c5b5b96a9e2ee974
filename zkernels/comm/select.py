"""The one place where a communication backend is chosen.

[Note: process group teardown]
``dist.destroy_process_group()`` frees a gloo group (joining its ``pt_gloo_runloop`` worker
threads) only if nothing else refers to it. ``torch.distributed.nn.functional`` binds
``group.WORLD`` as the default argument of its functions when it is imported, and it is imported
lazily, through ``torch._dynamo``, by the first ``torch.optim.Optimizer`` constructed (every
optimizer, ``ZeroOptimizer`` and ``torch.optim.AdamW`` alike). Imported after
``init_process_group``, it keeps the world group, and its worker threads, alive until the
interpreter tears itself down. A worker still releasing the last collective's work then drops
tensors whose Python objects finalization has already collected; dropping them needs the GIL,
a thread taking the GIL during finalization is ended by ``pthread_exit``, and its forced unwind
through a ``noexcept`` destructor calls ``std::terminate``: "terminate called without an active
exception" (SIGABRT) after all the work is done, in a few runs out of a hundred on a busy
machine (a core dump shows ``~AsyncAllgatherWork`` -> ``decref_pyobject`` -> ``take_gil`` ->
``pthread_exit`` inside ``Py_FinalizeEx``). Importing ``torch.distributed.nn`` here, when
zkernels is imported, before the process group exists, makes those defaults None, so that
``destroy_process_group()`` really ends the group. Programs must still call it, with no
model, DDP wrapper or collective handle holding the group (tests/_dist.py checks that no gloo
worker thread survives it).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

if dist.is_available():
    import torch.distributed.nn  # noqa: F401 - see [Note: process group teardown]

from .base import Comm
from .local import LocalComm

BACKENDS = ("auto", "torch", "nccl")


def make_comm(process_group: Optional["dist.ProcessGroup"] = None,
              device: Optional[torch.device] = None, backend: str = "auto") -> Comm:
    """The :class:`Comm` for ``process_group`` and buffers on ``device``.

    Args:
        process_group: a torch.distributed group, or None for the default group. When
            torch.distributed is not initialized and no group is given, the world is this one
            process (:class:`LocalComm`).
        device: device of the flat buffers (CUDA gets a side stream for collectives).
        backend: ``"torch"`` (torch.distributed: gloo/NCCL), ``"nccl"`` (the native engine
            of ``zkernels._C_nccl``: its own communicator and comm stream), or ``"auto"``:
            the native engine for CUDA buffers where it is built, torch.distributed otherwise.

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
    if backend == "auto":
        backend = "nccl" if device is not None and device.type == "cuda" and _native_built() \
            else "torch"
    if backend == "nccl":
        from .nccl import NcclComm
        return NcclComm(process_group, device=device)
    from .torch_comm import TorchComm
    return TorchComm(process_group, device)


def _native_built() -> bool:
    from . import nccl
    return nccl.AVAILABLE
