"""The model shapes of issue 29 that crashed stage 3 or read it unclearly, as rank bodies for
test_model_shapes.py (module-level so spawned ranks import them): dataclass / namedtuple /
nested outputs between blocks, a parameter read outside its unit (the parent's
``F.linear(x, self.blocks[0].fc.weight)``, an L2 penalty on ``head.weight`` in the loop), a
plain read between steps, and a mixture-of-experts block routed per rank.

The oracle is the battery's: single-process ``torch.optim.AdamW`` on the same data (every
rank's batch; the loss is the mean of the ranks' losses, so its gradient is the mean of the
ranks' gradients, what ZeRO's reduction computes), continued from our parameters before each
step ([Note: one step from the same point] in ``_harness.py``) and compared within
tol(float32): the only difference left is the order in which the ranks' gradients are summed
and AdamW's fp32 round-off, a few ulps of each parameter.
"""
from __future__ import annotations

import dataclasses
from collections import namedtuple
from typing import Callable, Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F

import zkernels as zk
from tests.conftest import tol
from tests.zero._harness import EPS, LR, worst_param

D, STEPS, BATCH = 16, 3, 4
WD = 0.1


@dataclasses.dataclass
class Hidden:
    h: torch.Tensor
    extra: List[torch.Tensor]


@dataclasses.dataclass
class Out:
    loss: torch.Tensor
    logits: torch.Tensor


Pair = namedtuple("Pair", "a b")


class DCIn(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        h = self.fc(x)
        return Hidden(h=torch.tanh(h), extra=[h * 0.5])


class DCMid(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, hid: Hidden):
        y = self.fc(hid.h) + hid.extra[0]
        return {"out": [Pair(a=torch.relu(y), b=None)], "n": 3}


class DCModel(nn.Module):
    """Blocks pass a dataclass, then a dict of a list of a namedtuple; the forward returns a
    dataclass."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([DCIn(), DCMid()])
        self.head = nn.Linear(D, D)

    def forward(self, x, y):
        logits = self.head(self.blocks[1](self.blocks[0](x))["out"][0].a)
        return Out(loss=F.mse_loss(logits, y), logits=logits)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return torch.relu(self.fc(x))


class ExternalModel(nn.Module):
    """The parent reads ``blocks[0].fc.weight`` outside that block's forward."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, D)

    def forward(self, x, y):
        h = self.blocks[1](self.blocks[0](x))
        h = h + F.linear(x, self.blocks[0].fc.weight)
        return Out(loss=F.mse_loss(self.head(h), y), logits=h)


class PlainModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, D)

    def forward(self, x, y):
        return Out(loss=F.mse_loss(self.head(self.blocks[1](self.blocks[0](x))), y), logits=x)


class MoE(nn.Module):
    """Two experts; ``route`` (set per rank) picks the one this rank's tokens go through."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, D)
        self.experts = nn.ModuleList([nn.Linear(D, D), nn.Linear(D, D)])
        self.route = 0

    def forward(self, x):
        return torch.sigmoid(self.gate(x)) * self.experts[self.route](x)


class MoEModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), MoE()])
        self.head = nn.Linear(D, D)

    def forward(self, x, y):
        return Out(loss=F.mse_loss(self.head(self.blocks[1](self.blocks[0](x))), y), logits=x)


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, D, generator=g), torch.randn(BATCH, D, generator=g)


def _penalty(model):
    return 1e-2 * model.head.weight.pow(2).sum()


def _route(model, rank):
    if isinstance(model, MoEModel):
        model.blocks[1].route = rank % 2


def _loss(model, x, y, penalty):
    loss = model(x, y).loss
    return loss + _penalty(model) if penalty else loss


def _parity(make: Callable[[], nn.Module], stage: int, *, penalty=False, gathered=False,
            units=None, rank=0, world_size=1) -> Dict[str, object]:
    """Train ``make()`` for STEPS steps with ZeRO and the reference; returns the worst
    ratio (``<= 1`` passes) and where. ``gathered``: forward and backward inside
    ``opt.gathered()`` (the way to read a parameter outside its unit at stage 3)."""
    torch.manual_seed(0)
    model, ref = make(), make()
    ref.load_state_dict(model.state_dict())
    kw = {"units": units(model)} if units is not None and stage == 3 else {}
    opt = zk.ZeroOptimizer(model, stage=stage, lr=LR, eps=EPS, weight_decay=WD, **kw)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS, weight_decay=WD)
    worst, where = 0.0, ""
    for step in range(STEPS):
        with opt.gathered(), torch.no_grad():  # continue the reference from our point
            for p, q in zip(model.parameters(), ref.parameters()):
                q.copy_(p)
        ropt.zero_grad()
        for r in range(world_size):
            _route(ref, r)
            (_loss(ref, *_batch(step, r), penalty) / world_size).backward()
        ropt.step()
        _route(model, rank)
        x, y = _batch(step, rank)
        if gathered:
            with opt.gathered():
                _loss(model, x, y, penalty).backward()
        else:
            _loss(model, x, y, penalty).backward()
        opt.step()
        opt.zero_grad()
        with opt.gathered():
            r, n = worst_param(model, ref, **tol(torch.float32))
        if not r <= worst:
            worst, where = r, f"step {step} {n}"
    return {"worst": worst, "where": where}


def _error(make: Callable[[], nn.Module], stage: int, *, penalty=False, units=None,
           rank=0, world_size=1) -> str:
    """The error a step raises (its message), or "" where it trains."""
    torch.manual_seed(0)
    model = make()
    kw = {"units": units(model)} if units is not None else {}
    opt = zk.ZeroOptimizer(model, stage=stage, lr=LR, eps=EPS, **kw)
    _route(model, rank)
    try:
        _loss(model, *_batch(0, rank), penalty).backward()
        opt.step()
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        return f"{type(exc).__name__}: {exc}"
    return ""


def _plain_read(stage: int, rank=0, world_size=1) -> Dict[str, object]:
    """After a step: a plain read of ``head.weight``, its metadata, the read inside
    ``opt.gathered()``, ``model.state_dict()`` there, and a checkpoint round trip."""
    torch.manual_seed(0)
    model = PlainModel()
    opt = zk.ZeroOptimizer(model, stage=stage, lr=LR, eps=EPS)
    model(*_batch(0, rank)).loss.backward()
    opt.step()
    out = {}
    try:
        out["sum"] = float(model.head.weight.sum())
    except Exception as exc:  # noqa: BLE001
        out["sum"] = f"{type(exc).__name__}: {exc}"
    out["requires_grad"] = model.head.weight.requires_grad
    out["numel"] = model.head.weight.numel()
    with opt.gathered():
        out["gathered_sum"] = float(model.head.weight.sum())
        out["state_dict_sum"] = float(model.state_dict()["head.weight"].sum())
        out["shape"] = tuple(model.head.weight.shape)
    # training continues after the reads
    model(*_batch(1, rank)).loss.backward()
    opt.step()
    with opt.gathered():
        out["after"] = float(model.head.weight.sum())
    return out


def _parity_body(make, stage, rank, world_size, **kw):
    return _parity(make, stage, rank=rank, world_size=world_size, **kw)


def _error_body(make, stage, rank, world_size, **kw):
    return _error(make, stage, rank=rank, world_size=world_size, **kw)


def _plain_body(stage, rank, world_size):
    return _plain_read(stage, rank=rank, world_size=world_size)


def moe_units(model):
    return [MoE, Block]


def linear_units(model):
    return [nn.Linear]
