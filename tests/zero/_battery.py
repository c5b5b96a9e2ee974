"""The ZeRO battery's table, its rows' builders and its one oracle (``Reference``); the checks
and their tests are in test_battery.py (module-level here so spawned ranks import it).

A row is a :class:`Row`: the rung (stage 1/2/3, offload none/"cpu"/"nvme", ``offload_params``,
hybrid ``shard_size``, stage 3's ``reshard_after_forward`` True/False/R), the dtype
(fp32/bf16/fp16) and the training options (micro-batches, clipping, groups, frozen
parameters as ``_harness.freeze_layers`` sets them, a scheduler, another block order,
activation checkpointing). ``ROWS`` lists ``(row, checks, world sizes)``; ``TABLE`` maps every
``"<row id>-<check>"`` to its row and check. A new rung or option is tested by adding a field
to :class:`Row` (its optimizer keyword in :meth:`Row.optimizer_kw`) and a line to ``ROWS``.

The oracle, ``Reference``: single-process ``torch.optim.AdamW`` on the same data: in fp32
the same-order reference continued from our parameters after each step ([Note: same-order
reference], [Note: one step from the same point] in ``_harness.py``), within tol(float32); in
bf16 the same recipe in one process (bf16 gradients, summed in fp32, AdamW on fp32 masters
rounded to bf16) continued from our masters after each step, the compute parameters within
tol(bfloat16) and this rank's master shards within rtol 1e-4 / atol 1e-5. Continuing from the
same point is what lets bf16 rows run the optimizer's own backend: a reference continued from
its own masters drifts from any AdamW whose fp32 round-off differs from torch's (a flipped
bf16 rounding of a compute parameter moves the next gradients, and Adam amplifies that near
eps into a few % of lr within a few steps), so those checks had to run the reference ops.

[Note: the low-bit oracle]
A row with ``state`` (bf16 or int8 moments) runs against
:class:`~zkernels.reference.adamw_lowbit.LowbitAdamW` on the whole parameters, which applies
the same quantization (int8 blocks from each parameter's element 0, which the optimizer's
aligned shards reproduce). As for the parameters, each step starts from the same point: after
the parameters are compared and copied, this rank's moments (codes and scales, or bf16) are
compared with the oracle's piece by piece (at most one int8 code, or one bf16 ulp, apart: the
summation order of the reduced gradient may round a moment across a code boundary) and the
oracle's moments continue from every rank's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import shutil
import tempfile
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

import zkernels as zk
from tests.conftest import tol
from tests.zero._harness import (EPS, LR, chunk, clone_model, freeze_layers,
                                 make_model, ratio, reference_grads, split_groups, variant,
                                 world_mean, worst_param)
from zkernels.reference.adamw_lowbit import (EXP_AVG_MANT_BITS, EXP_AVG_SQ_MANT_BITS,
                                             LowbitAdamW, decode_ratio)
from zkernels.optimizers import AdEMAMix
from zkernels.zero.planning.state_format import parse_state_dtype
from zkernels.zero import LossScaleConfig, OffloadConfig

BETAS = (0.9, 0.95)
WD = 0.1
SMALL_BUCKET = 3000  # bytes: several buckets, and fc/fc_out/wte larger than one bucket
# Several sub-groups per unit: the smallest NVMe budget for three one-block slots (master and
# moments on disk, an fp32 gradient and a bf16 output) is 3 x 1024 x (12 + 4 + 2) + 2 x 4096
# bytes; this one gives 1024-element slots.
NVME_BUDGET = 3 * 1024 * 18 + 2 * 4096 + 1000
# With the parameter shards on NVMe too (offload_params), a bf16 sub-group also spans whole
# 4096-byte blocks of its parameter file: 2048-element slots ([Note: parameters on NVMe]).
NVME_PARAMS_BUDGET = 3 * 2048 * 18 + 2 * 4096 + 1000
# ... and the parameter files come in through the smallest bounces: two of one 4096-byte block,
# so every gather reads and copies its shard in several chunks.
NVME_PARAM_BOUNCES = 4 * 4096
CPU_SUB = 700   # elements per CPU AdamW sub-group: not a divisor of any shard
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# Low-bit state rows (issue 28): int8 blocks of 32 elements, so that parameters hold several
# blocks and shards cut between them; the oracle is LowbitAdamW on the whole parameters.
STATE_BLOCK = 32
# Low-bit state (or a bf16 master) on NVMe: 3 slots of 4096 elements (an aligned block of int8
# codes; 2048 of a bf16 master's file) of master, moments, scales, gradient and output.
NVME_LOWBIT_BUDGET = 3 * 4096 * 16 + 2 * 4096
# Element-wise torch.optim rows (issue 26): the class and its hyperparameters, the same on
# both sides; the oracle is the class itself on the whole model.
OPTIMS = {
    "sgd_momentum": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1,
                                           weight_decay=WD)),
    "sgd_nesterov": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
    "adam": (torch.optim.Adam, dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.05, lr_decay=0.01, eps=1e-10)),
    # eps as the Adam rows' ([Note: same-order reference] in _harness.py): with torch's 1e-8
    # the centered denominator of a near-zero gradient is eps, and the summation-order
    # round-off of that gradient (4 ranks, AVX2) is amplified by lr / eps past tol(float32).
    "rmsprop": (torch.optim.RMSprop, dict(lr=LR, momentum=0.5, centered=True, eps=EPS)),
}
# The fused ops by name ([Note: fused Lion and SGD]) and their oracles: the reference Lion
# (zkernels.reference.lion_step on each whole parameter) and torch.optim.SGD.
OPTIMS.update({
    "lion": ("lion", dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=WD)),
    "sgd_fused": ("sgd", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=WD)),
    # AdEMAMix by name (the generic fused rule over its definition), against the authors'
    # semantics in one process (zkernels.optimizers.AdEMAMix). beta3 = 0.99 and alpha = 5 make
    # the slow EMA's term ~5% of the update from the first step, and both warm up, so that a
    # wrong beta3 or alpha (the catches rows' faults) moves a step by ~1e-4, far beyond
    # tol(float32).
    "ademamix": ("ademamix", dict(lr=LR, betas=(0.9, 0.95, 0.99), alpha=5.0, beta3_warmup=3,
                                  alpha_warmup=2, eps=EPS, weight_decay=WD)),
})


class RefLion(torch.optim.Optimizer):
    """Lion in one process: ``zkernels.reference.lion_step`` on each whole parameter."""

    def __init__(self, params, lr, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        from zkernels.reference import lion_step
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["exp_avg"] = torch.zeros(p.numel())
                flat = p.detach().reshape(-1).clone()
                lion_step(flat, p.grad.reshape(-1), st["exp_avg"], lr=g["lr"],
                          beta1=g["betas"][0], beta2=g["betas"][1],
                          weight_decay=g["weight_decay"])
                p.copy_(flat.view_as(p))


ORACLES = {"lion": RefLion, "sgd": torch.optim.SGD, "ademamix": AdEMAMix}
# Whole-matrix classes ([Note: whole matrices on owners]): the class on the blocks' 2-D
# matrices (the standard recipe: not the embeddings), the fused AdamW (torch.optim.AdamW in
# the oracle) on the rest.
MATRIX_OPTIMS = {
    "muon_adamw": (torch.optim.Muon, dict(lr=0.02)),
    "adafactor_adamw": (torch.optim.Adafactor, dict(lr=0.01)),
}

# [Note: Muon's tolerance]
# The fp32 Muon rows run Newton-Schulz in fp32 on both sides ([Note: Muon's parity in fp32] in
# test_battery.py) and hold every parameter to tol(float32), as every other fp32 row: with the
# iteration in fp32 only the reduced gradient differs from the oracle's (the ranks' sums in
# another order, ~1e-7 relative), the update starts from the same point each step ([Note: one
# step from the same point]) and Newton-Schulz's amplification of that round-off (its quintic's
# slope at zero is 3.4, five iterations) stays far inside rtol 1e-5. Measured, worst ratio to
# tol(float32) over every step and rank (default MKL kernels / CI's AVX2 settings): 2 ranks
# 0.003 / 0.004 (stages 1 and 2), 0.039 / 0.035 (stage 3 clip=0.05, and the same with
# offload="cpu"), 0.003 / 0.003 (NVMe); 4 ranks 0.063 / 0.031 (stages 1 and 2), 0.059 / 0.036
# (stage 3 clip, offload="cpu" clip), 0.063 / 0.031 (NVMe), 0.13 / 0.09 (hybrid 2 x 2, in
# test_matrix_optim.py). A wrong mapping (every piece reads its neighbour's gradient) moves the
# update by O(lr) and fails (the catches row).
# The bf16 row (bf16 compute, hybrid 2 x 2, Muon + AdamW groups) keeps torch's own bf16
# iteration, the one users run, and holds the bf16 rows' ordinary bounds: compute parameters
# tol(bfloat16), masters rtol 1e-4 / atol 1e-5 (measured: compute parameters equal, masters
# 0.0004 of the bound at atol 1e-6, default and AVX2). Its reduced gradient is the sum of the
# ranks' bf16 gradients (8 significant bits) in fp32 (24), exact in any order unless their
# magnitudes differ by more than 2^14, so the oracle's Newton-Schulz sees the same bits and no
# bf16 rounding flips. Where an fp32 round-off does reach torch's bf16 iteration (an fp32 row
# without the patch: the ranks' fp32 sums in another order, clipping's coefficient) it flips
# bf16 roundings and moves the update by bf16's epsilon of its O(1/sqrt(n)) entries times lr,
# up to a few hundred times tol(float32) (184x measured at 4 ranks with clip=0.05 before the
# fp32 rows ran the iteration in fp32): no battery row compares that, so none needs a looser
# bound (tests/zero/test_matrix_optim.py's 2-rank MLP rows run torch's iteration at
# tol(float32), where no flip happens).


def matrix_groups(model, optim: str) -> List[dict]:
    """``[{matrices, the class}, {the rest, AdamW's hyperparameters}]`` (trainable only)."""
    cls, hp = MATRIX_OPTIMS[optim]
    mats, rest = [], []
    for n, p in model.named_parameters():
        if p.requires_grad:
            (mats if p.ndim == 2 and n.startswith("blocks.") else rest).append(p)
    return [{"params": mats, "optimizer": cls, **hp},
            {"params": rest, "lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WD}]


@dataclasses.dataclass(frozen=True)
class Row:
    """One rung of the ladder with its options (see the module docstring)."""

    stage: int
    dtype: str = "fp32"                        # "fp32" | "bf16" | "fp16"
    offload: Optional[str] = None              # None | "cpu" | "nvme"
    offload_params: bool = False               # stage 3 with offload: parameter shards on host
    nvme_master: bool = True                   # nvme: the master on disk too
    shard_size: Optional[int] = None           # hybrid: ranks per shard group
    form: str = "shard_size"                   # hybrid as shard_size=K, mesh=, process_group=
    reshard: Union[bool, int] = True           # stage 3's reshard_after_forward
    steps: int = 10
    micro: int = 1                             # micro-batches per step (all but the last no_sync)
    clip: Optional[float] = None
    groups: bool = False                       # two param groups (decay / no decay)
    frozen: bool = False                       # _harness.freeze_layers
    sched: bool = False                        # a LambdaLR on both sides
    order: Tuple[int, ...] = (0, 1)            # the blocks' order (a block may run twice)
    ckpt: Optional[str] = None                 # activation checkpointing of each block
    optim: str = "adamw"                       # a key of OPTIMS (torch.optim classes)
    state: Optional[str] = None                # state_dtype: None (fp32), "bf16", "int8"
    master: Optional[str] = None               # master_dtype: None (fp32), "bf16"

    @property
    def id(self) -> str:
        parts = [f"stage{self.stage}", self.dtype]
        if self.offload:
            parts.append(self.offload + ("+params" if self.offload_params else "")
                         + ("" if self.nvme_master else "-host-master"))
        if self.shard_size:
            parts.append(f"K{self.shard_size}" + ("" if self.form == "shard_size"
                                                  else f"-{self.form}"))
        if self.stage == 3 and self.reshard is not True:
            parts.append(f"reshard{self.reshard}")
        defaults = Row(self.stage)
        for f in ("steps", "micro", "clip", "groups", "frozen", "sched", "order", "ckpt",
                  "optim", "state", "master"):
            v = getattr(self, f)
            if v != getattr(defaults, f):
                text = "".join(map(str, v)) if f == "order" else v
                parts.append(f if v is True else f"{f}={text}")
        return "-".join(parts)

    @property
    def param_dtype(self) -> Optional[torch.dtype]:
        return DTYPES[self.dtype]

    def optimizer_kw(self, folder: Optional[str]) -> dict:
        """The ZeroOptimizer keywords of this rung (``folder``: the NVMe files' folder)."""
        kw = dict(stage=self.stage, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                  param_dtype=self.param_dtype, max_grad_norm=self.clip)
        if self.optim in OPTIMS:
            cls, hp = OPTIMS[self.optim]
            kw = dict(stage=self.stage, param_dtype=self.param_dtype,
                      max_grad_norm=self.clip, optimizer=cls, **hp)
        if self.state:
            kw.update(state_dtype=self.state, state_block_size=STATE_BLOCK)
        if self.master:
            kw["master_dtype"] = DTYPES[self.master]
        if self.stage != 3:
            kw["bucket_bytes"] = SMALL_BUCKET
        else:
            kw["reshard_after_forward"] = self.reshard
        if self.offload:
            extra = {} if self.offload == "cpu" else {"nvme_master": self.nvme_master}
            if (self.state or self.master) and self.offload == "nvme":   # (a split sub-group
                extra["nvme_buffer_bytes"] = NVME_LOWBIT_BUDGET   # starts at an aligned block
                #                                                   of codes, or bf16 master)
            kw.update(offload_kw(self.offload, folder, self.offload_params, **extra))
        if self.shard_size:
            kw.update(_hybrid_kw(self.form, self.shard_size))
        if self.dtype == "fp16":
            kw["loss_scale"] = LossScaleConfig(init_scale=2.0 ** 10, growth_interval=2)
        return kw


def offload_kw(kind: str, folder: Optional[str], offload_params: bool = False,
               **config) -> dict:
    """ZeroOptimizer keywords for ``kind`` offload with several sub-groups per unit."""
    if kind == "cpu":
        return dict(offload="cpu", offload_params=offload_params,
                    offload_config=OffloadConfig(sub_group_numel=CPU_SUB, **config))
    budget = dict(nvme_buffer_bytes=NVME_PARAMS_BUDGET,
                  nvme_param_buffer_bytes=NVME_PARAM_BOUNCES) if offload_params \
        else dict(nvme_buffer_bytes=NVME_BUDGET)
    return dict(offload="nvme", offload_dir=folder, offload_params=offload_params,
                offload_config=OffloadConfig(**{**budget, **config}))


def _hybrid_kw(form: str, k: int) -> dict:
    if form == "shard_size":
        return dict(shard_size=k)
    from torch.distributed.device_mesh import init_device_mesh
    ws = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws // k, k), mesh_dim_names=("replicate", "shard"))
    return {"mesh" if form == "mesh" else "process_group": mesh}


@contextlib.contextmanager
def temp_folder():
    path = tempfile.mkdtemp(prefix="zk-battery-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def row_model(row: Row, seed: int = 0):
    """The row's model: the harness GPT with its block order, checkpointing, frozen params."""
    model = variant(make_model(seed), row.order, row.ckpt)
    return freeze_layers(model) if row.frozen else model


def row_optimizer(row: Row, model, folder: Optional[str], **override):
    kw = {**row.optimizer_kw(folder), **override}
    if row.groups:
        kw["param_groups"] = split_groups(model, WD)
    if row.optim in MATRIX_OPTIMS:
        kw["param_groups"] = matrix_groups(model, row.optim)
    return zk.ZeroOptimizer(model, **kw)


def build(row: Row, folder: Optional[str], seed: int = 0, **override):
    """The row's model and optimizer (``override``: optimizer keywords)."""
    model = row_model(row, seed)
    return model, row_optimizer(row, model, folder, **override)


def _params(model, opt):
    with opt.gathered():   # stage 3: parameters have storage only inside
        return [p.detach().clone() for p in model.parameters()]


def _train(model, opt, rank, batch):
    opt.backward(model(*chunk(batch, rank)))
    opt.step()
    opt.zero_grad()


# -- the oracle ---------------------------------------------------------------------------------

class _Both:
    """Two torch optimizers stepped as one (the oracle of a matrix class + AdamW row)."""

    def __init__(self, *opts) -> None:
        self.opts = opts

    def step(self) -> None:
        for o in self.opts:
            o.step()

    def zero_grad(self) -> None:
        for o in self.opts:
            o.zero_grad()


class Reference:
    """Single-process torch.optim.AdamW over ``model``'s initial values, fed the whole
    world's batch as the ranks compute it. ``step(batch)`` returns each rank's loss;
    ``check(model, opt, step)`` compares (see the module docstring)."""

    def __init__(self, row: Row, model, ws: int):
        self.row, self.ws = row, ws
        self.bf16 = row.dtype == "bf16"
        self.ref = clone_model(model)   # fp32 (bf16: the masters)
        if row.master:   # a bf16 master starts from the parameters rounded to nearest even
            with torch.no_grad():
                for q in self.ref.parameters():
                    q.copy_(q.bfloat16().float())
        if self.bf16:
            self.compute = clone_model(model).to(torch.bfloat16)
            self.by_id = {id(p): q for p, q in zip(model.parameters(), self.ref.parameters())}
        params = split_groups(self.ref, WD) if row.groups else _trainable(self.ref)
        if row.state:   # [Note: the low-bit oracle]
            assert row.optim == "adamw" and not (row.groups or row.sched or self.bf16)
            self.opt = LowbitAdamW(params, parse_state_dtype(row.state), lr=LR, betas=BETAS,
                                   eps=EPS, weight_decay=WD, block_size=STATE_BLOCK)
            self.index = {n: i for i, (n, _) in enumerate(
                (n, p) for n, p in self.ref.named_parameters() if p.requires_grad)}
        elif row.optim == "adamw":
            self.opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        elif row.optim in MATRIX_OPTIMS:
            mats, rest = matrix_groups(self.ref, row.optim)
            cls = mats.pop("optimizer")
            self.opt = _Both(cls(**mats), torch.optim.AdamW(**rest))
        else:
            cls, hp = OPTIMS[row.optim]
            self.opt = ORACLES.get(cls, cls)(params, **hp)
        self.clipped = 0

    def step(self, batch):
        if self.bf16:   # bf16 gradients of each rank, times 1/N in fp32, summed in fp32
            micro = self.row.micro
            sums = [torch.zeros_like(q) for q in self.ref.parameters()]
            losses = []
            for r in range(self.ws):
                local = 0.0
                for m in range(micro):
                    loss = self.compute(*chunk(batch, r * micro + m)) / micro
                    loss.backward()
                    local += loss.item()
                losses.append(local)
                for acc, c in zip(sums, self.compute.parameters()):
                    if c.grad is not None:
                        acc += c.grad.float() * (1.0 / self.ws)
                self.compute.zero_grad(set_to_none=True)
            for q, acc in zip(self.ref.parameters(), sums):
                q.grad = acc if q.requires_grad else None
        else:
            losses = reference_grads(self.ref, batch, self.ws, self.row.micro)
        if self.row.clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(_trainable(self.ref), self.row.clip)
            self.clipped += int(norm > self.row.clip)
        self.opt.step()
        for q in self.ref.parameters():
            q.grad = None
        if self.row.master:   # [Note: bf16 master]: the update rounded to nearest even
            with torch.no_grad():
                for q in self.ref.parameters():
                    q.copy_(q.bfloat16().float())
        if self.bf16:
            with torch.no_grad():
                for c, q in zip(self.compute.parameters(), self.ref.parameters()):
                    c.copy_(q)
        return losses

    def compare(self, model, opt, step: int, rank: int, local_loss: float, losses) -> dict:
        """This step's comparisons, each the worst error over tolerance (``_harness.ratio``:
        ``<= 1`` passes): ``loss``, ``params`` (and ``worst_param``, its name), ``master``
        (bf16: this rank's master shards, rtol 1e-4 / atol 1e-5; None in fp32). Then the
        reference continues from our parameters ([Note: one step from the same point])."""
        out = {"step": step, "master": None}
        if not self.bf16:
            out["loss"] = ratio(world_mean(local_loss, self.ws), sum(losses) / self.ws,
                                **tol(torch.float32))
            with opt.gathered():
                out["params"], out["worst_param"] = worst_param(model, self.ref,
                                                                **tol(torch.float32))
                with torch.no_grad():
                    for p, q in zip(model.parameters(), self.ref.parameters()):
                        q.copy_(p)
            if self.row.state:
                out["moments"] = self._moments(opt)
            return out
        out["loss"] = ratio(local_loss, losses[rank], **tol(torch.bfloat16))
        with opt.gathered():
            out["params"], out["worst_param"] = worst_param(model, self.compute,
                                                            **tol(torch.bfloat16))
        sd = opt.state_dict()   # (a torch class's groups: the masters by unit under "zero")
        masters = sd["zero"]["masters"] if "masters" in sd.get("zero", {}) else \
            {u.index: sd["state"][u.index]["master"] for u in opt.units}
        out["master"] = 0.0
        for u in opt.units:
            flat = zk.ops.flatten([self.by_id[id(p)].detach() for p in u.params],
                                  offsets=u.layout.offsets,
                                  out=torch.zeros(u.layout.padded_numel))
            mine, want = masters[u.index], flat[u.shard_slice]
            if self.row.master:   # [Note: a bf16 master against its oracle]
                ulp = ratio(mine, want, rtol=2 ** -6 * 1.01, atol=1e-30)
                flips = float((mine != want).float().mean()) if mine.numel() else 0.0
                out["master"] = max(out["master"], ulp, flips / MASTER_FLIPS)
                continue
            out["master"] = max(out["master"], ratio(mine, want, rtol=1e-4, atol=1e-5))
        # [Note: one step from the same point], for the masters: continue from ours.
        self._continue_from(opt, masters)
        return out

    def _moments(self, opt) -> float:
        """This rank's low-bit moments against the oracle's, piece by piece: int8, the decoded
        values (``m``, ``sqrt(v)``) in steps of the oracle's code at each element (at most one
        code apart passes) and the block scales within ``SCALE_RTOL``; bf16, in ulps (rtol
        2**-7). Then the oracle's moments continue from every rank's."""
        worst, pieces, bs = 0.0, [], STATE_BLOCK
        for u in opt.units:
            low = opt.zero_units[u.index].read_lowbit_state()
            for name, a, s, n in u.param_slices_in_shard():
                st = self.opt.state[self.index[name]]
                mine = {k: low[k][s:s + n].clone() for k in ("exp_avg", "exp_avg_sq")}
                if self.row.state == "bf16":
                    for k in mine:
                        worst = max(worst, ratio(mine[k].float(), st[k][a:a + n].float(),
                                                 rtol=2 ** -7 * 1.01, atol=1e-30))
                else:
                    mine.update({k + "_scales": low[k + "_scales"][s // bs:-(-(s + n) // bs)]
                                 .clone() for k in ("exp_avg", "exp_avg_sq")})
                    for k in ("exp_avg", "exp_avg_sq"):
                        sr = st[k + "_scales"][a // bs:-(-(a + n) // bs)]
                        so = mine[k + "_scales"]
                        ref_v, unit = _coded(k, st[k][a:a + n], sr.repeat_interleave(bs)[:n])
                        got, _ = _coded(k, mine[k], so.repeat_interleave(bs)[:n])
                        err = ((got - ref_v).abs() / unit.clamp_min(1e-30)).nan_to_num(
                            float("inf"))
                        worst = max(worst, float(err.max()) / 1.01 if n else 0.0,
                                    ratio(so, sr, rtol=SCALE_RTOL, atol=1e-30))
                pieces.append((self.index[name], a, n, mine))
        everyone = [pieces]
        if self.ws > 1:
            everyone = [None] * self.ws
            dist.all_gather_object(everyone, pieces)
        for rank_pieces in everyone:
            for i, a, n, mine in rank_pieces:
                st = self.opt.state[i]
                for k, t in mine.items():
                    if k.endswith("_scales"):
                        st[k][a // bs:a // bs + t.numel()] = t
                    else:
                        st[k][a:a + n] = t
        return worst

    def _continue_from(self, opt, shards) -> None:
        """Set the reference's masters (and its bf16 compute copy) to the optimizer's: every
        rank's master shards, put together along each unit's layout."""
        per_rank = [shards]
        if self.ws > 1:
            per_rank = [None] * self.ws
            dist.all_gather_object(per_rank, shards)
        with torch.no_grad():
            for u in opt.units:
                flat = torch.zeros(u.layout.padded_numel)
                for r in range(u.layout.world_size):   # hybrid: the first group's ranks
                    lo, hi = u.layout.shard_range(r)
                    flat[lo:hi] = per_rank[r][u.index]
                for p, off in zip(u.params, u.layout.offsets):
                    q = self.by_id[id(p)]
                    q.copy_(flat[off:off + q.numel()].view_as(q))
            for c, q in zip(self.compute.parameters(), self.ref.parameters()):
                c.copy_(q)


FAULTS = ("wrong_mean", "skip_micro", "one_element")
# A low-bit row's fault: the fused step stores every exp_avg block scale 2% too large (a
# kernel that writes the wrong scale).
SCALE_FAULT = "broken_scale"
# int8 rows: a block's scale (its absmax moment) from the sharded run against the oracle's
# differs only through the rounding of the reduced gradients and the fp32 step (the masters'
# rtol); 2% (SCALE_FAULT) is far outside, while it stays within one step of the 8-bit float
# codes (6-12% of a value), so the codes alone would not see it.
SCALE_RTOL = 1e-4


def _coded(key: str, q: torch.Tensor, scale: torch.Tensor):
    """Decoded int8-format values of codes ``q`` with per-element ``scale`` (``m``, or
    ``sqrt(v)`` for exp_avg_sq) and the step to the next code's value at each element
    ([Note: low-bit moment formats])."""
    mant = EXP_AVG_MANT_BITS if key == "exp_avg" else EXP_AVG_SQ_MANT_BITS
    c = q.to(torch.int32)
    mag = decode_ratio(c.abs(), mant)
    val = mag * scale
    return (torch.where(c < 0, -val, val),
            (decode_ratio(c.abs() + 1, mant) - mag) * scale)


class BrokenScale:
    """An OpSet whose ``adamw_step_lowbit`` writes its first moment's scales 2% too large."""

    def __init__(self, ops) -> None:
        self._ops = ops

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def adamw_step_lowbit(self, *args, **kw):
        out = self._ops.adamw_step_lowbit(*args, **kw)
        if len(args) > 4 and args[4] is not None:
            args[4].mul_(1.02)
        return out
# [Note: a bf16 master against its oracle]
# A bf16 master is compared element for element: each within two bf16 ulps of the oracle's
# (torch's AdamW in fp32, rounded to nearest even; rtol 2**-6: an ulp is up to 2**-7 of a
# value just below a power of two), and at most MASTER_FLIPS of them different at all. Where
# the fp32 update is the same bits as torch's every element is equal; a sum in another order
# (4 ranks' gradients, clipping's norm) or a kernel that rounds one fp32 operation otherwise
# (the C++ path of CPU offload) moves the fp32 update by an fp32 ulp, which flips the rounding
# of about one element in 2**16 by one bf16 ulp. A wrong rounding (MASTER_FAULT: truncation)
# differs on about half of them. With 2 intra-op threads per rank (CI's AVX2 pass,
# ZKERNELS_TEST_THREADS=2) the rows' bf16 gradients and the oracle's are no longer the same bits
# (seen: up to 0.69% of masters one ulp apart, 1 to 4 ranks, with or without offload; with one
# thread under 0.1%; a few by just over one ulp; which bf16 reduction splits differently was
# not isolated), so the bounds are two ulps (rtol 2**-6) and 2% of elements: three times the
# worst share seen, and a twenty-fifth of what truncation flips.
MASTER_FLIPS = 2e-2
# A bf16-master row's fault: the update written back truncated (rounded toward zero) instead of
# to nearest even.
MASTER_FAULT = "truncated_master"


@contextlib.contextmanager
def master_fault(fault: Optional[str]):
    """With ``MASTER_FAULT``, the engine's bf16-master write-back truncates (in this rank's
    process, for the row's run)."""
    if fault != MASTER_FAULT:
        yield
        return
    from zkernels.zero.state import engine
    keep = engine.on_bf16_master

    def truncated(master, out, step):
        wide = master.float()
        step(wide, None)
        master.copy_((wide.view(torch.int32) & -65536).view(torch.float32))
        if out is not None and out.data_ptr() != master.data_ptr():
            out.copy_(master)

    engine.on_bf16_master = truncated
    try:
        yield
    finally:
        engine.on_bf16_master = keep


# A torch.optim row's fault: each piece's gradient shifted by one element inside the shard
# (a wrong shard mapping: element i updated with element i+1's gradient).
MAPPING_FAULT = "wrong_mapping"
# An AdEMAMix row's faults: the ZeRO side runs another beta3 or alpha than the oracle (its
# groups' values changed after construction; the rule reads them at every step).
HPARAM_FAULTS = {
    "wrong_beta3": lambda g: {"betas": (*g["betas"][:2], 0.999)},
    "wrong_alpha": lambda g: {"alpha": g["alpha"] * 1.5},
}


def check_transfer_times(st: dict, wall_s: float) -> None:
    """Each time figure of ``stats()["offload"]`` (the last step's) is real: no more than the
    step's wall time ``wall_s`` measured by the caller (the copies run on one copy thread and
    the host waits inside the step; NVMe's requests on ``io_threads`` I/O threads), so a wrong
    clock or a wrong unit (ms, ns) fails. A time counter never reset is not caught here (the
    copies of this small model take a few % of a step, so even ten steps' sum fits in one
    step's wall time); the byte counters, reset with them, are checked exact per step
    (``_check_offload_stats``, every offload row). (The ``*_hidden_s`` figures are
    ``max(0, busy - exposed)`` by definition: nothing to check beyond their parts.)"""
    for key in [k for k in st if k.endswith("exposed_s")] + [
            "update_s", "device_to_host_s", "host_to_device_s", "param_host_to_device_s"]:
        if key in st:
            assert 0 <= st[key] <= wall_s, (key, st[key], wall_s)
    if "disk_io_s" in st:
        threads = OffloadConfig().io_threads
        assert 0 <= st["disk_io_s"] <= threads * wall_s, (st["disk_io_s"], wall_s)


# -- the table ----------------------------------------------------------------------------------

# World sizes per row: {world size: slow?} ([Note: the quick suite and the full suite]).
# On the device: 2 ranks in the quick suite; 1 rank (the same rows without collectives) and
# 4 ranks in the full suite.
FULL = {1: True, 2: False, 4: True}
OFFLOAD = {2: False, 1: True}             # offload: 1 rank in the full suite
OFFLOAD_FULL = {2: True}   # a variant of a quick row: the full suite only (quick suite's time)
HYBRID = {4: False}    # rows that need 4 ranks (2 groups of 2): run in test_hybrid.py's spawn
TORCH_OPTIM = {2: False, 4: True}
TORCH_OPTIM_FULL = {2: True, 4: True}   # more torch.optim rows: the full suite only

R = Row
# (row, checks, {world size: slow?}).
ROWS = [
    # stages 1-2 on the device
    (R(1), ("parity", "round_trip", "traffic_memory"), FULL),
    (R(2), ("parity", "traffic_memory"), FULL),
    *[(R(s, steps=6, groups=True, frozen=True, sched=True), ("parity",), FULL) for s in (1, 2)],
    *[(R(s, steps=6, clip=0.05), ("parity",), FULL) for s in (1, 2)],
    *[(R(s, steps=6, micro=2), ("parity",), FULL) for s in (1, 2)],
    *[(R(s, steps=2, micro=2), tuple(f"catches_{f}" for f in FAULTS), FULL) for s in (1, 2, 3)],
    (R(1, "bf16"), ("parity", "traffic_memory"), FULL),
    (R(2, "bf16"), ("parity", "round_trip", "traffic_memory"), FULL),
    *[(R(s, "fp16"), ("overflow",), FULL) for s in (1, 2, 3)],
    # stage 3 on the device: reshard_after_forward True / False
    (R(3), ("parity", "traffic_memory"), FULL),
    (R(3, reshard=False), ("parity", "traffic_memory"), FULL),
    (R(3, steps=5, groups=True, frozen=True), ("parity",), FULL),
    (R(3, steps=5, micro=2, clip=0.05), ("parity",), FULL),
    (R(3, steps=5, order=(0, 1, 0)), ("parity",), FULL),
    (R(3, steps=5, ckpt="non_reentrant"), ("parity",), FULL),
    (R(3, steps=5, ckpt="reentrant"), ("parity",), FULL),
    (R(3, steps=5, ckpt="reentrant", reshard=False), ("parity",), FULL),
    # activation checkpointing over frozen layers (block 0 a unit of frozen flats only)
    *[(R(s, steps=4, frozen=True, ckpt=c), ("parity",), FULL) for s in (1, 2, 3)
      for c in ("non_reentrant", "reentrant")],
    (R(3, "bf16"), ("parity", "round_trip", "traffic_memory"), FULL),
    (R(3, "bf16", steps=5, reshard=False), ("parity",), FULL),
    # offload: stage 2 and 3, CPU and NVMe, parameters on the host
    (R(2, offload="cpu"), ("parity",), OFFLOAD),
    (R(2, offload="nvme"), ("parity",), OFFLOAD),
    (R(2, offload="nvme", nvme_master=False, steps=4), ("parity",), OFFLOAD),
    (R(2, offload="cpu", steps=6, micro=2, clip=0.05), ("parity",), OFFLOAD),
    (R(2, offload="nvme", steps=6, micro=2, clip=0.05), ("parity",), OFFLOAD),
    (R(2, "bf16", offload="cpu"), ("parity", "round_trip"), OFFLOAD),
    (R(2, "bf16", offload="nvme"), ("parity", "round_trip"), OFFLOAD),
    (R(3, offload="cpu", steps=6), ("parity",), OFFLOAD),
    (R(3, "bf16", offload="nvme", steps=6, clip=0.05), ("parity",), OFFLOAD),
    (R(3, offload="cpu", steps=4, micro=2), ("parity",), OFFLOAD),
    (R(3, offload="cpu", offload_params=True, steps=6, micro=2, clip=0.05),
     ("parity", "same_bits"), OFFLOAD),
    (R(3, "bf16", offload="cpu", offload_params=True, steps=6, micro=2, clip=0.05),
     ("parity", "same_bits"), OFFLOAD),
    (R(3, offload="nvme", offload_params=True, steps=6, clip=0.05), ("parity", "same_bits"),
     OFFLOAD),
    (R(3, "bf16", offload="nvme", offload_params=True, steps=6, micro=2),
     ("parity", "same_bits"), OFFLOAD),
    # parameter files beside a host master (fp32: the output staged aligned in the slot)
    (R(3, offload="nvme", offload_params=True, nvme_master=False, steps=4),
     ("parity", "same_bits"), OFFLOAD_FULL),
    # hybrid sharding: 2 groups of 2 ranks (shard_size=1: 4 groups of 1)
    (R(1, shard_size=2, steps=4), ("parity",), HYBRID),
    (R(2, shard_size=2, steps=4, clip=0.05), ("parity",), HYBRID),
    (R(3, shard_size=2, steps=4), ("parity",), HYBRID),
    (R(3, shard_size=2, form="mesh", steps=4), ("parity",), HYBRID),
    (R(1, shard_size=2, form="process_group", steps=3), ("parity",), HYBRID),
    (R(2, shard_size=1, steps=3), ("parity",), HYBRID),
    (R(3, shard_size=2, steps=3, micro=2), ("parity",), HYBRID),
    (R(2, offload="cpu", shard_size=2, steps=3), ("parity",), HYBRID),
    # a bf16 master ([Note: bf16 master]): bf16 gathers, no master apart from the bf16 shard
    *[(R(s, "bf16", shard_size=2, steps=3, master="bf16"), ("parity",), HYBRID)
      for s in (2, 3)],
    # reshard_after_forward=R: the backward gathers within groups of 2 of the 4 ranks
    (R(3, reshard=2, steps=3), ("parity",), HYBRID),
    # element-wise torch.optim classes on the shards (issue 26), against the class itself
    (R(2, steps=4, optim="sgd_momentum"), ("parity",), TORCH_OPTIM),
    (R(1, steps=4, optim="sgd_nesterov"), ("parity",), TORCH_OPTIM),
    (R(3, steps=4, optim="adam"), ("parity",), TORCH_OPTIM),
    (R(2, steps=4, optim="adagrad", clip=0.05), ("parity",), TORCH_OPTIM),
    (R(3, steps=4, optim="rmsprop", micro=2), ("parity",), TORCH_OPTIM),
    (R(2, offload="cpu", steps=4, optim="sgd_momentum"), ("parity",), OFFLOAD_FULL),
    (R(3, shard_size=2, steps=3, optim="adam"), ("parity",), HYBRID),
    (R(2, steps=2, optim="sgd_momentum"), (f"catches_{MAPPING_FAULT}",), TORCH_OPTIM),
    # whole-matrix classes on owners ([Note: whole matrices on owners]) beside the fused AdamW
    (R(2, steps=4, optim="muon_adamw"), ("parity",), TORCH_OPTIM),
    (R(3, steps=3, optim="muon_adamw", clip=0.05), ("parity",), TORCH_OPTIM_FULL),
    # (Newton-Schulz in fp32 for the comparison: [Note: Muon's parity in fp32])
    (R(2, offload="cpu", steps=3, optim="muon_adamw", clip=0.05), ("parity",),
     TORCH_OPTIM_FULL),
    (R(1, steps=3, optim="muon_adamw"), ("parity",), TORCH_OPTIM_FULL),
    # bf16 compute, hybrid 2 x 2: torch's own bf16 Newton-Schulz ([Note: Muon's tolerance]);
    # the owners' exchanges within each group exact against the estimate (_traffic.py)
    (R(2, "bf16", shard_size=2, steps=3, optim="muon_adamw"), ("parity",), HYBRID),
    (R(2, steps=3, optim="adafactor_adamw"), ("parity",), TORCH_OPTIM_FULL),
    (R(2, steps=2, optim="muon_adamw"), (f"catches_{MAPPING_FAULT}",), TORCH_OPTIM),
    # the fused Lion and SGD ops by name, against the reference Lion and torch.optim.SGD
    (R(2, steps=4, optim="lion"), ("parity",), TORCH_OPTIM),
    (R(3, offload="cpu", steps=3, optim="lion", clip=0.05), ("parity",),
     TORCH_OPTIM_FULL),
    (R(1, steps=4, optim="sgd_fused"), ("parity",), TORCH_OPTIM_FULL),
    (R(2, steps=2, optim="lion"), (f"catches_{MAPPING_FAULT}",), TORCH_OPTIM_FULL),
    # AdEMAMix (the generic fused rule): clipping, accumulation, offload, hybrid, bf16 compute
    (R(2, steps=4, optim="ademamix"), ("parity",), TORCH_OPTIM),
    (R(1, steps=4, optim="ademamix", micro=2), ("parity",), TORCH_OPTIM_FULL),
    (R(3, offload="cpu", steps=3, optim="ademamix", clip=0.05), ("parity",), TORCH_OPTIM),
    (R(3, offload="nvme", steps=3, optim="ademamix", micro=2), ("parity",), TORCH_OPTIM_FULL),
    (R(3, shard_size=2, steps=3, optim="ademamix", clip=0.05), ("parity",), HYBRID),
    (R(2, "bf16", shard_size=2, steps=3, optim="ademamix"), ("parity",), HYBRID),
    (R(3, "bf16", steps=3, optim="ademamix", micro=2), ("parity",), TORCH_OPTIM_FULL),
    (R(2, steps=2, optim="ademamix"), tuple(f"catches_{f}" for f in HPARAM_FAULTS), TORCH_OPTIM),
    # NVMe offload with a rule's state in files ([Note: rule state on NVMe]; the master in
    # host RAM): a torch class and the fused Lion
    (R(2, offload="nvme", nvme_master=False, steps=4, optim="adagrad", clip=0.05),
     ("parity",), TORCH_OPTIM_FULL),
    (R(3, offload="nvme", nvme_master=False, steps=3, optim="lion", micro=2), ("parity",),
     TORCH_OPTIM_FULL),
    # low-bit optimizer state (issue 28): bf16 and blockwise int8 moments, against
    # LowbitAdamW on the whole parameters ([Note: the low-bit oracle])
    (R(1, steps=4, state="int8"), ("parity",), FULL),
    (R(2, steps=4, state="bf16"), ("parity",), FULL),
    (R(2, steps=4, micro=2, clip=0.05, state="int8"), ("parity",), OFFLOAD_FULL),
    (R(3, steps=4, state="int8"), ("parity",), FULL),
    (R(3, steps=4, state="bf16"), ("parity",), OFFLOAD_FULL),
    (R(2, offload="cpu", steps=4, state="int8"), ("parity",), OFFLOAD),
    # (bf16 compute: the offloaded step and the device's are the same bits, as the bf16
    # offload rows' round trips)
    (R(2, "bf16", offload="cpu", steps=4, state="int8"), ("round_trip",), OFFLOAD),
    (R(2, "fp16", state="int8"), ("overflow",), OFFLOAD_FULL),
    (R(3, offload="cpu", offload_params=True, steps=3, state="bf16"), ("parity",),
     OFFLOAD_FULL),
    (R(2, shard_size=2, steps=3, state="int8"), ("parity",), HYBRID),
    (R(3, shard_size=2, steps=3, state="bf16"), ("parity",), HYBRID),
    (R(2, steps=2, state="int8"), (f"catches_{SCALE_FAULT}",), TORCH_OPTIM),
    # ... with NVMe offload: bf16 moments, or int8 codes and scales, in the files and slots
    # ([Note: low-bit state on NVMe])
    (R(2, offload="nvme", steps=4, clip=0.05, state="int8"), ("parity",), OFFLOAD),
    (R(3, offload="nvme", steps=3, state="bf16"), ("parity",), OFFLOAD_FULL),
    (R(3, offload="nvme", offload_params=True, steps=3, state="int8"), ("parity",),
     OFFLOAD_FULL),
    # a bf16 master ([Note: bf16 master]: the fp32 update rounded to nearest even; the oracle
    # rounds torch's AdamW the same way): the bf16 parameter shard is the master
    (R(2, "bf16", steps=4, master="bf16"), ("parity",), FULL),
    (R(3, "bf16", steps=4, clip=0.05, master="bf16"), ("parity",), OFFLOAD_FULL),
    (R(2, "bf16", offload="cpu", steps=4, master="bf16"), ("parity",), OFFLOAD),
    (R(2, "bf16", offload="nvme", steps=4, master="bf16"), ("parity",), OFFLOAD),
    (R(3, "bf16", offload="cpu", offload_params=True, steps=3, master="bf16"), ("parity",),
     OFFLOAD_FULL),
    (R(2, "bf16", steps=2, master="bf16"), (f"catches_{MASTER_FAULT}",), TORCH_OPTIM),
    # ... and the master in files too (nvme_master, the default)
    (R(2, offload="nvme", steps=4, optim="sgd_momentum", clip=0.05), ("parity",),
     TORCH_OPTIM_FULL),
    (R(3, offload="nvme", steps=3, optim="sgd_fused", micro=2), ("parity",), TORCH_OPTIM_FULL),
    # Muon's owners with their whole masters and state in files ([Note: whole matrices on
    # NVMe]), the fused AdamW's files beside them
    (R(2, offload="nvme", steps=3, optim="muon_adamw"), ("parity",),
     TORCH_OPTIM_FULL),
]


TABLE: Dict[str, Tuple[Row, str]] = {}      # "<row id>-<check>" -> (row, check)
WORLD_SIZES: Dict[str, Dict[int, bool]] = {}
for _row, _names, _sizes in ROWS:
    for _name in _names:
        _key = f"{_row.id}-{_name}"
        assert _key not in TABLE, f"duplicate row {_key}"
        TABLE[_key] = (_row, _name)
        WORLD_SIZES[_key] = _sizes
