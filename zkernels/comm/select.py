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

from .base import Comm, timeout_seconds
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
              device: Optional[torch.device] = None, backend: str = "auto",
              timeout=None) -> Comm:
    """The :class:`Comm` for ``process_group`` and buffers on ``device``.

    Args:
        process_group: a torch.distributed group, or None for the default group. When
            torch.distributed is not initialized and no group is given, the world is this one
            process (:class:`LocalComm`), whatever ``backend`` says.
        device: device of the flat buffers (CUDA gets a side stream for collectives).
        backend: ``"auto"`` or ``"torch"`` (torch.distributed: gloo/NCCL), or ``"nccl"``
            (opt-in: the native engine of ``zkernels._C_nccl``, its own communicator and comm
            stream, CUDA buffers only); see [Note: the native engine is opt-in].
        timeout: None, a ``datetime.timedelta`` or seconds (> 0): a collective not done within
            it raises :class:`zkernels.comm.CollectiveError` (see [Note: collective errors] in
            base.py). None keeps the process group's timeout (the native engine's default:
            300 s). On CUDA with ``backend="torch"`` the NCCL watchdog enforces the process
            group's timeout whatever this says (see torch_comm.py).

    Returns:
        an object implementing :class:`zkernels.comm.base.Comm`.
    """
    backend = resolve_backend(backend, device)
    timeout_s = timeout_seconds(timeout)
    initialized = dist.is_available() and dist.is_initialized()
    if not initialized:
        if process_group is not None:
            raise ValueError("process_group was given but torch.distributed is not initialized")
        return LocalComm()
    if backend == "nccl":
        from .nccl import NcclComm
        if timeout_s is None:
            return NcclComm(process_group, device=device)
        return NcclComm(process_group, device=device, timeout_s=timeout_s)
    from .torch_comm import TorchComm
    return TorchComm(process_group, device, timeout=timeout_s)
