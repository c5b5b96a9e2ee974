"""The ZeRO battery: one table of rows (a rung of the ladder and its options) and the checks
every row runs against one oracle, run on every rank (module-level so spawned ranks import it).

A row is a :class:`Row`: the rung (stage 1/2/3, offload none/"cpu"/"nvme", ``offload_params``,
hybrid ``shard_size``, stage 3's ``reshard_after_forward`` True/False/R), the dtype
(fp32/bf16/fp16) and the training options (micro-batches, clipping, groups, frozen
parameters as ``_harness.freeze_layers`` sets them, a scheduler, another block order,
activation checkpointing). ``ROWS`` lists ``(row, checks, world sizes)``; ``CHECKS`` is every
``"<row id>-<check>"`` one spawn runs. A new rung or option is tested by adding a field to
:class:`Row` (its optimizer keyword in :meth:`Row.optimizer_kw`) and a line to ``ROWS``.

The checks:

- ``parity``: every step's loss and parameters against the one oracle, single-process
  ``torch.optim.AdamW`` on the same data: in fp32 the same-order reference continued from our
  parameters after each step ([Note: same-order reference], [Note: one step from the same
  point] in ``_harness.py``), within tol(float32); in bf16 the same recipe in one process
  (bf16 gradients, summed in fp32, AdamW on fp32 masters rounded to bf16) continued from our
  masters after each step, the compute parameters within tol(bfloat16) and this rank's master
  shards within rtol 1e-4 / atol 1e-5. Continuing from the same point is what lets bf16 rows
  run the optimizer's own backend: a reference continued from its own masters drifts from any
  AdamW whose fp32 round-off differs from torch's (a flipped bf16 rounding of a compute
  parameter moves the next gradients, and Adam amplifies that near eps into a few % of lr
  within a few steps), so those checks had to run the reference ops.
  Beside it, what the rung promises on the way: overlap of the reduction with backward, no
  communication under ``no_sync``, full gradients freed (stages 2-3), nothing left gathered
  (stage 3), the reduce buffers' bound, frozen parameters unchanged, clipping active, the
  offload transfers (bytes, and copy/IO times bounded by the step's measured wall time).
- ``catches_<fault>``: ``parity`` with a broken ZeRO side must fail (the oracle can fail).
- ``same_bits``: ``offload_params`` only moves the parameter shards to host RAM, so the row
  is bit-identical to the same row without it (data movement is compared bit for bit).
- ``round_trip``: ``state_dict()`` after 3 steps (the row's ``steps`` aside) loads into a fresh
  optimizer over another initialization (at the other placement for an offload row, and
  back) and the run continues bit for bit; a state of another world size is refused by name.
- ``traffic_memory`` (a rung on the device): bytes sent per step and held per rank against
  the ring formula and docs/design.md#the-ladder (``_traffic.py``); hybrid rows check theirs in
  ``parity`` (``_traffic.hybrid_traffic_memory``).
- ``overflow`` (fp16): an inf gradient on one rank makes every rank skip the step bit for bit,
  the scale halves, clean steps grow it again.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import shutil
import tempfile
import time
from functools import partial
from typing import Dict, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

import zkernels as zk
from tests.conftest import tol
from tests.zero._harness import (EPS, LR, MICRO_BATCH, assert_params_close, assert_step_close,
                                 chunk, clone_model, freeze_layers, make_batches, make_model,
                                 reference_grads, run_checks, split_groups, variant, world_mean)
from tests.zero._traffic import hybrid_traffic_memory, traffic_memory
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
        for f in ("steps", "micro", "clip", "groups", "frozen", "sched", "order", "ckpt"):
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
        if self.stage != 3:
            kw["bucket_bytes"] = SMALL_BUCKET
        else:
            kw["reshard_after_forward"] = self.reshard
        if self.offload:
            kw.update(offload_kw(self.offload, folder, self.offload_params, **(
                {} if self.offload == "cpu" else {"nvme_master": self.nvme_master})))
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
                offload_config=OffloadConfig(**budget, **config))


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

class Reference:
    """Single-process torch.optim.AdamW over ``model``'s initial values, fed the whole
    world's batch as the ranks compute it. ``step(batch)`` returns each rank's loss;
    ``check(model, opt, step)`` compares (see the module docstring)."""

    def __init__(self, row: Row, model, ws: int):
        self.row, self.ws = row, ws
        self.bf16 = row.dtype == "bf16"
        self.ref = clone_model(model)   # fp32 (bf16: the masters)
        if self.bf16:
            self.compute = clone_model(model).to(torch.bfloat16)
            self.by_id = {id(p): q for p, q in zip(model.parameters(), self.ref.parameters())}
        params = split_groups(self.ref, WD) if row.groups else _trainable(self.ref)
        self.opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
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
        self.opt.zero_grad()
        if self.bf16:
            with torch.no_grad():
                for c, q in zip(self.compute.parameters(), self.ref.parameters()):
                    c.copy_(q)
        return losses

    def check(self, model, opt, step: int, rank: int, local_loss: float, losses) -> None:
        if not self.bf16:
            torch.testing.assert_close(world_mean(local_loss, self.ws), sum(losses) / self.ws,
                                       **tol(torch.float32),
                                       msg=lambda m: f"step {step} loss: {m}")
            with opt.gathered():
                assert_step_close(model, self.ref, step, **tol(torch.float32))
            return
        torch.testing.assert_close(local_loss, losses[rank], **tol(torch.bfloat16),
                                   msg=lambda m: f"step {step} loss: {m}")
        with opt.gathered():
            assert_params_close(model, self.compute, step, **tol(torch.bfloat16))
        state = opt.state_dict()["state"]
        for u in opt.units:
            flat = zk.ops.flatten([self.by_id[id(p)].detach() for p in u.params],
                                  offsets=u.layout.offsets,
                                  out=torch.zeros(u.layout.padded_numel))
            torch.testing.assert_close(state[u.index]["master"], flat[u.shard_slice],
                                       rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"step {step} master: {m}")
        # [Note: one step from the same point], for the masters: continue from ours.
        self._continue_from(opt, {u.index: state[u.index]["master"] for u in opt.units})

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


# -- parity ---------------------------------------------------------------------------------

FAULTS = ("wrong_mean", "skip_micro", "one_element")


def parity(rank, ws, *, row: Row, fault: Optional[str] = None):
    """The row against the oracle every step, and what the rung promises on the way (see the
    module docstring). ``fault`` breaks the ZeRO side on purpose (``catches``):
    "wrong_mean" averages over N + 1 instead of N, "skip_micro" drops the last micro-batch of
    the last rank from step 1 on, "one_element" gives one gradient element its neighbour's
    value on every rank."""
    assert row.dtype in ("fp32", "bf16"), "fp16 rows run the overflow check"
    with temp_folder() as folder:
        model = row_model(row)
        ref = Reference(row, model, ws)   # before stage 3 shards the parameters
        frozen = {n: p.detach().clone() for n, p in model.named_parameters()
                  if not p.requires_grad}
        opt = row_optimizer(row, model, folder)
        try:
            _parity(rank, ws, row, model, opt, ref, frozen, fault)
        finally:
            opt.close()


def _parity(rank, ws, row, model, opt, ref, frozen_before, fault):
    stage, micro = row.stage, row.micro
    assert model.head.weight is model.wte.weight, "tied weights must stay one parameter"
    if fault == "one_element":
        def neighbour(g):  # an off-by-one in one offset: element [5, 7] gets [5, 8]'s value
            g = g.clone()
            g[5, 7] = g[5, 8]
            return g

        model.blocks[0].fc.weight.register_hook(neighbour)
    grad_factor = ws / (ws + 1) if fault == "wrong_mean" else 1.0
    buffers_before = opt.stats()["memory_bytes"]["buffers"]
    # Bytes the reduce-scatters had sent when backward reached the embeddings' output, i.e.
    # while the embedding gradients were still to be computed (the reduction overlaps).
    mid_backward = []
    meter = opt.meter   # not opt: a hook left on the last graph must not hold the groups

    def watch(module, inputs, out):
        out.register_hook(lambda g: mid_backward.append(meter.current_step()["reduce_scatter"]))

    hook = model.wte.register_forward_hook(watch)
    scheds = []
    if row.sched:
        lam = lambda s: 1.0 / (1.0 + s)  # noqa: E731
        scheds = [LambdaLR(opt, lam), LambdaLR(ref.opt, lam)]
    step_ends = [time.perf_counter()]
    for step, batch in enumerate(make_batches(row.steps, ws * micro * MICRO_BATCH)):
        local = 0.0
        for m in range(micro):
            last = m == micro - 1
            with (contextlib.nullcontext() if last else opt.no_sync()):
                loss = model(*chunk(batch, rank * micro + m)) / micro
                if not (fault == "skip_micro" and last and rank == ws - 1 and step >= 1):
                    (loss * grad_factor).backward()
            local += loss.item()
            if not last:
                # Stage 3 gathers its units in forward and backward even inside no_sync; no
                # stage reduces gradients there.
                sent = opt.meter.current_step()
                assert (sent["reduce_scatter"] if stage == 3 else sent["total"]) == 0, \
                    "no_sync must not communicate (stage 3: must not reduce)"
                assert opt.meter.current_step_scopes()["across_groups"] == 0
        if stage == 3:   # once per step: stats() measures every storage
            assert opt.stats()["gather"]["gathered_bytes"] == 0, "backward must free every unit"
        if fault != "skip_micro":  # else the last rank ran no synced backward: nothing overlapped
            if stage >= 2:
                assert all(p.grad is None for p in model.parameters()), \
                    "stages 2-3 free full grads"
            else:
                assert all(p.grad is not None for p in _trainable(model)), "stage 1 keeps them"
            sent = opt.meter.current_step()["reduce_scatter"]
            assert ws == 1 or row.shard_size == 1 or 0 < mid_backward[-1] < sent, \
                f"stage {stage} reduces during backward"
        opt.step()
        step_ends.append(time.perf_counter())
        opt.zero_grad()
        losses = ref.step(batch)
        for s in scheds:
            s.step()
        if row.sched:
            assert opt.param_groups[0]["lr"] == ref.opt.param_groups[0]["lr"] != LR or step == 0
        ref.check(model, opt, step, rank, local, losses)
    hook.remove()
    st = opt.stats()
    if stage == 3:  # reduce buffers only while gradients are in flight, never more than the rule
        rule = opt.policy.num_reduce_buffers(len(opt.units), len(opt.param_groups))
        limit = rule * max(u.layout.padded_numel for u in opt.units) * 4
        peak = st["step_peak_bytes"]["buffers"]
        held = st["memory_bytes_by_location"]["device"]["buffers"]   # offload: host staging
        assert held == 0 and 0 < peak <= limit, (held, peak, limit)
        g = st["gather"]
        assert g["gathered_bytes"] == 0, g
        if row.reshard is True:   # resharded after forward: the prefetch bound holds (the
            # recompute of checkpointed blocks gathers again, frozen flats included)
            assert 0 < g["peak_gathered_bytes"] <= g["limit_bytes"], g
    else:
        assert st["memory_bytes"]["buffers"] == buffers_before, "the reduce pool must not grow"
    if row.clip is not None:
        assert ref.clipped == row.steps, f"clipping was active on {ref.clipped}/{row.steps} steps"
    for n, p in model.named_parameters():
        if n in frozen_before:
            assert p.grad is None, n
    with opt.gathered():
        for n, p in model.named_parameters():
            if n in frozen_before:
                assert torch.equal(p, frozen_before[n]), f"frozen {n} changed"
    assert st["step"] == row.steps
    if row.offload:
        _check_offload_stats(opt, row, st["offload"], step_ends[-1] - step_ends[-2])
    if row.shard_size:
        # The gathered() above is counted in the next step: measure a step after a clean one.
        for batch in make_batches(2, ws * MICRO_BATCH, seed=3):
            _train(model, opt, rank, batch)
        hybrid_traffic_memory(opt, ws, stage, row.offload, K=row.shard_size)


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


def _check_offload_stats(opt, row: Row, st: dict, wall_s: float) -> None:
    """The last step's transfers: bytes both ways (disk read = written with NVMe), time spent
    where bytes moved, every time figure within the step's wall time."""
    assert st["kind"] == row.offload and st["device_to_host_bytes"] > 0, st
    check_transfer_times(st, wall_s)
    assert st["device_to_host_s"] > 0, st
    shard_bytes = sum(u.layout.shard_numel * u.compute_shard.element_size() for u in opt.units)
    if row.offload_params:
        # The update writes the host shards (or files): nothing goes up in step(); every
        # gather brought its shard in instead: per micro-step forward and backward (once with
        # reshard_after_forward=False), plus the previous step's opt.gathered().
        gathers = (2 if row.reshard is True else 1) * row.micro + 1
        assert st["host_to_device_bytes"] == 0, st
        assert st["param_host_to_device_s"] > 0, st
        assert st["param_host_to_device_bytes"] == gathers * shard_bytes, (st, shard_bytes)
        if row.offload == "nvme":   # each gather read its file, the update wrote it once
            file_bytes = sum(u.gather.file.data_bytes for u in opt.units)
            assert st["param_disk_read_bytes"] == gathers * file_bytes, (st, file_bytes)
            assert st["param_disk_write_bytes"] == file_bytes, (st, file_bytes)
    else:   # the updated compute shards come up once
        assert st["host_to_device_bytes"] == shard_bytes, (st, shard_bytes)
    # the fp32 gradient shards go down once per step (exact: the counters are per step)
    grad_bytes = sum(u.layout.shard_numel * 4 for u in opt.units)
    assert st["device_to_host_bytes"] == grad_bytes, (st, grad_bytes)
    if row.offload == "nvme":
        assert st["disk_read_bytes"] == st["disk_write_bytes"] > 0, st
        assert st["disk_io_s"] > 0, st


def catches(rank, ws, *, row: Row, fault: str):
    """``parity`` must fail on a broken ZeRO side (every rank compares the same gathered
    parameters with the same reference, so every rank fails at the same step and none is
    left waiting in a collective)."""
    try:
        parity(rank, ws, row=row, fault=fault)
    except RuntimeError as exc:
        # Stage 3: a rank that skips its backward takes another path than its peers, which
        # the path check stops before any mismatched collective ([Note: divergent paths]).
        if not (row.stage == 3 and fault == "skip_micro" and ws > 1
                and "ranks disagree on what comes next" in str(exc)):
            raise
        return
    except AssertionError as exc:
        assert "step" in str(exc), f"failed for another reason than the comparison: {exc}"
        return
    raise AssertionError(f"the parity check did not notice fault {fault!r}")


def same_bits(rank, ws, *, row: Row, steps: int = 4):
    """``offload_params`` changes where the parameter shards live, not a bit of the run:
    every loss, parameter and state element equals the same row without it."""
    assert row.offload_params
    with temp_folder() as folder:
        runs = [build(row, folder, offload_params=op) for op in (False, True)]
        for batch in make_batches(steps, ws * row.micro * MICRO_BATCH):
            losses = []
            for model, opt in runs:
                total = 0.0
                for k in range(row.micro):
                    ctx = opt.no_sync() if k < row.micro - 1 else contextlib.nullcontext()
                    with ctx:
                        loss = model(*chunk(batch, rank * row.micro + k)) / row.micro
                        opt.backward(loss)
                    total += loss.item()
                opt.step()
                opt.zero_grad()
                losses.append(total)
            assert losses[0] == losses[1], losses
            a, b = (_params(m, o) for m, o in runs)
            assert all(torch.equal(x, y) for x, y in zip(a, b)), "offload_params changed a bit"
        sd0, sd1 = (o.state_dict()["state"] for _, o in runs)
        for i, s in sd0.items():
            for k in ("master", "exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(torch.as_tensor(s[k]), torch.as_tensor(sd1[i][k])), (i, k)
        for _, o in runs:
            o.close()


# -- state round trip -------------------------------------------------------------------------

def round_trip(rank, ws, *, row: Row):
    """Save after 3 steps, load into a fresh optimizer over a differently initialized model
    (an offload row: the same rung on the device, and the other way round), continue: bit
    for bit the uninterrupted run; a state of another world size is refused."""
    batches = make_batches(6, ws * MICRO_BATCH)
    device = dataclasses.replace(row, offload=None, offload_params=False)
    pairs = [(row, row)] if not row.offload else [(row, device), (device, row)]
    with temp_folder() as folder:
        for src, dst in pairs:
            m1, o1 = build(src, folder)
            for b in batches[:3]:
                _train(m1, o1, rank, b)
            buf = io.BytesIO()
            torch.save(o1.state_dict(), buf)
            trace = []
            for b in batches[3:]:
                _train(m1, o1, rank, b)
                trace.append(_params(m1, o1))
            m2, o2 = build(dst, folder, seed=7)
            buf.seek(0)
            sd = torch.load(buf, weights_only=False)
            o2.load_state_dict(sd)
            for b, expected in zip(batches[3:], trace):
                _train(m2, o2, rank, b)
                assert all(torch.equal(a, p) for a, p in zip(expected, _params(m2, o2)))
            assert o2.stats()["step"] == 6
            sd["zero"]["world_size"] = ws + 1
            try:
                o2.load_state_dict(sd)
            except ValueError as exc:
                assert "world size" in str(exc), exc
            else:
                raise AssertionError("loading a state of another world size must fail")
            o1.close()
            o2.close()


# -- fp16 ---------------------------------------------------------------------------------------

def overflow(rank, ws, *, row: Row):
    """fp16: an inf gradient on the last rank only (after the reduce-scatter only the owner of
    that element sees it, every other rank relies on the all-reduce): every rank skips the
    step (parameters, masters and step counts bit-identical), the scale halves, stats counts
    the skip; clean steps grow the scale again."""
    with temp_folder() as folder:
        model, opt = build(row, folder)
        scales = [2.0 ** 10, 2.0 ** 9, 2.0 ** 9, 2.0 ** 10, 2.0 ** 10]
        before = _params(model, opt)
        masters = [s["master"] for s in opt.state_dict()["state"].values()]
        for step, batch in enumerate(make_batches(len(scales), ws * MICRO_BATCH)):
            loss = model(*chunk(batch, rank))
            if step == 1:  # gathered() is collective: every rank enters, the last adds inf
                with opt.gathered(model.ln_f):
                    loss = loss + model.ln_f.bias[0] * (float("inf") if rank == ws - 1 else 0.0)
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            after = _params(model, opt)
            same = all(torch.equal(a, p) for a, p in zip(before, after))
            state = opt.state_dict()["state"].values()
            same_master = all(torch.equal(a, s["master"]) for a, s in zip(masters, state))
            before, masters = after, [s["master"] for s in state]
            st = opt.stats()
            assert st["loss_scale"] == scales[step], (step, st["loss_scale"])
            assert st["overflow_skips"] == (0 if step == 0 else 1) and st["step"] == step + 1
            assert (same and same_master) == (step == 1), (step, same, same_master)
            if step == 1:
                assert all(s["step"] == 1 for s in state)
            else:
                assert all(bool(torch.isfinite(p).all()) for p in after)
        opt.close()


# -- the table ----------------------------------------------------------------------------------

# World sizes per row: {world size: slow?} ([Note: the quick suite and the full suite]).
# On the device: 2 ranks in the quick suite; 1 rank (the same rows without collectives) and
# 4 ranks in the full suite.
FULL = {1: True, 2: False, 4: True}
OFFLOAD = {2: False, 1: True}             # offload: 1 rank in the full suite
OFFLOAD_FULL = {2: True}   # a variant of a quick row: the full suite only (quick suite's time)
HYBRID = {4: False}    # rows that need 4 ranks (2 groups of 2): run in test_hybrid.py's spawn

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
    # reshard_after_forward=R: the backward gathers within groups of 2 of the 4 ranks
    (R(3, reshard=2, steps=3), ("parity",), HYBRID),
]


def _check(name: str, row: Row):
    if name.startswith("catches_"):
        return partial(catches, row=row, fault=name[len("catches_"):])
    return partial({"parity": parity, "same_bits": same_bits, "round_trip": round_trip,
                    "overflow": overflow, "traffic_memory": traffic_memory}[name], row=row)


CHECKS: Dict[str, partial] = {}
WORLD_SIZES: Dict[str, Dict[int, bool]] = {}
for _row, _names, _sizes in ROWS:
    for _name in _names:
        _key = f"{_row.id}-{_name}"
        assert _key not in CHECKS, f"duplicate row {_key}"
        CHECKS[_key] = _check(_name, _row)
        WORLD_SIZES[_key] = _sizes


def names_at(world_size: int, slow: bool, hybrid: bool = False):
    """The checks whose rows run at ``world_size`` in the quick (``slow`` False) or the full
    suite only; hybrid rows (run in test_hybrid.py's spawn) or the others."""
    return [k for k, sizes in WORLD_SIZES.items()
            if sizes.get(world_size) is slow and (sizes is HYBRID) == hybrid]


def battery(rank, world_size, names):
    """Run the checks ``names`` on this rank."""
    torch.manual_seed(0)
    return run_checks({k: CHECKS[k] for k in names}, rank, world_size)
