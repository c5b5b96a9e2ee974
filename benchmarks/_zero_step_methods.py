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
METHODS = ("ddp", "torch_zero", "fsdp2", "zk_stage1", "zk_stage2", "deepspeed", "zk_stage3",
           "deepspeed_stage3")
# Offload rows (issue 9): zkernels stage 2 with offload="cpu" / "nvme" beside DeepSpeed's
# stage 2 offload_optimizer (cpu / nvme) and FSDP2's CPUOffloadPolicy.
OFFLOAD_METHODS = ("zk_stage2_cpu", "zk_stage2_nvme", "ds_stage2_cpu", "ds_stage2_nvme",
                   "fsdp2_cpu_offload")


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


def _location_bytes(device_tensors: Iterable[torch.Tensor], host_tensors: Iterable[torch.Tensor],
                    disk_bytes: int = 0) -> Dict[str, int]:
    """Distinct storages by location (a storage counted once, device first)."""
    seen: set = set()
    return {"device": _storage_bytes(device_tensors, seen),
            "host": _storage_bytes(host_tensors, seen), "disk": int(disk_bytes)}


def nvme_budget_bytes() -> int:
    """Host RAM of the NVMe rows (zero_step.py --nvme-budget, passed to the ranks)."""
    import os
    return int(os.environ.get("ZK_BENCH_NVME_BUDGET", 256 * 1024))


class ZkOffloadMethod(ZkMethod):
    """``ZeroOptimizer(model, stage=2, offload="cpu" | "nvme")``; memory by kind and by
    location (device / host RAM / disk) from its own ``stats()``."""

    def __init__(self, model: nn.Module, lr: float, offload: str, offload_dir: Optional[str]):
        import zkernels
        from zkernels.zero import OffloadConfig

        self.model = model
        kw = {"offload_dir": offload_dir} if offload == "nvme" else {}
        self.opt = zkernels.ZeroOptimizer(
            model, stage=2, lr=lr, offload=offload, offload_config=OffloadConfig(
                pin_memory=None, nvme_buffer_bytes=nvme_budget_bytes()), **kw)

    def memory(self) -> Dict[str, int]:
        st = self.zk_stats()
        mem = dict(st["memory_bytes"])
        mem.update(st["memory_location_bytes"])
        return mem




class DeepSpeedOffloadMethod:
    """DeepSpeed ZeRO stage 2 with ``offload_optimizer`` to cpu (DeepSpeedCPUAdam) or nvme
    (its async I/O op, which needs libaio), fp32, on the existing gloo process group."""

    def __init__(self, model: nn.Module, lr: float, device: str, offload_dir: Optional[str],
                 batch_size: int):
        import os

        if importlib.util.find_spec("deepspeed") is None:
            raise MethodUnavailable("deepspeed is not importable here (not installed)")
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
        os.environ.setdefault("RANK", str(dist.get_rank()))
        os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
        if device == "nvme":
            from deepspeed.ops.op_builder import AsyncIOBuilder
            if not AsyncIOBuilder().is_compatible(verbose=False):
                raise MethodUnavailable("DeepSpeed's async_io op does not build here (libaio "
                                        "headers and .so not installed): no DeepSpeed NVMe row")
        import deepspeed

        off = {"device": device, "pin_memory": torch.cuda.is_available()}
        if device == "nvme":
            off.update(nvme_path=offload_dir, buffer_count=4,
                       buffer_size=nvme_budget_bytes() // 4)
        cfg = {"train_micro_batch_size_per_gpu": batch_size, "gradient_accumulation_steps": 1,
               "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
               "zero_optimization": {"stage": 2, "offload_optimizer": off},
               "bf16": {"enabled": False}, "fp16": {"enabled": False}}
        self.model, self.opt, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=cfg,
            dist_init_required=False)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.model(x, y)
        self.model.backward(loss)
        return loss.detach()

    def update(self) -> None:
        self.model.step()

    def zero_grad(self) -> None:
        return None  # the engine's step() clears gradients

    def zk_stats(self) -> Optional[dict]:
        return None

    def memory(self) -> Dict[str, int]:
        zo = self.opt
        seen: set = set()
        params = list(self.model.module.parameters())
        fp32 = list(getattr(zo, "single_partition_of_fp32_groups", []))
        states = [v for st in zo.optimizer.state.values() for v in st.values()
                  if isinstance(v, torch.Tensor)]
        grads = [t.grad for t in fp32 if t.grad is not None]
        bufs = [b for b in getattr(zo, "ipg_buffer", None) or [] if isinstance(b, torch.Tensor)]
        out = {"params": _storage_bytes(params, seen), "grads": _storage_bytes(grads, seen),
               "master": _storage_bytes(fp32, seen),
               "optimizer_states": _storage_bytes(states, seen),
               "buffers": _storage_bytes(bufs, seen)}
        out["total"] = sum(out[k] for k in MEMORY_KINDS)
        out.update(_location_bytes(params + bufs, fp32 + grads + states))
        return out


class FSDP2CPUOffloadMethod(FSDP2Method):
    """FSDP2 with ``CPUOffloadPolicy``: sharded parameters, gradients and optimizer state in
    host RAM, the optimizer step on the CPU (torch's AdamW), all-or-nothing by design."""

    def __init__(self, model: GPT, lr: float, world_size: int):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        for block in model.blocks:
            fully_shard(block, mesh=mesh, offload_policy=policy)
        self.model = fully_shard(model, mesh=mesh, offload_policy=policy)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)

    def memory(self) -> Dict[str, int]:
        out = count_memory(self.model, self.opt)
        params = list(self.model.parameters())
        host = params + [p.grad for p in params if p.grad is not None] + \
            list(_state_tensors(self.opt))
        out.update(_location_bytes(list(self.model.buffers()), host))
        return out


def build(name: str, cfg: GPTConfig, seed: int, lr: float, world_size: int,
          on_bucket: Callable[[int], None], offload_dir: Optional[str] = None,
          batch_size: int = 8, param_dtype: Optional[torch.dtype] = None,
          shard_size: Optional[int] = None):
    """A fresh model (identical on every rank) wrapped by method ``name``. ``param_dtype``
    (None: fp32): the stage 1-2 zkernels rows get ``param_dtype=``, the torch rows run under
    autocast (the stage-3 and offload rows stay fp32).

    Raises MethodUnavailable when the method cannot run here."""
    from _zero_step_hybrid import HYBRID_METHODS, build_hybrid
    if name in HYBRID_METHODS:  # --shard-size: groups of K ranks (_zero_step_hybrid.py)
        torch.manual_seed(seed)
        return build_hybrid(name, GPT(cfg), lr, world_size, shard_size)
    method = _build(name, cfg, seed, lr, world_size, on_bucket, offload_dir, batch_size,
                    param_dtype)
    if isinstance(method, _TorchMethod):
        method.autocast_dtype = param_dtype
    return method


def _build(name: str, cfg: GPTConfig, seed: int, lr: float, world_size: int,
           on_bucket: Callable[[int], None], offload_dir: Optional[str], batch_size: int,
           param_dtype: Optional[torch.dtype]):
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
    if name in STAGE3_METHODS:
        return build_stage3(name, model, lr, batch_size)
    if name in ("zk_stage2_cpu", "zk_stage2_nvme"):
        return ZkOffloadMethod(model, lr, name.rsplit("_", 1)[1], offload_dir)
    if name in ("ds_stage2_cpu", "ds_stage2_nvme"):
        return DeepSpeedOffloadMethod(model, lr, name.rsplit("_", 1)[1], offload_dir,
                                      batch_size)
    if name == "fsdp2_cpu_offload":
        return FSDP2CPUOffloadMethod(model, lr, world_size)
    if name in STAGE3_OFFLOAD_METHODS:
        return build_stage3_offload(name, model, lr, offload_dir, batch_size)
    raise ValueError(f"method must be one of "
                     f"{METHODS + OFFLOAD_METHODS + STAGE3_OFFLOAD_METHODS}, got {name!r}")


def all_ranks_ok(ok: bool) -> bool:
    """True when every rank got ``ok``: a method that fails to build on one rank is skipped
    on all of them instead of leaving the others waiting in its first collective."""
    flag = torch.tensor([0.0 if ok else 1.0])
    dist.all_reduce(flag)
    return flag.item() == 0.0


# -- stage 3 rows (added beside the stage 1/2 ones; build() dispatches to them) -----------------

STAGE3_METHODS = ("zk_stage3", "deepspeed_stage3")


class ZkStage3Method(ZkMethod):
    """``ZeroOptimizer(model, stage=3)``: its default units are the GPT's blocks plus the root
    unit (embeddings, final norm, tied head), the same units as the fsdp2 row's
    ``fully_shard`` calls; every unit is resharded after forward (3Ψ)."""

    def __init__(self, model: nn.Module, lr: float):
        import zkernels

        self.model = model
        self.opt = zkernels.ZeroOptimizer(model, stage=3, lr=lr)


def _tensors_in(obj, depth: int = 2) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 0 and isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors_in(x, depth - 1)
    elif depth > 0 and isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors_in(x, depth - 1)


class DeepSpeedStage3Method:
    """DeepSpeed ZeRO stage 3 on the CPU accelerator (``DS_ACCELERATOR=cpu``, gloo), fp32,
    ``gradient_clipping`` 0, torch AdamW as the client optimizer, DeepSpeed's default
    prefetch settings and ``stage3_param_persistence_threshold`` 0: every parameter resharded,
    as zk_stage3 and fsdp2 do (the default 1e5 elements would keep every tensor of the small
    GPT whole on every rank, i.e. stage 2 with extra steps).

    Memory is counted from the storages DeepSpeed's stage-3 optimizer holds (best effort: its
    attributes one or two levels deep): the parameter partitions (``ds_tensor``) as params, the
    fp32 partitions as master, the inner optimizer's state as optimizer_states, tensors whose
    attribute name mentions "grad" as grads, every other tensor it holds as buffers."""

    def __init__(self, model: nn.Module, lr: float, batch_size: int):
        if importlib.util.find_spec("deepspeed") is None:
            raise MethodUnavailable("deepspeed is not importable here (not installed)")
        import os
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        for k, v in (("LOCAL_RANK", str(dist.get_rank())),
                     ("LOCAL_WORLD_SIZE", str(dist.get_world_size())),
                     ("RANK", str(dist.get_rank())), ("WORLD_SIZE", str(dist.get_world_size()))):
            os.environ.setdefault(k, v)
        import deepspeed

        cfg = {"train_micro_batch_size_per_gpu": batch_size, "gradient_accumulation_steps": 1,
               "gradient_clipping": 0,
               "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
               "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        self.engine, self.opt, _, _ = deepspeed.initialize(model=model, optimizer=opt,
                                                           config=cfg, dist_init_required=False)
        self.model = model

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.engine(x, y)
        self.engine.backward(loss)
        return loss.detach()

    def update(self) -> None:
        self.engine.step()

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def zk_stats(self) -> Optional[dict]:
        return None

    def memory(self) -> Dict[str, int]:
        seen: set = set()
        params = [t for p in self.model.parameters()
                  for t in (p, getattr(p, "ds_tensor", None)) if t is not None]
        out = {"params": _storage_bytes(params, seen)}
        ds = self.opt
        inner = getattr(ds, "optimizer", None)
        out["master"] = _storage_bytes(_tensors_in(getattr(ds, "fp32_partitioned_groups_flat",
                                                           [])), seen)
        out["optimizer_states"] = _storage_bytes(
            _state_tensors(inner) if inner is not None else [], seen)
        grads = [t for k, v in vars(ds).items() if "grad" in k.lower() for t in _tensors_in(v)]
        out["grads"] = _storage_bytes(grads, seen)
        rest = [t for v in vars(ds).values() for t in _tensors_in(v)]
        out["buffers"] = _storage_bytes(rest, seen) + _storage_bytes(self.model.buffers(), seen)
        out["total"] = sum(out[k] for k in MEMORY_KINDS)
        return out


def build_stage3(name: str, model: nn.Module, lr: float, batch_size: int):
    """The stage-3 rows (``STAGE3_METHODS``) over a fresh ``model``."""
    if name == "zk_stage3":
        return ZkStage3Method(model, lr)
    if name == "deepspeed_stage3":
        return DeepSpeedStage3Method(model, lr, batch_size)
    raise ValueError(f"not a stage-3 method: {name!r}")


# -- stage 3 offload rows (issue 9): zkernels stage 3 + cpu / nvme, with and without the
# parameter shards in host RAM (offload_params), beside DeepSpeed stage 3's offload_optimizer
# (and offload_param) to cpu ---------------------------------------------------------------

STAGE3_OFFLOAD_METHODS = ("zk_stage3_cpu", "zk_stage3_cpu_params", "zk_stage3_nvme",
                          "zk_stage3_nvme_params", "ds_stage3_cpu", "ds_stage3_cpu_params")


class ZkStage3OffloadMethod(ZkOffloadMethod):
    """``ZeroOptimizer(model, stage=3, offload=..., offload_params=...)``; memory by kind and
    location from its ``stats()``."""

    def __init__(self, model: nn.Module, lr: float, offload: str, offload_dir: Optional[str],
                 offload_params: bool):
        import zkernels
        from zkernels.zero import OffloadConfig

        self.model = model
        kw = {"offload_dir": offload_dir} if offload == "nvme" else {}
        self.opt = zkernels.ZeroOptimizer(
            model, stage=3, lr=lr, offload=offload, offload_params=offload_params,
            offload_config=OffloadConfig(pin_memory=None,
                                         nvme_buffer_bytes=nvme_budget_bytes()), **kw)


class DeepSpeedStage3OffloadMethod(DeepSpeedStage3Method):
    """DeepSpeed ZeRO stage 3 (CPU accelerator, gloo, fp32) with ``offload_optimizer`` to cpu
    (DeepSpeedCPUAdam) and, for ``ds_stage3_cpu_params``, ``offload_param`` to cpu. Memory by
    kind as :class:`DeepSpeedStage3Method`; by location by role (DeepSpeed's CPU accelerator
    puts "device" and host tensors in the same RAM): master, states and gradient partitions
    on the host, parameter partitions too with ``offload_param``."""

    def __init__(self, model: nn.Module, lr: float, batch_size: int, offload_param: bool):
        if importlib.util.find_spec("deepspeed") is None:
            raise MethodUnavailable("deepspeed is not importable here (not installed)")
        import os
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        for k, v in (("LOCAL_RANK", str(dist.get_rank())),
                     ("LOCAL_WORLD_SIZE", str(dist.get_world_size())),
                     ("RANK", str(dist.get_rank())), ("WORLD_SIZE", str(dist.get_world_size()))):
            os.environ.setdefault(k, v)
        import deepspeed

        zo = {"stage": 3, "stage3_param_persistence_threshold": 0,
              "offload_optimizer": {"device": "cpu", "pin_memory": torch.cuda.is_available()}}
        if offload_param:
            zo["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        cfg = {"train_micro_batch_size_per_gpu": batch_size, "gradient_accumulation_steps": 1,
               "gradient_clipping": 0, "zero_optimization": zo,
               "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
               "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
        self.offload_param = offload_param
        self.engine, self.opt, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=cfg,
            dist_init_required=False)
        self.model = model

    def memory(self) -> Dict[str, int]:
        out = super().memory()
        host = out["master"] + out["optimizer_states"] + out["grads"] + \
            (out["params"] if self.offload_param else 0)
        out.update({"device": out["total"] - host, "host": host, "disk": 0})
        return out


def build_stage3_offload(name: str, model: nn.Module, lr: float, offload_dir: Optional[str],
                         batch_size: int):
    """The stage-3 offload rows (``STAGE3_OFFLOAD_METHODS``) over a fresh ``model``."""
    params = name.endswith("_params")
    if name.startswith("zk_"):
        kind = "nvme" if "_nvme" in name else "cpu"
        return ZkStage3OffloadMethod(model, lr, kind, offload_dir, params)
    return DeepSpeedStage3OffloadMethod(model, lr, batch_size, params)
