"""``stage="auto"``: measure the memory a rank may use and climb the ladder until it fits.

The decision itself is :func:`zkernels.zero.planning.ladder.choose_rung` (pure arithmetic); this
module measures the budget, makes every rank agree on it, and turns the chosen rung into the
run's :class:`~zkernels.zero.planning.config.ZeroConfig`.

[Note: auto budget]
The budget of a rank is what it could hold for model states: the device's free memory plus the
bytes of the model's parameters already on that device (they are counted by the estimate, and
already missing from "free"). On CUDA "free" is ``torch.cuda.mem_get_info``; on CPU it is the
host's available RAM (psutil when installed, else /proc/meminfo's MemAvailable) divided by the
ranks on that host, which share it. 10% of a measured budget is kept as headroom for
activations, fragmentation and workspace; a budget the user gives is taken as is. Activations
are the user's business either way. Every rank must take the same rung (they run the same
collectives), so the budget is the minimum over ranks.

[Note: auto announcement]
The choice is a decision the user did not make, so it is shown by default: rank 0 (of the
optimizer's group) writes one line, "zkernels: stage='auto' chose stage N ...", as an INFO record
of the "zkernels.zero" logger. Where the application's logging would show that record (INFO
enabled and a handler on the way up) it goes through logging only; where it would be dropped
(logging not configured: Python shows WARNING and above), it is printed to stderr instead.
Quiet on request: give the "zkernels" logger (or "zkernels.zero") a level above INFO,
``logging.getLogger("zkernels").setLevel(logging.WARNING)``; then nothing is written. Other
ranks log it at DEBUG.
"""
from __future__ import annotations

import logging
import socket
import sys
from typing import Iterable, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .config import ZeroConfig
from .estimate import count_params
from .ladder import choose_rung
from .policy import RUNGS

log = logging.getLogger("zkernels.zero")

MEASURED_HEADROOM = 0.10


def host_available_bytes() -> int:
    """Host RAM available to new allocations, in bytes (psutil, else /proc/meminfo)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        return int(psutil.virtual_memory().available)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError as exc:
        raise RuntimeError("stage='auto' cannot measure host RAM (no psutil, no "
                           "/proc/meminfo): pass memory_budget_bytes") from exc
    raise RuntimeError("stage='auto' found no MemAvailable in /proc/meminfo: pass "
                       "memory_budget_bytes")


def _ranks_on_this_host(group) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    names = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, socket.gethostname(), group=group)
    return max(1, names.count(socket.gethostname()))


def measure_budget_bytes(params: Sequence[torch.Tensor], device: torch.device,
                         group=None) -> int:
    """This rank's budget for model states on ``device`` (see [Note: auto budget])."""
    held = sum(p.numel() * p.element_size() for p in params if p.device == device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free) + held
    if device.type == "cpu":
        return host_available_bytes() // _ranks_on_this_host(group) + held
    raise ValueError(f"stage='auto' can measure cuda or cpu memory, not {device.type}: pass "
                     "memory_budget_bytes")


def _min_over_ranks(value: int, group, device: torch.device) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return value
    # NCCL reduces CUDA tensors only; gloo takes CPU ones.
    dev = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    t = torch.tensor([value], dtype=torch.int64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def _explicit_level(logger: logging.Logger) -> Optional[int]:
    """The level set on ``logger`` or its zkernels ancestors (not inherited from root)."""
    while isinstance(logger, logging.Logger) and logger.name != "root":
        if logger.level != logging.NOTSET:
            return logger.level
        logger = logger.parent
    return None


def announce(message: str, group=None) -> None:
    """Show ``message`` once, on rank 0 of ``group`` (see [Note: auto announcement])."""
    rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
    if rank != 0:
        log.debug("%s", message)
        return
    level = _explicit_level(log)
    if level is not None and level > logging.INFO:
        return                                      # quiet on request
    if log.isEnabledFor(logging.INFO) and log.hasHandlers():
        log.info("%s", message)
    else:
        print(f"zkernels: {message}", file=sys.stderr, flush=True)


def resolve_auto_stage(params: Iterable[torch.Tensor], **kwargs) -> int:
    """The stage of :func:`resolve_auto_placement` (same arguments)."""
    return resolve_auto_placement(params, **kwargs)[0]


def auto_rungs(device: torch.device, offload, offload_dir) -> tuple:
    """The rungs ``stage="auto"`` may take: an explicit ``offload`` kind limits it to that
    kind's rungs; otherwise the rungs without offload, plus CPU offload where the device is
    not the host itself and NVMe offload where an ``offload_dir`` was given."""
    if offload is not None:
        return tuple(r for r in RUNGS if r[1] == offload)
    usable = {None} | ({"cpu"} if device.type != "cpu" else set()) | \
        ({"nvme"} if offload_dir is not None and device.type != "cpu" else set())
    return tuple(r for r in RUNGS if r[1] in usable)


def resolve_auto_placement(params: Iterable[torch.Tensor], *, world_size: int,
                           config: Optional[ZeroConfig] = None,
                           memory_budget_bytes: Optional[int] = None, group=None,
                           num_param_groups: int = 1, model=None, optimizer="adamw",
                           **config_kwargs) -> Tuple[int, Optional[str], bool]:
    """The rung ``stage="auto"`` resolves to: the lowest rung that fits.

    Args:
        params: the parameters the optimizer will shard (their device is the training device).
        world_size: ranks sharing the states.
        config: the run's :class:`ZeroConfig` (stage "auto"); or its keywords
            (``param_dtype``, ``bucket_bytes``, ``offload``, ...) in ``config_kwargs``. Its
            ``offload`` kind limits the rungs to that kind, its ``offload.dir`` offers the
            NVMe rungs (see :func:`auto_rungs`), its ``offload.params`` takes only rungs with
            the parameter shards off the device (else a stage-3 offload rung that does not
            fit tries them).
        memory_budget_bytes: bytes per rank the user allows (taken as is); None: measure the
            device (see [Note: auto budget]).
        group: the process group (None: the world).
        num_param_groups: the optimizer's param groups (they size the reduce buffers).
        model: the module, when known: stage 3's estimate then counts its units (the gathered
            root and blocks, one reduce buffer per unit); without it, gathered units are not
            counted.
        optimizer: what ``estimate_memory`` takes (a name, a class or an ``OptimizerSpec``):
            its state bytes per element size the rungs.

    Returns:
        ``(stage, offload, offload_params)``. Rank 0 says which rung and why, in one line
        (see [Note: auto announcement]).

    Raises:
        NoRungFitsError: not even the last rung fits.
    """
    cfg = config if config is not None else ZeroConfig.from_kwargs(stage="auto",
                                                                   **config_kwargs)
    params = [p for p in params]
    if not params:
        raise ValueError("stage='auto' needs at least one parameter")
    device = params[0].device
    if memory_budget_bytes is None:
        # The model's frozen parameters are on the device too and counted by the estimate.
        on_device = list(model.parameters()) if model is not None else params
        budget = measure_budget_bytes(on_device, device, group)
        headroom = MEASURED_HEADROOM
        source = f"measured free {device.type} memory"
    else:
        if isinstance(memory_budget_bytes, bool) or not isinstance(memory_budget_bytes, int) \
                or memory_budget_bytes <= 0:
            raise ValueError(f"memory_budget_bytes must be a positive int, got "
                             f"{memory_budget_bytes!r}")
        budget, headroom, source = memory_budget_bytes, 0.0, "memory_budget_bytes"
    budget = _min_over_ranks(budget, group, device)
    # Offload to host RAM means nothing when the device is the host (unless asked for).
    rungs = auto_rungs(device, cfg.offload.kind, cfg.offload.dir)
    distinct = {id(p): p for p in params}.values()     # tied weights count once
    (stage, offload), est, reason = choose_rung(
        model if model is not None else count_params(sum(p.numel() for p in distinct)),
        world_size, budget, config=cfg, headroom=headroom,
        max_tensor_numel=max(p.numel() for p in distinct),
        num_param_groups=num_param_groups, rungs=rungs,
        offload_params=True if cfg.offload.params else None, optimizer=optimizer)
    chosen = f"stage {stage}" if offload is None else est.name
    announce(f"stage='auto' chose {chosen} (budget from {source}): {reason}", group)
    return stage, offload, est.offload_params


def resolve_rung(config: ZeroConfig, *, param_groups, world_size: int,
                 memory_budget_bytes: Optional[int], process_group, model,
                 specs=()) -> ZeroConfig:
    """The config the optimizer runs: ``config`` itself for an explicit stage; for "auto"
    the rung :func:`resolve_auto_placement` chooses (``ZeroConfig.at_rung``: the NVMe folder
    kept only for an NVMe rung, the offload knobs only for an offload rung), sized with the
    groups' optimizer ``specs`` (their largest state per element, so that every group fits).

    Raises:
        ValueError: ``memory_budget_bytes`` at an explicit stage.
    """
    if config.stage != "auto":
        if memory_budget_bytes is not None:
            raise ValueError(f"memory_budget_bytes applies only to stage='auto', got "
                             f"stage={config.stage!r}")
        return config
    from ...comm.hybrid import is_device_mesh
    rung = resolve_auto_placement(
        [p for g in param_groups for p in g["params"]], world_size=world_size, config=config,
        memory_budget_bytes=memory_budget_bytes,
        group=None if is_device_mesh(process_group) else process_group,
        num_param_groups=len(param_groups), model=model,
        optimizer=max(specs, key=lambda s: s.state_bytes()) if specs else "adamw")
    return config.at_rung(*rung)
