"""The training setups the ZeRO step benchmark compares: one table of rows, one class per library.

``METHODS`` maps a row's name to a :class:`Spec`: the library and its keyword arguments. A new
rung is one row. Every method owns a fresh copy of the same model (same seed on every rank) and
exposes ``forward_backward(x, y) -> loss``, ``update()``, ``zero_grad()``, ``memory() -> bytes
by kind`` (plus ``device``/``host``/``disk`` for the offload rows) and ``zk_stats()``
(zkernels' own ``opt.stats()``, None for the peers).

[Note: memory counted by zkernels' own counter]
Every row's memory goes through ``zkernels.zero.stats``: zkernels rows report their
``stats()``; the peers hand the tensors they hold, grouped by kind (and by place for offload),
to ``memory_bytes`` / ``memory_by_location``: distinct storages only, each under the first
kind that claims it; DTensors count their local shard. DDP's reducer buckets, which no tensor
attribute shows, are added to buffers. All rows train in fp32 unless ``--dtype bfloat16``;
in fp32 the parameter is its own master copy (master = 0 for torch).

[Note: the optimizer of a row]
``--optimizer`` sets ``Context.optimizer`` for every row: ``adamw`` (the default), ``sgd``
(torch.optim.SGD, momentum 0.9: ``ZeroOptimizer(optimizer=torch.optim.SGD)``, DeepSpeed with it
as client optimizer) or ``muon`` (torch.optim.Muon, lr 0.02, on the 2-D non-embedding matrices
and AdamW on the rest: :class:`MuonAdamW` for the torch rows, DeepSpeed's ``"type": "Muon"``,
zkernels' param groups with ``torch.optim.Muon`` on the matrices, on their owners).

[Note: shard size in a row]
A keyword whose value is ``K`` takes ``--shard-size`` at build time; such a row needs it.
"""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

K = "--shard-size"  # a keyword value replaced by the run's shard size (see the Note above)


@dataclass(frozen=True)
class Spec:
    """One row: ``lib`` (a key of ``LIBRARIES``), its keyword arguments, and whether the row
    also runs with ``--dtype bfloat16`` (zkernels ``param_dtype``, the torch rows autocast)."""

    lib: str
    kw: Dict[str, object] = field(default_factory=dict)
    bf16: bool = False


_OFFLOAD_CPU = {"offload_optimizer": "cpu"}
METHODS: Dict[str, Spec] = {
    "ddp": Spec("ddp", bf16=True),
    "torch_zero": Spec("ddp", {"zero_redundancy": True}, bf16=True),
    "fsdp2": Spec("fsdp2", bf16=True),
    "fsdp2_cpu_offload": Spec("fsdp2", {"cpu_offload": True}),
    "fsdp2_hsdp": Spec("fsdp2", {"replicate_groups": K}),
    "fsdp2_hpz": Spec("fsdp2", {"reshard_after_forward": K}),
    "zk_stage1": Spec("zk", {"stage": 1}, bf16=True),
    "zk_stage2": Spec("zk", {"stage": 2}, bf16=True),
    "zk_stage3": Spec("zk", {"stage": 3}),
    "zk_stage2_cpu": Spec("zk", {"stage": 2, "offload": "cpu"}),
    "zk_stage2_nvme": Spec("zk", {"stage": 2, "offload": "nvme"}),
    "zk_stage3_cpu": Spec("zk", {"stage": 3, "offload": "cpu"}),
    "zk_stage3_cpu_params": Spec("zk", {"stage": 3, "offload": "cpu", "offload_params": True}),
    "zk_stage3_nvme": Spec("zk", {"stage": 3, "offload": "nvme"}),
    "zk_stage3_nvme_params": Spec("zk", {"stage": 3, "offload": "nvme",
                                         "offload_params": True}),
    "zk_stage2_hybrid": Spec("zk", {"stage": 2, "shard_size": K}),
    "zk_stage3_hybrid": Spec("zk", {"stage": 3, "shard_size": K}),
    "zk_stage3_hpz": Spec("zk", {"stage": 3, "reshard_after_forward": K}),
    # issue 17: ZeRO++'s qwZ / qgZ as ZeroOptimizer options
    "zk_stage3_qw": Spec("zk", {"stage": 3, "quantize_weights": "int8"}),
    "zk_stage2_qg8": Spec("zk", {"stage": 2, "quantize_grads": "int8"}),
    "zk_stage3_qg8": Spec("zk", {"stage": 3, "quantize_grads": "int8"}),
    "zk_stage3_qg4": Spec("zk", {"stage": 3, "quantize_grads": "int4"}),
    "zk_stage3_qw_qg4": Spec("zk", {"stage": 3, "quantize_weights": "int8",
                                    "quantize_grads": "int4"}),
    "deepspeed_stage1": Spec("deepspeed", {"stage": 1}),
    "deepspeed": Spec("deepspeed", {"stage": 2}),
    "deepspeed_stage3": Spec("deepspeed", {"stage": 3}),
    "ds_stage2_cpu": Spec("deepspeed", {"stage": 2, **_OFFLOAD_CPU}),
    "ds_stage2_nvme": Spec("deepspeed", {"stage": 2, "offload_optimizer": "nvme"}),
    "ds_stage3_cpu": Spec("deepspeed", {"stage": 3, **_OFFLOAD_CPU}),
    "ds_stage3_cpu_params": Spec("deepspeed", {"stage": 3, **_OFFLOAD_CPU,
                                               "offload_param": "cpu"}),
    "ds_stage3_hpz": Spec("deepspeed", {"stage": 3, "zero_hpz_partition_size": K}),
    # ZeRO++ as DeepSpeed names it (the peers of the zk_*_q* rows)
    "ds_stage3_qw": Spec("deepspeed", {"stage": 3, "zero_quantized_weights": True}),
    "ds_stage3_qg": Spec("deepspeed", {"stage": 3, "zero_quantized_gradients": True}),
    "ds_stage3_qw_qg": Spec("deepspeed", {"stage": 3, "zero_quantized_weights": True,
                                          "zero_quantized_gradients": True}),
}


class MethodUnavailable(RuntimeError):
    """The method cannot run in this environment; the message says why."""


@dataclass
class Context:
    """What every row is built with: the run's options (``zero_step.py``'s flags)."""

    lr: float
    world_size: int
    batch_size: int = 8
    on_bucket: Callable[[int], None] = lambda nbytes: None
    param_dtype: Optional[torch.dtype] = None
    shard_size: Optional[int] = None
    offload_dir: Optional[str] = None
    nvme_budget: int = 256 * 1024
    optimizer: str = "adamw"  # one of OPTIMIZERS (--optimizer)


# --optimizer: what every row trains with ([Note: the optimizer of a row]).
OPTIMIZERS = ("adamw", "sgd", "muon")
SGD_MOMENTUM, MUON_LR = 0.9, 0.02


class MuonAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` (lr ``MUON_LR``) on the params of groups marked ``muon=True``,
    ``torch.optim.AdamW`` (``lr``) on the rest, one shared ``state``: the standard recipe as one
    class, so that ``ZeroRedundancyOptimizer(optimizer_class=MuonAdamW)`` can take it."""

    def __init__(self, params, lr: float, muon: bool = False):
        super().__init__(params, {"lr": lr, "muon": muon})
        mats = [p for g in self.param_groups if g["muon"] for p in g["params"]]
        rest = [p for g in self.param_groups if not g["muon"] for p in g["params"]]
        self.parts = ([torch.optim.Muon(mats, lr=MUON_LR)] if mats else []) + (
            [torch.optim.AdamW(rest, lr=lr)] if rest else [])
        for part in self.parts:
            part.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        for part in self.parts:
            part.step()


def muon_groups(model: nn.Module) -> List[dict]:
    """Muon's matrices as DeepSpeed picks them (``deepspeed.set_optimizer_flags``: 2-D, not an
    embedding or the head; the tied head is the token embedding), the rest for AdamW."""
    emb = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    params = list(model.parameters())
    mats = [p for p in params if p.ndim == 2 and id(p) not in emb]
    return [{"params": mats, "muon": True},
            {"params": [p for p in params if all(p is not q for q in mats)]}]


def torch_optimizer(model: nn.Module, ctx: Context, zero_redundancy: bool = False):
    """The torch rows' optimizer for ``ctx.optimizer``: AdamW, SGD (momentum 0.9) or
    :class:`MuonAdamW`; with ``zero_redundancy``, inside ``ZeroRedundancyOptimizer``."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    cls, kw = {"adamw": (torch.optim.AdamW, {}), "muon": (MuonAdamW, {}),
               "sgd": (torch.optim.SGD, {"momentum": SGD_MOMENTUM})}[ctx.optimizer]
    params = muon_groups(model) if ctx.optimizer == "muon" else model.parameters()
    if zero_redundancy:
        return ZeroRedundancyOptimizer(params, optimizer_class=cls, lr=ctx.lr, **kw)
    return cls(params, lr=ctx.lr, **kw)


def resolve(name: str, shard_size: Optional[int]) -> Dict[str, object]:
    """Row ``name``'s keywords with ``K`` replaced by ``shard_size``.

    Raises:
        ValueError: ``name`` is not a row, or it needs ``--shard-size`` and got None.
    """
    if name not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {name!r}")
    kw = dict(METHODS[name].kw)
    for key, value in kw.items():
        if value == K:
            if shard_size is None:
                raise ValueError(f"{name} needs --shard-size (its {key})")
            kw[key] = shard_size
    return kw


def _local(tensors: Iterable) -> List[torch.Tensor]:
    """Tensors (DTensors as their local shard), None and non-tensors dropped."""
    out = []
    for t in tensors:
        if isinstance(t, torch.Tensor):
            to_local = getattr(t, "to_local", None)
            out.append(to_local() if to_local is not None else t)
    return out


def _state_tensors(opt: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [v for state in opt.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


def _count(kinds: Dict[str, Iterable], host: Optional[Dict[str, Iterable]] = None,
           extra_buffers: int = 0) -> Dict[str, int]:
    """Bytes by kind through zkernels' counter; with ``host``, ``kinds`` is what the device
    holds and the result adds ``device`` / ``host`` / ``disk``."""
    from zkernels.zero.stats import memory_by_location, memory_bytes

    device = {k: _local(v) for k, v in kinds.items()}
    if host is None:
        out = memory_bytes(device)
    else:
        out, where, _ = memory_by_location(device, {k: _local(v) for k, v in host.items()}, {})
        out.update(where)
    out["buffers"] += extra_buffers
    out["total"] += extra_buffers
    return out


class _Method:
    """The step every row runs: ``self.forward(x, y)`` (the model, or the engine that wraps
    it), ``self.backward(loss)``, ``self.opt.step()`` and ``self.opt.zero_grad()``."""

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.forward(x, y)
        self.backward(loss)
        return loss.detach()

    def update(self) -> None:
        self.opt.step()

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def zk_stats(self) -> Optional[dict]:
        return None


class _TorchMethod(_Method):
    """Shared step of the torch peers: plain backward, optimizer step, grads set to None
    (``zero_grad``'s default); ``param_dtype`` bf16 runs the forward under CPU autocast."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, ctx: Context):
        self.model, self.opt, self.autocast_dtype = model, opt, ctx.param_dtype
        self.backward = torch.Tensor.backward

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=self.autocast_dtype or torch.bfloat16,
                            enabled=self.autocast_dtype is not None):
            return self.model(x, y)

    def _kinds(self, inner: torch.optim.Optimizer) -> Dict[str, List[torch.Tensor]]:
        params = list(self.model.parameters())
        return {"params": params, "grads": [p.grad for p in params],
                "optimizer_states": _state_tensors(inner), "buffers": list(self.model.buffers())}


class DDPMethod(_TorchMethod):
    """DDP whose bucket all-reduces go through Python (``allreduce_hook``) so that the comm
    meter sees them; the hook also reports each bucket's bytes for the cross-check. With
    ``zero_redundancy``: ``ZeroRedundancyOptimizer(AdamW)`` (each rank updates its parameter
    partition, then broadcasts it)."""

    def __init__(self, model: nn.Module, ctx: Context, zero_redundancy: bool = False):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        ddp = nn.parallel.DistributedDataParallel(model)

        def hook(state, bucket):
            ctx.on_bucket(bucket.buffer().numel() * bucket.buffer().element_size())
            return allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, hook)
        super().__init__(ddp, torch_optimizer(model, ctx, zero_redundancy), ctx)

    def memory(self) -> Dict[str, int]:
        # The reducer's flat buckets are separate from .grad unless gradient_as_bucket_view.
        info = self.model._get_ddp_logging_data()
        buckets = 0 if info.get("gradient_as_bucket_view") else sum(
            int(s) for s in str(info.get("bucket_sizes", "")).split(",") if s.strip())
        return _count(self._kinds(getattr(self.opt, "optim", self.opt)), extra_buffers=buckets)


class FSDP2Method(_TorchMethod):
    """``fully_shard`` on every block, then on the root (tied embedding/head, position
    embedding, final norm). ``replicate_groups=K``: HSDP over a (N/K, K) mesh;
    ``reshard_after_forward=K``: FSDP2's integer (hpZ); ``cpu_offload``: ``CPUOffloadPolicy``
    (sharded parameters, gradients and state in host RAM, torch's AdamW on the CPU)."""

    def __init__(self, model: nn.Module, ctx: Context, replicate_groups: Optional[int] = None,
                 reshard_after_forward: Optional[int] = None, cpu_offload: bool = False):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        n = ctx.world_size
        mesh = (init_device_mesh("cpu", (n,)) if replicate_groups is None else init_device_mesh(
            "cpu", (n // replicate_groups, replicate_groups),
            mesh_dim_names=("replicate", "shard")))
        policy = (CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload
                  else OffloadPolicy())
        # reshard_after_forward None: FSDP2's default (the root keeps its parameters gathered
        # from forward to backward, every block frees them)
        for module in list(model.blocks) + [model]:
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward,
                        offload_policy=policy)
        self.cpu_offload = cpu_offload
        super().__init__(model, torch_optimizer(model, ctx), ctx)

    def memory(self) -> Dict[str, int]:
        kinds = self._kinds(self.opt)
        if not self.cpu_offload:
            return _count(kinds)
        return _count({"buffers": kinds.pop("buffers")}, host=kinds)


def zero_keywords() -> frozenset:
    """The keywords this tree's ``ZeroOptimizer`` takes by name: since the config-first
    constructor, those it routes through ``**overrides`` too (``config_keywords.KEYWORDS``);
    before it, its signature's (a before/after run imports an older tree)."""
    import zkernels

    try:
        from zkernels.zero.config_keywords import KEYWORDS
    except ImportError:   # a tree from before the config-first constructor
        return frozenset(inspect.signature(zkernels.ZeroOptimizer).parameters)
    return KEYWORDS


class ZkMethod(_Method):
    """``zkernels.ZeroOptimizer(model, lr=..., **kw)``: its own backward, step and stats; with
    ``offload``, an ``OffloadConfig`` whose NVMe slots take ``--nvme-budget`` bytes."""

    def __init__(self, model: nn.Module, ctx: Context, **kw):
        import zkernels

        self.model, self.located = model, "offload" in kw
        opts = self.options(ctx, **kw)
        if ctx.optimizer == "muon":   # Muon on the matrices (on their owners), AdamW the rest
            mats, rest = muon_groups(model)
            opts["param_groups"] = [{"params": mats["params"], "optimizer": torch.optim.Muon,
                                     "lr": MUON_LR}, {"params": rest["params"]}]
        try:
            self.opt = zkernels.ZeroOptimizer(model, **opts)
        except ValueError as exc:  # a refusal by name (NVMe), reported as the row's result
            if ctx.optimizer != "muon":
                raise
            raise MethodUnavailable(f"zkernels refuses it: {exc}") from exc
        self.forward, self.backward = model, self.opt.backward

    @staticmethod
    def options(ctx: Context, **kw) -> Dict[str, object]:
        """``ZeroOptimizer``'s keywords for this row (no model needed).

        Raises:
            MethodUnavailable: a keyword this tree's ``ZeroOptimizer`` does not take (an
                option another branch adds: issue 17's ``quantize_*``).
        """
        import zkernels

        accepted = zero_keywords()
        missing = [k for k in kw if k not in accepted]
        if missing:
            raise MethodUnavailable(f"needs {', '.join(missing)} (not in this tree: "
                                    f"{os.path.dirname(zkernels.__file__)})")
        kw["lr"] = ctx.lr
        if ctx.optimizer != "adamw":
            kw.update({"optimizer": torch.optim.SGD, "momentum": SGD_MOMENTUM}
                      if ctx.optimizer == "sgd" else {})   # (muon: per group, at __init__)
        if ctx.param_dtype is not None:
            kw["param_dtype"] = ctx.param_dtype
        if "offload" in kw:
            from zkernels.zero import OffloadConfig
            kw["offload_config"] = OffloadConfig(pin_memory=None,
                                                 nvme_buffer_bytes=ctx.nvme_budget)
            if kw["offload"] == "nvme":
                kw["offload_dir"] = ctx.offload_dir
        return kw

    def zk_stats(self) -> Optional[dict]:
        return self.opt.stats()

    def memory(self) -> Dict[str, int]:
        st = self.zk_stats()
        return {**st["memory_bytes"], **(st["memory_location_bytes"] if self.located else {})}


def _tensors_in(obj, depth: int = 2) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 0 and isinstance(obj, (list, tuple, dict)):
        for x in (obj.values() if isinstance(obj, dict) else obj):
            yield from _tensors_in(x, depth - 1)


def _ds_quantizer() -> None:
    """Load the op ZeRO++'s qwZ and qgZ call (``QuantizerBuilder().load()``: in
    deepspeed/runtime/zero/partition_parameters.py ``CUDAQuantizer`` at initialize, in
    runtime/comm/coalesced_collectives.py ``all_to_all_quant_reduce`` at the first backward),
    so that a row whose quantizer cannot load is refused at build time, with DeepSpeed's
    reason, instead of failing every rank mid-step."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder import QuantizerBuilder

    try:
        QuantizerBuilder().load()
    except Exception as exc:  # noqa: BLE001 - DeepSpeed raises ValueError, builders others
        raise MethodUnavailable(
            f"DeepSpeed's ZeRO++ quantizer does not load on its "
            f"{get_accelerator().device_name()} accelerator: QuantizerBuilder is "
            f"{type(QuantizerBuilder()).__name__}: {exc}") from exc


def deepspeed_env() -> None:
    """What DeepSpeed reads from the environment, for its CPU accelerator over the existing
    gloo group (set before it is imported; also build_peak.py's)."""
    rank, n = str(dist.get_rank()), str(dist.get_world_size())
    for k, v in (("DS_ACCELERATOR", "cpu"), ("LOCAL_RANK", rank), ("RANK", rank),
                 ("LOCAL_WORLD_SIZE", n), ("WORLD_SIZE", n)):
        os.environ.setdefault(k, v)


def _first_role(kinds: Dict[str, Iterable], order) -> Dict[str, List[torch.Tensor]]:
    """``kinds`` with each storage kept only under the first kind of ``order`` that holds it."""
    seen: set = set()
    out: Dict[str, List[torch.Tensor]] = {}
    for kind in order:
        out[kind] = []
        for t in _local(kinds[kind]):
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                out[kind].append(t)
    return out


class DeepSpeedMethod(_Method):
    """DeepSpeed ZeRO (stage 2 or 3) on its CPU accelerator (``DS_ACCELERATOR=cpu``) over the
    existing gloo group, fp32, ``gradient_clipping`` 0; torch's AdamW as the client optimizer,
    or, with ``offload_optimizer``, DeepSpeed's own AdamW (DeepSpeedCPUAdam; "nvme" needs its
    async I/O op, i.e. libaio). Stage 3 sets ``stage3_param_persistence_threshold`` 0: every
    parameter resharded, as zk_stage3 and fsdp2 do (the default 1e5 elements would keep every
    tensor of the small GPT whole on every rank). Any other keyword goes into
    ``zero_optimization`` as is (ZeRO++: ``zero_quantized_weights``, ...).

    Memory, by role from the storages DeepSpeed holds (its attributes one or two levels deep):
    parameters and their partitions (``ds_tensor``) as params, the fp32 partitions as master,
    the inner optimizer's state, attributes named "grad" (and the partitions' .grad) as grads,
    every other tensor as buffers. Offloaded rows: master, state and grads on the host, params
    too with ``offload_param`` (the CPU accelerator puts both places in the same RAM)."""

    def __init__(self, model: nn.Module, ctx: Context, stage: int,
                 offload_optimizer: Optional[str] = None, offload_param: Optional[str] = None,
                 **zero_kw):
        deepspeed_env()
        try:
            import deepspeed
        except ImportError as exc:
            raise MethodUnavailable(f"deepspeed is not importable here ({exc})") from exc
        if offload_optimizer == "nvme":
            from deepspeed.ops.op_builder import AsyncIOBuilder
            if not AsyncIOBuilder().is_compatible(verbose=False):
                raise MethodUnavailable("DeepSpeed's async_io op does not build here (libaio "
                                        "headers and .so not installed): no DeepSpeed NVMe row")
        if zero_kw.get("zero_quantized_weights") or zero_kw.get("zero_quantized_gradients"):
            _ds_quantizer()
        cfg = self.config(ctx, stage, offload_optimizer, offload_param, **zero_kw)
        opt_kw = ({"model_parameters": model.parameters()} if "optimizer" in cfg else
                  {"optimizer": torch_optimizer(model, ctx)})
        self.engine, self.opt, _, _ = deepspeed.initialize(model=model, config=cfg,
                                                           dist_init_required=False, **opt_kw)
        self.model, self.offloaded, self.offload_param = model, bool(offload_optimizer), \
            bool(offload_param)
        self.forward, self.backward = self.engine, self.engine.backward

    @staticmethod
    def config(ctx: Context, stage: int, offload_optimizer: Optional[str] = None,
               offload_param: Optional[str] = None, **zero_kw) -> dict:
        """DeepSpeed's config dict for this row (no model, no DeepSpeed import needed)."""
        zo = {"stage": stage, **zero_kw}
        if stage == 3:
            zo["stage3_param_persistence_threshold"] = 0
        pin = torch.cuda.is_available()
        if offload_optimizer:
            zo["offload_optimizer"] = {"device": offload_optimizer, "pin_memory": pin}
            if offload_optimizer == "nvme":  # (buffer_size is offload_param's, not this one's)
                zo["offload_optimizer"].update(nvme_path=ctx.offload_dir, buffer_count=4)
        if offload_param:
            zo["offload_param"] = {"device": offload_param, "pin_memory": pin}
        cfg = {"train_micro_batch_size_per_gpu": ctx.batch_size,
               "gradient_accumulation_steps": 1, "gradient_clipping": 0,
               "zero_optimization": zo, "steps_per_print": 10 ** 9}
        if offload_optimizer:  # DeepSpeed refuses a client optimizer with offload
            cfg["optimizer"] = {"type": "AdamW", "params": {"lr": ctx.lr, "weight_decay": 0.01}}
        if ctx.optimizer == "sgd":  # a client torch.optim.SGD is off DeepSpeed's ZeRO list
            cfg["zero_allow_untested_optimizer"] = True
        elif ctx.optimizer == "muon":  # its own MuonWithAuxAdam (AdamW on the untagged rest)
            cfg["optimizer"] = {"type": "Muon", "params": {"lr": ctx.lr, "muon_lr": MUON_LR,
                                                            "adam_lr": ctx.lr}}
            if stage == 3:  # stage3.py: "Muon and reduce scatter cannot be used together"
                zo["reduce_scatter"] = False
        return cfg

    def update(self) -> None:
        self.engine.step()

    def zero_grad(self) -> None:
        return None  # the engine's step() clears the gradients

    def memory(self) -> Dict[str, int]:
        zo = self.opt
        attrs = vars(zo)
        master = list(_tensors_in(attrs.get("fp32_partitioned_groups_flat")
                                  or attrs.get("single_partition_of_fp32_groups") or []))
        kinds = {
            "params": [t for p in self.model.parameters()
                       for t in (p, getattr(p, "ds_tensor", None))],
            "master": master,
            "optimizer_states": _state_tensors(zo.optimizer),
            "grads": [t.grad for t in master] + [
                t for k, v in attrs.items() if "grad" in k.lower() for t in _tensors_in(v)],
            "buffers": [t for v in attrs.values() for t in _tensors_in(v)]
                       + list(self.model.buffers()),
        }
        # each storage under its first role in this order (zkernels' counter would put the
        # grads first, and counts the device and host places apart)
        kinds = _first_role(kinds, ("params", "master", "optimizer_states", "grads",
                                    "buffers"))
        if not self.offloaded:
            return _count(kinds)
        host = {k: kinds.pop(k) for k in ("master", "optimizer_states", "grads")}
        if self.offload_param:
            host["params"] = kinds.pop("params")
        return _count(kinds, host=host)


LIBRARIES = {"ddp": DDPMethod, "fsdp2": FSDP2Method, "zk": ZkMethod,
             "deepspeed": DeepSpeedMethod}


def configure(name: str, ctx: Context) -> Dict[str, object]:
    """What row ``name`` hands its library, without building anything: ``ZeroOptimizer``'s
    keywords, DeepSpeed's config dict, or the torch class's keywords (checked against its
    signature).

    Raises:
        MethodUnavailable, ValueError: as :func:`build`; TypeError: a keyword the class does
            not take.
    """
    kw = resolve(name, ctx.shard_size)
    cls = LIBRARIES[METHODS[name].lib]
    if cls is ZkMethod:
        return ZkMethod.options(ctx, **kw)
    if cls is DeepSpeedMethod:
        return DeepSpeedMethod.config(ctx, **kw)
    inspect.signature(cls).bind(None, ctx, **kw)
    return kw


def build(name: str, model_cfg, seed: int, ctx: Context):
    """A fresh GPT (identical on every rank: seeded) wrapped by row ``name``.

    Raises:
        MethodUnavailable: the row cannot run here (the message says why).
        ValueError: unknown row, or a row that needs ``--shard-size`` without one.
    """
    from zkernels.demo.model import GPT

    kw = resolve(name, ctx.shard_size)
    torch.manual_seed(seed)
    return LIBRARIES[METHODS[name].lib](GPT(model_cfg), ctx, **kw)


def all_ranks_ok(ok: bool) -> bool:
    """True when every rank got ``ok``: a method that fails to build on one rank is skipped
    on all of them instead of leaving the others waiting in its first collective."""
    flag = torch.tensor([0.0 if ok else 1.0])
    dist.all_reduce(flag)
    return flag.item() == 0.0
