"""Where the optimizer state lives: the one place that turns ``offload=`` into a placement of
the update engine (``engine.UpdateEngine``: "device", "cpu" or "nvme").

The registry (``policy.OFFLOADS``) says which kinds exist, which are implemented and the lowest
stage each combines with; this module checks the constructor's offload arguments against it
and builds the engine.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from ... import ops as _ops
from ...ops import OpSet
from ..planning.offload_config import OffloadConfig
from ..planning.policy import OFFLOADS, STAGES, StagePolicy
from ..parameters.param_nvme import DiskParamStore
from ..parameters.param_offload import HostParamStore, sharded_params_factory
from .engine import UpdateEngine
from .nvme_files import NvmeFiles
from .swap import check_writable
from .transfer import Copier


def check_offload_args(offload, offload_dir, offload_config, auto: bool = False) -> None:
    """Validate ``offload``, ``offload_dir`` and ``offload_config`` (before any work).

    Args:
        auto: ``stage="auto"``, where ``offload_dir`` alone offers the NVMe rungs and
            ``offload_config`` applies to whichever offload rung is taken.

    Raises:
        ValueError / NotImplementedError / TypeError: naming the argument and what was
            expected. OffloadIOError: ``offload_dir`` cannot hold files (probed by writing).
    """
    if offload is not None and not (isinstance(offload, str) and offload in OFFLOADS):
        raise ValueError(f"offload must be None, 'cpu' or 'nvme', got {offload!r}")
    if not OFFLOADS[offload].implemented:
        raise NotImplementedError(f"offload={offload!r} is not available in this version: "
                                  f"pass offload=None")
    if offload_config is not None and not isinstance(offload_config, OffloadConfig):
        raise TypeError(f"offload_config must be a zkernels.zero.OffloadConfig or None, got "
                        f"{type(offload_config).__name__}")
    if offload is None and offload_config is not None and not auto:
        raise ValueError("offload_config applies only with offload='cpu' or 'nvme'")
    if offload == "cpu" and offload_config is not None and offload_config.resume_dir:
        raise ValueError("OffloadConfig.resume_dir applies only to offload='nvme'")
    if offload != "nvme" and offload_dir is not None and not (auto and offload is None):
        raise ValueError(f"offload_dir applies only to offload='nvme' (got offload="
                         f"{offload!r}, offload_dir={offload_dir!r})")
    if offload_dir is not None:
        if not isinstance(offload_dir, (str, os.PathLike)):
            raise TypeError(f"offload_dir must be a path, got {type(offload_dir).__name__}")
        path = os.fspath(offload_dir)
        parent = os.path.dirname(os.path.abspath(path))
        # A missing folder is created (as DeepSpeed's nvme_path is) when its parent exists.
        if os.path.exists(path) and not os.path.isdir(path) or \
                not os.path.exists(path) and not os.path.isdir(parent):
            raise ValueError(f"offload_dir={path!r} is not an existing folder (nor one whose "
                             f"parent exists)")
        check_writable(path)     # OffloadIOError now, not from every rank's first file
    if offload == "nvme":
        if offload_dir is None:
            raise ValueError("offload='nvme' needs offload_dir= (an existing folder on the "
                             "disk to hold the optimizer state)")


def check_offload_stage(offload, policy: StagePolicy) -> None:
    """Raises ValueError when ``offload`` does not combine with ``policy``'s stage."""
    off = OFFLOADS[offload]
    if policy.stage < off.min_stage:
        allowed = " or ".join(str(s) for s, p in STAGES.items()
                              if s >= off.min_stage and p.implemented)
        raise ValueError(f"offload={offload!r} needs stage {allowed}, got stage "
                         f"{policy.stage}: stage {policy.stage} keeps full gradients on the "
                         f"device until step(), so there is no gradient shard to stream "
                         f"to the host during backward")


def check_offload_params(offload_params, offload, policy: StagePolicy) -> bool:
    """``offload_params`` as a bool, checked against the stage and the offload kind.

    Raises:
        TypeError: not a bool.
        ValueError: stages 1-2 (nothing to offload: the full parameters stay on the device),
            or no ``offload`` (the shards go to host RAM beside the offloaded state).
    """
    if not isinstance(offload_params, bool):
        raise TypeError(f"offload_params must be a bool, got {type(offload_params).__name__}")
    if not offload_params:
        return False
    if not policy.shards_params:
        raise ValueError(f"offload_params=True applies only to stage=3, got stage="
                         f"{policy.stage}: stages 1-2 keep the full parameters on the device "
                         f"(every rank computes with all of them), so there is no parameter "
                         f"shard to keep in host RAM")
    if offload is None:
        raise ValueError("offload_params=True needs offload='cpu' or 'nvme': the parameter "
                         "shards go to host RAM beside the offloaded optimizer state (pass "
                         "offload='cpu' too)")
    return True


def host_ops_for(ops_backend: Optional[str]) -> OpSet:
    """The CPU OpSet an offloaded step runs on: the native AdamW where built, the reference
    otherwise; a forced ``"triton"`` backend (a device choice) does not apply to the host."""
    backend = None if ops_backend == "triton" else ops_backend
    return _ops.for_device("cpu", backend, arg_name="ops_backend")


def make_engine(offload, *, ops: OpSet, device: torch.device, ops_backend: Optional[str],
                offload_dir, rank: int, world_size: int,
                offload_config: Optional[OffloadConfig], offload_params: bool = False):
    """The update engine placed for ``offload`` (None: states on the device); with
    ``offload_params`` (stage 3, checked by :func:`check_offload_params`) the parameter side
    keeps its shards beside the offloaded state: in host RAM with CPU offload
    (``param_offload.py``), in files with NVMe offload (``param_nvme.py``)."""
    if offload is None:
        return UpdateEngine("device", ops=ops, sharded_params=sharded_params_factory(None))
    config = offload_config or OffloadConfig()
    copier = Copier(device, config.pin_memory)
    store = files = None
    try:
        files = NvmeFiles(config, offload_dir, rank, world_size) if offload == "nvme" else None
        if offload_params and files is not None:
            store = DiskParamStore(copier, offload_dir or os.path.dirname(files.folder), rank,
                                   world_size, config.io_threads, config.direct_io,
                                   config.nvme_param_buffer_bytes)
        elif offload_params:
            store = HostParamStore(copier)
    except BaseException:
        if files is not None:
            files.close()
        copier.close()
        raise
    return UpdateEngine(offload, ops=ops, host_ops=host_ops_for(ops_backend), copier=copier,
                        config=config, files=files, param_store=store,
                        sharded_params=sharded_params_factory(store))
