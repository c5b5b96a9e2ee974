"""The training setups the ZeRO step benchmark compares, each behind one small interface.

Every method owns a fresh copy of the same model (same seed on every rank) and exposes
``forward_backward(x, y) -> loss``, ``update()``, ``zero_grad()``, ``memory() -> bytes by kind``
and ``zk_stats()`` (zkernels' own ``opt.stats()``, None for the torch peers). Memory is counted
from the tensors a rank holds, distinct storages only, each storage under the first kind that
claims it (params, grads, master, optimizer_states, buffers); DTensors count their local shard.
All setups train in fp32, where the parameter is its own master copy (master = 0 for torch).
"""
from __future__ import annotations

import importlib.util
from typing import Callable, Dict, Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from zkernels.demo.model import GPT, GPTConfig

MEMORY_KINDS = ("params", "grads", "master", "optimizer_states", "buffers")
METHODS = ("ddp", "torch_zero", "fsdp2", "zk_stage1", "zk_stage2", "deepspeed")


class MethodUnavailable(RuntimeError):
    """The method cannot run in this environment; the message says why."""


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # DTensor (FSDP2 params, grads, states)
    return to_local() if to_local is not None else t


def _storage_bytes(tensors: Iterable[torch.Tensor], seen: set) -> int:
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        storage = _local(t).untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def _state_tensors(opt: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    for state in opt.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def count_memory(model: nn.Module, opt: torch.optim.Optimizer,
                 buffer_bytes: int = 0) -> Dict[str, int]:
    """Bytes this rank holds, by kind. ``buffer_bytes``: persistent comm buffers the tensors
    do not show (DDP's reducer buckets), added to the module's registered buffers."""
    seen: set = set()
    params = list(model.parameters())
    out = {
        "params": _storage_bytes(params, seen),
        "grads": _storage_bytes((p.grad for p in params if p.grad is not None), seen),
        "master": 0,
        "optimizer_states": _storage_bytes(_state_tensors(opt), seen),
        "buffers": _storage_bytes(model.buffers(), seen) + buffer_bytes,
    }
    out["total"] = sum(out[k] for k in MEMORY_KINDS)
    return out


class _TorchMethod:
    """Shared step for the torch peers: plain backward, optimizer step, grads set to None.
    ``autocast_dtype`` (None: fp32) runs the forward under CPU autocast (the bf16 rows)."""

    model: nn.Module
    opt: torch.optim.Optimizer
    autocast_dtype: Optional[torch.dtype] = None

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=self.autocast_dtype or torch.bfloat16,
                            enabled=self.autocast_dtype is not None):
            loss = self.model(x, y)
        loss.backward()
        return loss.detach()

    def update(self) -> None:
        self.opt.step()

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def zk_stats(self) -> Optional[dict]:
        return None


def _ddp(model: nn.Module, on_bucket: Callable[[int], None]) -> nn.Module:
    """DDP whose bucket all-reduces go through Python (``allreduce_hook``), so that the comm
    meter sees them; the hook also reports each bucket's bytes for the cross-check."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ddp = nn.parallel.DistributedDataParallel(model)

    def hook(state, bucket):
        on_bucket(bucket.buffer().numel() * bucket.buffer().element_size())
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    return ddp


def _ddp_bucket_bytes(ddp: nn.Module) -> int:
    # The reducer's flat buckets are separate from .grad unless gradient_as_bucket_view.
    info = ddp._get_ddp_logging_data()
    if info.get("gradient_as_bucket_view"):
        return 0
    return sum(int(s) for s in str(info.get("bucket_sizes", "")).split(",") if s.strip())


class DDPMethod(_TorchMethod):
    def __init__(self, model: nn.Module, lr: float, on_bucket: Callable[[int], None]):
        self.model = _ddp(model, on_bucket)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)

    def memory(self) -> Dict[str, int]:
        return count_memory(self.model, self.opt, _ddp_bucket_bytes(self.model))


class TorchZeroMethod(_TorchMethod):
    """``ZeroRedundancyOptimizer(AdamW)`` under DDP: all-reduce of grads, each rank updates
    its parameter partition, then broadcasts it."""

    def __init__(self, model: nn.Module, lr: float, on_bucket: Callable[[int], None]):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        self.model = _ddp(model, on_bucket)
        self.opt = ZeroRedundancyOptimizer(self.model.parameters(),
                                           optimizer_class=torch.optim.AdamW, lr=lr)

    def memory(self) -> Dict[str, int]:
        return count_memory(self.model, self.opt.optim, _ddp_bucket_bytes(self.model))


class FSDP2Method(_TorchMethod):
    """``fully_shard`` on every block, then on the root (which holds the tied embedding/head,
    the position embedding and the final norm)."""

    def __init__(self, model: GPT, lr: float, world_size: int):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        self.model = fully_shard(model, mesh=mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)

    def memory(self) -> Dict[str, int]:
        return count_memory(self.model, self.opt)


class ZkMethod:
    """``zkernels.ZeroOptimizer(model, stage=s)``: its own backward, step and stats."""

    def __init__(self, model: nn.Module, lr: float, stage: int, **zk_kwargs):
        import zkernels

        zero_cls = getattr(zkernels, "ZeroOptimizer", None)
        if zero_cls is None:
            raise MethodUnavailable("ZeroOptimizer not available (zkernels has no "
                                    "ZeroOptimizer in this checkout)")
        self.model = model
        self.opt = zero_cls(model, stage=stage, lr=lr, **zk_kwargs)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.model(x, y)
        self.opt.backward(loss)
        return loss.detach()

    def update(self) -> None:
        self.opt.step()

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def zk_stats(self) -> Optional[dict]:
        return self.opt.stats()

    def memory(self) -> Dict[str, int]:
        mem = dict(self.zk_stats()["memory_bytes"])
        mem.setdefault("total", sum(mem.get(k, 0) for k in MEMORY_KINDS))
        return mem


def build(name: str, cfg: GPTConfig, seed: int, lr: float, world_size: int,
          on_bucket: Callable[[int], None], param_dtype: Optional[torch.dtype] = None):
    """A fresh model (identical on every rank) wrapped by method ``name``. ``param_dtype``
    (None: fp32): zkernels rows get ``param_dtype=``, the torch rows run under autocast.

    Raises MethodUnavailable when the method cannot run here."""
    method = _build(name, cfg, seed, lr, world_size, on_bucket, param_dtype)
    if isinstance(method, _TorchMethod):
        method.autocast_dtype = param_dtype
    return method


def _build(name: str, cfg: GPTConfig, seed: int, lr: float, world_size: int,
           on_bucket: Callable[[int], None], param_dtype: Optional[torch.dtype]):
    if name == "deepspeed":
        if importlib.util.find_spec("deepspeed") is None:
            raise MethodUnavailable("deepspeed is not importable here (not installed)")
        raise MethodUnavailable("deepspeed is importable, but this benchmark has no DeepSpeed "
                                "row: it was written where DeepSpeed is absent and could not "
                                "be tested")
    torch.manual_seed(seed)
    model = GPT(cfg)
    if name == "ddp":
        return DDPMethod(model, lr, on_bucket)
    if name == "torch_zero":
        return TorchZeroMethod(model, lr, on_bucket)
    if name == "fsdp2":
        return FSDP2Method(model, lr, world_size)
    if name in ("zk_stage1", "zk_stage2"):
        return ZkMethod(model, lr, stage=int(name[-1]), param_dtype=param_dtype)
    raise ValueError(f"method must be one of {METHODS}, got {name!r}")


def all_ranks_ok(ok: bool) -> bool:
    """True when every rank got ``ok``: a method that fails to build on one rank is skipped
    on all of them instead of leaving the others waiting in its first collective."""
    flag = torch.tensor([0.0 if ok else 1.0])
    dist.all_reduce(flag)
    return flag.item() == 0.0
