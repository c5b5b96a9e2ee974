"""Rank bodies of ``test_grad_semantics.py``: a parameter without a gradient this step
(unused on some steps, never used, ``requires_grad`` toggled, used on one rank only) is
skipped as ``torch.optim.AdamW`` skips it, or gets DDP's zero-gradient update with
``unused_grads="zero"`` ([Note: unused parameters] in zkernels/zero/gradients/presence.py).

The model is three residual blocks of one class (stage 3: one unit each) and a head, with
awkward sizes (6 wide, 42 elements a block: the shards split parameters). Each step every rank
runs the blocks its pattern names on its own batch; the single-process reference runs every
rank's batch, loss divided by N, into one ``.grad`` per parameter (None where no rank used it:
what torch skips), then steps ``torch.optim.AdamW``. The comparison is [Note: one step from the
same point] (``_harness.py``): after each step every parameter within tol(float32) of the
reference, then the reference continues from ours. Each parameter's AdamW step count is
compared exactly with torch's ``state[p]["step"]``.
"""
from __future__ import annotations

import contextlib
import copy
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zkernels as zk
from tests.conftest import tol
from tests.zero._harness import EPS, ratio

LR, WD, STEPS, WIDTH = 1e-2, 0.1, 4, 6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x, use):
        for i in use:
            x = self.blocks[i](x)
        return self.head(x)


# pattern -> (step, rank) -> (blocks run, block whose requires_grad is off this step or None)
def _plan(pattern: str, step: int, rank: int):
    if pattern == "unused_some_steps":
        return ((0, 1, 2) if step % 2 == 0 else (0, 1)), None
    if pattern == "never_used":
        return (0, 1), None
    if pattern == "requires_grad_toggled":
        return (0, 1, 2), (1 if step in (1, 2) else None)
    if pattern == "used_on_one_rank":   # block 2 on rank 0 only at odd steps (stages 1-2)
        return ((0, 1, 2) if step % 2 == 0 or rank == 0 else (0, 1)), None
    raise ValueError(pattern)


def _batches(world_size: int, step: int):
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(4, WIDTH, generator=g), torch.randn(4, 3, generator=g))
            for _ in range(world_size)]


def _reference_step(ref, ropt, batches, plans, mode: str) -> None:
    for (x, y), (use, _) in zip(batches, plans):
        (F.mse_loss(ref(x, use), y) / len(batches)).backward()
    if mode == "zero":   # DDP with find_unused_parameters: zeros where no rank had one
        for p in ref.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    ropt.step()
    ropt.zero_grad(set_to_none=True)


def parity(rank: int, world_size: int, *, stage, pattern: str, mode: str = "skip",
           ref_mode=None, offload=None, sgd: bool = False) -> dict:
    """Steps of ``pattern`` against torch.optim.AdamW (``sgd``: torch.optim.SGD with
    momentum, run by ZeroOptimizer as a torch class on its pieces); the worst ratio (<= 1
    passes) and whether every parameter's step count matched torch's. ``ref_mode``: the
    reference's semantics when it differs from ours (a catches_ row)."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    if sgd:
        opt = zk.ZeroOptimizer(model, stage=stage, optimizer=torch.optim.SGD, lr=LR,
                               momentum=0.9, weight_decay=WD, unused_grads=mode,
                               offload=offload)
        ropt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9, weight_decay=WD)
    else:
        opt = zk.ZeroOptimizer(model, stage=stage, lr=LR, eps=EPS, weight_decay=WD,
                               unused_grads=mode, offload=offload)
        ropt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS, weight_decay=WD)
    refp = dict(ref.named_parameters())
    worst, steps_ok = 0.0, True
    for step in range(STEPS):
        plans = [_plan(pattern, step, r) for r in range(world_size)]
        off = plans[rank][1]
        for m in (model, ref):
            for i, b in enumerate(m.blocks):
                b.requires_grad_(i != off)
        batches = _batches(world_size, step)
        x, y = batches[rank]
        F.mse_loss(model(x, plans[rank][0]), y).backward()
        opt.step()
        opt.zero_grad()
        _reference_step(ref, ropt, batches, plans, ref_mode or mode)
        with opt.gathered(), torch.no_grad():
            for n, p in model.named_parameters():
                worst = max(worst, ratio(p.detach(), refp[n].detach(), **tol(torch.float32)))
                refp[n].copy_(p)   # [Note: one step from the same point]
        for u in opt.units:
            for name, s in zip(u.names, opt.zero_units[u.index].param_steps):
                st = ropt.state.get(refp[name], {}).get("step", 0)
                steps_ok &= s == int(st)
    return {"worst": worst, "steps_ok": steps_ok}


def _groups(model):
    """Three groups, the middle one empty (torch keeps it)."""
    b = model.blocks
    return [{"params": list(b[0].parameters()) + list(b[1].parameters())},
            {"params": [], "weight_decay": 0.0},
            {"params": list(b[2].parameters()) + list(model.head.parameters()), "lr": 2 * LR}]


LAMBDAS = (lambda s: 1.0 / (1 + s), lambda s: 5.0, lambda s: 0.5 ** s)


def empty_group(rank: int, world_size: int, *, stage, offload=None) -> dict:
    """An empty param group stays in ``opt.param_groups``: a per-group LambdaLR over the
    user's three groups drives the same learning rates as torch's, step after step."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = zk.ZeroOptimizer(model, stage=stage, param_groups=_groups(model), lr=LR, eps=EPS,
                           weight_decay=WD, offload=offload)
    ropt = torch.optim.AdamW(_groups(ref), lr=LR, eps=EPS, weight_decay=WD)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, list(LAMBDAS))
    rsched = torch.optim.lr_scheduler.LambdaLR(ropt, list(LAMBDAS))
    refp = dict(ref.named_parameters())
    worst, lrs_ok = 0.0, len(opt.param_groups) == 3
    for step in range(STEPS):
        batches = _batches(world_size, step)
        x, y = batches[rank]
        F.mse_loss(model(x, (0, 1, 2)), y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        _reference_step(ref, ropt, batches, [((0, 1, 2), None)] * world_size, "skip")
        rsched.step()
        lrs_ok &= [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ropt.param_groups]
        with opt.gathered(), torch.no_grad():
            for n, p in model.named_parameters():
                worst = max(worst, ratio(p.detach(), refp[n].detach(), **tol(torch.float32)))
                refp[n].copy_(p)
    return {"worst": worst, "steps_ok": lrs_ok}


def untouched_mixed(rank: int, world_size: int, *, stage, offload) -> dict:
    """bf16 compute with fp32 masters (the offloaded update stages its bf16 output and sends
    it whole): a never-used block keeps its bf16 values, master and moments bit for bit, and
    its step count stays 0, while the used blocks change."""
    torch.manual_seed(0)
    model = Net()
    opt = zk.ZeroOptimizer(model, stage=stage, lr=LR, eps=EPS, weight_decay=WD,
                           param_dtype=torch.bfloat16, offload=offload)
    with opt.gathered():
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
    states0 = [tuple(t.clone() for t in z.read_state()[1]) for z in opt.zero_units]
    for step in range(3):
        x, y = _batches(world_size, step)[rank]
        F.mse_loss(model(x.bfloat16(), (0, 1)).float(), y).backward()
        opt.step()
        opt.zero_grad()
    unused_same, used_changed = True, True
    with opt.gathered():
        for n, p in model.named_parameters():
            if n.startswith("blocks.2."):
                unused_same &= torch.equal(p.detach(), before[n])
            else:
                used_changed &= not torch.equal(p.detach(), before[n])
    steps = {}
    for u, z, s0 in zip(opt.units, opt.zero_units, states0):
        _, now = z.read_state()
        for name, a, s, n in u.param_slices_in_shard():
            if name.startswith("blocks.2."):
                unused_same &= all(torch.equal(t[s:s + n], t0[s:s + n])
                                   for t, t0 in zip(now, s0))
        steps.update(zip(u.names, z.param_steps))
    return {"unused_same": unused_same, "used_changed": used_changed, "steps": steps}


def _fresh(stage):
    torch.manual_seed(1)
    return zk.ZeroOptimizer(Net(), stage=stage, lr=LR, eps=EPS)


def state_round_trip(rank: int, world_size: int, *, stage) -> dict:
    """Per-parameter step counts survive ``state_dict``/``load_state_dict`` and
    ``zkernels.checkpoint`` save/load, and a state saved before them (one ``"step"`` per
    unit) still loads with that count for every parameter. Block 0's bias is frozen after
    step 0, so its unit (bucket, stage-3 unit) holds two counts."""
    torch.manual_seed(0)
    model = Net()
    opt = zk.ZeroOptimizer(model, stage=stage, lr=LR, eps=EPS)
    for step in range(3):
        model.blocks[0].fc.bias.requires_grad_(step == 0)
        x, y = _batches(world_size, step)[rank]
        F.mse_loss(model(x, (0, 1) if step else (0, 1, 2)), y).backward()
        opt.step()
        opt.zero_grad()
    saved = opt.state_dict()
    kept = [z.param_steps for z in opt.zero_units]
    folder = [tempfile.mkdtemp(prefix="zk-grad-semantics-") if rank == 0 else None]
    if world_size > 1:
        dist.broadcast_object_list(folder, src=0)
    try:
        path = f"{folder[0]}/ckpt"
        zk.checkpoint.save(opt, path)
        opt3 = _fresh(stage)
        zk.checkpoint.load(opt3, path)
        same_ckpt = [z.param_steps for z in opt3.zero_units] == kept
    finally:
        if world_size > 1:
            dist.barrier()
        if rank == 0:
            shutil.rmtree(folder[0], ignore_errors=True)
    opt2 = _fresh(stage)
    opt2.load_state_dict(saved)
    same = [z.param_steps for z in opt2.zero_units] == kept
    for s in saved["state"].values():
        del s["param_steps"]
    opt2.load_state_dict(saved)
    old = all(z.param_steps == [saved["state"][z.index]["step"]] * len(z.flat.params)
              for z in opt2.zero_units)
    return {"same": same, "same_ckpt": same_ckpt, "old": old, "kept": kept}


def load_mid_run(rank: int, world_size: int, *, stage, inside: bool = False,
                 offload=None) -> dict:
    """``model.load_state_dict`` of another model's weights after step 1 (at stage 3 outside
    or ``inside`` ``opt.gathered()``): the run continues as torch's does after the same load
    (the moments and step counts are kept by both)."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    torch.manual_seed(5)
    other = Net().state_dict()
    opt = zk.ZeroOptimizer(model, stage=stage, lr=LR, eps=EPS, weight_decay=WD,
                           offload=offload)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS, weight_decay=WD)
    refp = dict(ref.named_parameters())
    worst, loaded = 0.0, 0.0
    for step in range(STEPS):
        if step == 2:
            ref.load_state_dict(other)
            with opt.gathered() if inside else contextlib.nullcontext():
                model.load_state_dict(other)
            with opt.gathered():
                loaded = max(ratio(p.detach(), other[n], rtol=0, atol=1e-30)
                             for n, p in model.named_parameters())
        batches = _batches(world_size, step)
        x, y = batches[rank]
        F.mse_loss(model(x, (0, 1, 2)), y).backward()
        opt.step()
        opt.zero_grad()
        _reference_step(ref, ropt, batches, [((0, 1, 2), None)] * world_size, "skip")
        with opt.gathered(), torch.no_grad():
            for n, p in model.named_parameters():
                worst = max(worst, ratio(p.detach(), refp[n].detach(), **tol(torch.float32)))
                refp[n].copy_(p)
    return {"worst": worst, "steps_ok": loaded == 0.0}


def load_mid_run_mixed(rank: int, world_size: int, *, stage, offload=None) -> dict:
    """bf16 compute (``param_dtype``): after ``model.load_state_dict`` the fp32 master shards
    hold the loaded fp32 values bit for bit (not the bf16-rounded copy), the parameters their
    bf16 rounding, and the next step starts from them (each element moves at most lr * (1 +
    wd) plus a bf16 ulp from the loaded value, far less than the distance to the old
    weights)."""
    torch.manual_seed(0)
    model = Net()
    torch.manual_seed(5)
    other = Net().state_dict()
    opt = zk.ZeroOptimizer(model, stage=stage, lr=LR, eps=EPS, weight_decay=WD,
                           param_dtype=torch.bfloat16, offload=offload)
    for step in range(2):
        x, y = _batches(world_size, step)[rank]
        F.mse_loss(model(x.bfloat16(), (0, 1, 2)).float(), y).backward()
        opt.step()
        opt.zero_grad()
    model.load_state_dict(other)
    master_exact, params_rounded = True, True
    for u in opt.units:
        _, (master, _, _) = opt.zero_units[u.index].read_state()
        for name, a, s, n in u.param_slices_in_shard():
            master_exact &= torch.equal(master[s:s + n].cpu(), other[name].reshape(-1)[a:a + n])
    with opt.gathered():
        for n, p in model.named_parameters():
            params_rounded &= torch.equal(p.detach(), other[n].bfloat16())
    x, y = _batches(world_size, 2)[rank]
    F.mse_loss(model(x.bfloat16(), (0, 1, 2)).float(), y).backward()
    opt.step()
    moved = 0.0
    with opt.gathered():
        for n, p in model.named_parameters():
            moved = max(moved, float((p.detach().float() - other[n]).abs().max()))
    return {"master_exact": master_exact, "params_rounded": params_rounded, "moved": moved}
