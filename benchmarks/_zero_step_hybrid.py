"""Hybrid-sharding rows of the ZeRO step benchmark (``--shard-size K``): FSDP2's HSDP (a 2-D
mesh, replicate x shard) beside zkernels' ``shard_size=K`` at stages 2 and 3, with the bytes
each rank sends within its shard group and across groups (``_comm_meter.py``'s scopes).

``--shard-size K`` also names the secondary group of the hpZ rows (``fsdp2_hpz``,
``zk_stage3_hpz``): parameters sharded over all N ranks, each unit kept after forward as a
copy sharded over K ranks, so the backward gathers stay within the group (issue 16 item 4).

The HSDP rows shard the same units (every GPT block, then the root: embeddings, final
norm, tied head) over groups of K consecutive ranks and all-reduce each reduced gradient
shard across the N/K groups; both free a unit after its forward (3 passes within the group).
"""
from __future__ import annotations

from typing import Dict

import torch.nn as nn

from _zero_step_methods import FSDP2Method, ZkMethod, count_memory

HYBRID_METHODS = ("fsdp2_hsdp", "zk_stage2_hybrid", "zk_stage3_hybrid", "fsdp2_hpz",
                  "zk_stage3_hpz")


class FSDP2HSDPMethod(FSDP2Method):
    """``fully_shard(mesh=init_device_mesh("cpu", (N/K, K)))`` on every block, then the root:
    HSDP (dim 0 replicate, dim 1 shard)."""

    def __init__(self, model: nn.Module, lr: float, world_size: int, shard_size: int):
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size // shard_size, shard_size),
                                mesh_dim_names=("replicate", "shard"))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        self.model = fully_shard(model, mesh=mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)

    def memory(self) -> Dict[str, int]:
        return count_memory(self.model, self.opt)


class FSDP2HpZMethod(FSDP2Method):
    """``fully_shard(reshard_after_forward=K)`` over all N ranks (FSDP2's integer): after
    forward each unit keeps a copy sharded over K ranks, and backward gathers within them."""

    def __init__(self, model: nn.Module, lr: float, world_size: int, shard_size: int):
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=shard_size)
        self.model = fully_shard(model, mesh=mesh, reshard_after_forward=shard_size)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)


def build_hybrid(name: str, model: nn.Module, lr: float, world_size: int, shard_size: int):
    """The row ``name`` (``HYBRID_METHODS``) over a fresh ``model``."""
    if shard_size is None:
        raise ValueError(f"{name} needs --shard-size")
    if name == "fsdp2_hsdp":
        return FSDP2HSDPMethod(model, lr, world_size, shard_size)
    if name == "fsdp2_hpz":
        return FSDP2HpZMethod(model, lr, world_size, shard_size)
    if name == "zk_stage3_hpz":  # over all N ranks, secondary shards over K
        return ZkMethod(model, lr, stage=3, reshard_after_forward=shard_size)
    if name in ("zk_stage2_hybrid", "zk_stage3_hybrid"):
        return ZkMethod(model, lr, stage=int(name[len("zk_stage")]), shard_size=shard_size)
    raise ValueError(f"not a hybrid method: {name!r}")
