"""Rank side of tests/zero/test_torch_optim_ranks.py (module level: spawned ranks import it):
a torch.optim class's run saved with zkernels.checkpoint at one world size and stage, resumed
at another and with CPU offload."""
import torch
import torch.nn as nn

import zkernels as zk

KW = dict(optimizer=torch.optim.SGD, lr=0.05, momentum=0.9, nesterov=True)
ADAGRAD = dict(optimizer=torch.optim.Adagrad, lr=0.05)
STEPS = 3


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 5))


def groups(m):
    """Group 0 SGD (the run's optimizer), group 1 Adagrad: two classes, two state formats."""
    return [{"params": list(m[0].parameters())},
            {"params": list(m[2].parameters()), **ADAGRAD}]


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 12, generator=g)


def train(m, opt, step, rank, ws):
    x = batch(step).chunk(ws)[rank]
    opt.zero_grad()
    (m(x).pow(2).mean()).backward()
    opt.step()


def params(m, opt):
    with opt.gathered():
        return [p.detach().clone() for p in m.parameters()]


def save_then_continue(rank, ws, folder):
    """Train STEPS, save, train STEPS more: the uninterrupted parameters."""
    m = model()
    opt = zk.ZeroOptimizer(m, stage=2, param_groups=groups(m), **KW)
    for s in range(STEPS):
        train(m, opt, s, rank, ws)
    zk.checkpoint.save(opt, folder)
    for s in range(STEPS, 2 * STEPS):
        train(m, opt, s, rank, ws)
    return [p.tolist() for p in params(m, opt)]   # (tensors do not cross the queue)


def resume(rank, ws, folder, stage, offload):
    """Load into another world size / stage / offload and train the same STEPS more."""
    m = model(seed=7)   # other initial values: the checkpoint must set them
    opt = zk.ZeroOptimizer(m, stage=stage, offload=offload, param_groups=groups(m), **KW)
    zk.checkpoint.load(opt, folder)
    for s in range(STEPS, 2 * STEPS):
        train(m, opt, s, rank, ws)
    out = params(m, opt)
    opt.close()
    return out
