"""Where the optimizer state lives: the one place that turns ``offload=`` into the place
object composed into the update engine (``places.py``: device, host RAM or NVMe files,
[Note: state places]), and ``offload_params`` into the storage object the parameter shards
live in ([Note: shard storage] in ``parameters/storage.py``), injected into the parameter
side's builders.

The registry (``policy.OFFLOADS``) says which kinds exist and the lowest stage each combines
with, ``ZeroConfig`` checks the run's offload arguments against it; this module checks the
offload folder on disk and builds the engine.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from ... import ops as _ops
from ...ops import OpSet
from ..planning.offload_config import OffloadConfig
from ..planning.config import OffloadSpec
from ..parameters.storage import DeviceStorage
from .engine import UpdateEngine, adamw_slot_moments
from .nvme_files import NvmeFiles
from .nvme_place import NvmePlace
from .param_nvme import DiskStorage
from .param_offload import HostStorage
from .places import DevicePlace, HostPlace
from .swap import check_writable
from .transfer import Copier


def check_offload_dir(offload: OffloadSpec) -> None:
    """The offload folder on disk (``ZeroConfig`` checked how the offload arguments combine):
    an existing folder, or one whose parent exists (created, as DeepSpeed's nvme_path is);
    required by ``offload="nvme"``.

    Raises:
        ValueError: naming ``offload_dir`` and what was expected. OffloadIOError:
            ``offload_dir`` cannot hold files (probed by writing).
    """
    if offload.dir is not None:
        path = os.fspath(offload.dir)
        parent = os.path.dirname(os.path.abspath(path))
        if os.path.exists(path) and not os.path.isdir(path) or \
                not os.path.exists(path) and not os.path.isdir(parent):
            raise ValueError(f"offload_dir={path!r} is not an existing folder (nor one whose "
                             f"parent exists)")
        check_writable(path)     # OffloadIOError now, not from every rank's first file
    if offload.kind == "nvme" and offload.dir is None:
        raise ValueError("offload='nvme' needs offload_dir= (an existing folder on the "
                         "disk to hold the optimizer state)")


def host_ops_for(ops_backend: Optional[str]) -> OpSet:
    """The CPU OpSet an offloaded step runs on: the native AdamW where built, the reference
    otherwise; a forced ``"triton"`` backend (a device choice) does not apply to the host."""
    backend = None if ops_backend == "triton" else ops_backend
    return _ops.for_device("cpu", backend, arg_name="ops_backend")


def check_nvme_rules(specs, config: OffloadConfig) -> None:
    """``offload="nvme"`` takes the fused AdamW, the torch.optim classes and the fused Lion /
    SGD (their state, and with ``nvme_master`` their master, swapped per unit: [Note: rule
    state on NVMe] in ``rule_swap.py``; a kept folder resumes them), and the whole-matrix
    classes (the owners' whole masters and state swapped per matrix: [Note: whole matrices
    on NVMe] in ``matrix_swap.py``), whose kept folder is refused by name: the shard masters
    of their units live in host RAM, so the folder does not hold the run.

    Raises:
        ValueError: naming the optimizer and what to use instead.
    """
    for spec in specs:
        if spec.matrix and config.resume_dir is not None:
            raise ValueError(f"OffloadConfig.resume_dir cannot resume torch.optim.{spec.name}'s "
                             f"run: the shard masters of its units live in host RAM, not in "
                             f"the folder ([Note: whole matrices on NVMe]); load a checkpoint "
                             f"(zk.checkpoint.load) instead")


def make_engine(offload, *, ops: OpSet, device: torch.device, ops_backend: Optional[str],
                offload_dir, rank: int, world_size: int,
                offload_config: Optional[OffloadConfig], offload_params: bool = False,
                specs=(), formats=(), master_dtype=None):
    """``(engine, storage)``: the update engine placed for ``offload`` (None: states on the
    device) and the storage the parameter shards live in: the device's, or with
    ``offload_params`` (stage 3, checked by ``ZeroConfig``) beside the offloaded state: in
    host RAM with CPU offload (``param_offload.py``, the state's host storage itself), in
    files with NVMe offload (``param_nvme.py``). ``master_dtype``: the fused AdamW's master
    (None: fp32; [Note: bf16 master] in ``bf16_master.py``)."""
    device_storage = DeviceStorage()
    if offload is None:
        return UpdateEngine(DevicePlace(ops, device_storage), specs=specs, formats=formats,
                            master_dtype=master_dtype), device_storage
    config = offload_config or OffloadConfig()
    if offload == "nvme":
        check_nvme_rules(specs, config)
    copier = Copier(device, config.pin_memory)
    files = None
    try:
        files = NvmeFiles(config, offload_dir, rank, world_size) if offload == "nvme" else None
        host = HostStorage(copier)
        params = host if offload_params else device_storage
        host_ops = host_ops_for(ops_backend)
        if files is None:
            place = HostPlace(ops, host_ops, copier, config, host, params)
        else:
            if offload_params:
                params = DiskStorage(copier, offload_dir, rank, world_size, config.io_threads,
                                     config.direct_io, config.nvme_param_buffer_bytes)
            place = NvmePlace(ops, host_ops, copier, config, files, host, params,
                              adamw_slot_moments(specs, formats), master_dtype or torch.float32)
    except BaseException:
        if files is not None:
            files.close()
        copier.close()
        raise
    return UpdateEngine(place, specs=specs, formats=formats, master_dtype=master_dtype), params
