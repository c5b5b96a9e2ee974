"""Rank side of tests/zero/test_matrix_optim.py (module level: spawned ranks import it): the
whole-matrix classes (torch.optim.Muon, torch.optim.Adafactor) on their owners, against the
class itself in one process on the same data ([Note: whole matrices on owners])."""
import torch
import torch.nn as nn
import torch.optim._muon as _muon

import zkernels as zk
from tests.zero._optim_checks import batch, params, train  # noqa: F401 - one data recipe

STEPS = 3
ADAMW = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 20), nn.ReLU(),
                         nn.Linear(20, 5))


def matrices(m):
    return [p for p in m.parameters() if p.ndim == 2]


def rest(m):
    return [p for p in m.parameters() if p.ndim != 2]


def groups(m, kind):
    """The standard recipe: Muon (or Adafactor) on the matrices, the fused AdamW on the rest;
    "adafactor_all": Adafactor on every parameter (vectors too)."""
    if kind == "adafactor_all":
        return [{"params": list(m.parameters()), "optimizer": torch.optim.Adafactor,
                 "lr": 0.01}]
    cls = torch.optim.Muon if kind == "muon" else torch.optim.Adafactor
    return [{"params": matrices(m), "optimizer": cls, "lr": 0.02},
            {"params": rest(m), **ADAMW}]


def reference(m, kind):
    """The oracle: the torch classes on the whole model in one process."""
    if kind == "adafactor_all":
        return [torch.optim.Adafactor(m.parameters(), lr=0.01)]
    cls = torch.optim.Muon if kind == "muon" else torch.optim.Adafactor
    return [cls(matrices(m), lr=0.02), torch.optim.AdamW(rest(m), **ADAMW)]



def oracle(kind, steps=STEPS):
    m = model()
    opts = reference(m, kind)
    for s in range(steps):
        for o in opts:
            o.zero_grad()
        (m(batch(s)).pow(2).mean()).backward()
        for o in opts:
            o.step()
    return [p.detach().clone() for p in m.parameters()]


def counted_ns():
    """Patch torch's Newton-Schulz to count its calls in this process; returns the counter."""
    calls = [0]
    inner = _muon._zeropower_via_newtonschulz

    def counting(*a, **k):
        calls[0] += 1
        return inner(*a, **k)

    _muon._zeropower_via_newtonschulz = counting
    return calls


def run(rank, ws, kind, stage, offload=None, steps=STEPS):
    """Train ``steps``; the parameters, this rank's Newton-Schulz calls and the last step's
    bytes sent (and those of the same run with the fused AdamW everywhere)."""
    calls = counted_ns()
    m = model()
    opt = zk.ZeroOptimizer(m, stage=stage, offload=offload, param_groups=groups(m, kind))
    for s in range(steps):
        train(m, opt, s, rank, ws)
    sent = opt.stats()["comm_bytes"]
    base = model()
    plain = zk.ZeroOptimizer(base, stage=stage, offload=offload, **ADAMW)
    for s in range(steps):
        train(base, plain, s, rank, ws)
    owned = len(opt.shard_update.matrix.owned())
    out = {"params": [p.tolist() for p in params(m, opt)], "ns_calls": calls[0],
           "owned": owned, "sent": sent, "plain_sent": plain.stats()["comm_bytes"]}
    opt.close()
    plain.close()
    return out


def wrong_mapping(rank, ws, kind):
    """The run with every owner's gradient pieces read one element off (a wrong mapping of
    the shards to the whole matrix): must leave the oracle."""
    m = model()
    opt = zk.ZeroOptimizer(m, stage=2, param_groups=groups(m, kind))
    mx = opt.shard_update.matrix
    step = mx.step
    mx.step = lambda comm, meter, shards, *a: step(comm, meter, [g.roll(1) for g in shards], *a)
    for s in range(STEPS):
        train(m, opt, s, rank, ws)
    return [p.tolist() for p in params(m, opt)]


def save_then_continue(rank, ws, folder, kind):
    """Train STEPS, save (zkernels.checkpoint), train STEPS more: the uninterrupted params."""
    m = model()
    opt = zk.ZeroOptimizer(m, stage=2, param_groups=groups(m, kind))
    for s in range(STEPS):
        train(m, opt, s, rank, ws)
    zk.checkpoint.save(opt, folder)
    for s in range(STEPS, 2 * STEPS):
        train(m, opt, s, rank, ws)
    return [p.tolist() for p in params(m, opt)]


def resume(rank, ws, folder, kind, stage, offload, zero_state=False):
    """Load into another world size / stage / offload and train the same STEPS more."""
    m = model(seed=7)   # other initial values: the checkpoint must set them
    opt = zk.ZeroOptimizer(m, stage=stage, offload=offload, param_groups=groups(m, kind))
    zk.checkpoint.load(opt, folder)
    if zero_state:   # the check can fail: the owners' state forgotten
        for inner in opt.shard_update.matrix.inner.values():
            for st in inner.state.values():
                for t in st.values():
                    t.zero_() if isinstance(t, torch.Tensor) and t.dim() else None
    for s in range(STEPS, 2 * STEPS):
        train(m, opt, s, rank, ws)
    out = [p.tolist() for p in params(m, opt)]
    opt.close()
    return out


def resume_same_run(kind, stage, folder):
    """Save after STEPS and go on STEPS (at world size 1, units of one Linear at stage 3, of
    512 bytes at stage 2: the matrices' units between the fused AdamW's bias units); a fresh
    optimizer loading the checkpoint goes on the same STEPS. Both runs' parameters."""
    out, cut = [], dict(units=[nn.Linear]) if stage == 3 else dict(bucket_bytes=512)
    for load in (False, True):
        m = model(seed=7 if load else 0)
        opt = zk.ZeroOptimizer(m, stage=stage, param_groups=groups(m, kind), **cut)
        if load:
            zk.checkpoint.load(opt, folder)
        else:
            for s in range(STEPS):
                train(m, opt, s, 0, 1)
            zk.checkpoint.save(opt, folder)
        for s in range(STEPS, 2 * STEPS):
            train(m, opt, s, 0, 1)
        out.append(params(m, opt))
        opt.close()
    return out


def state_dict_round_trip(rank, ws, kind):
    """opt.state_dict() (the owners' class format) into a fresh optimizer over other values:
    the two continue alike; the owned entries' keys."""
    m = model()
    opt = zk.ZeroOptimizer(m, stage=2, param_groups=groups(m, kind))
    for s in range(STEPS):
        train(m, opt, s, rank, ws)
    sd = opt.state_dict()
    m2 = model(seed=5)
    opt2 = zk.ZeroOptimizer(m2, stage=2, param_groups=groups(m2, kind))
    opt2.load_state_dict(sd)
    for s in range(STEPS, STEPS + 2):
        train(m, opt, s, rank, ws)
        train(m2, opt2, s, rank, ws)
    keys = {k: sorted(v) for k, v in sd["state"].items()}
    shapes = {k: [list(t.shape) for t in v.values() if isinstance(t, torch.Tensor)]
              for k, v in sd["state"].items()}
    same = [torch.equal(p, q) for p, q in zip(params(m, opt), params(m2, opt2))]
    return {"same": same, "keys": keys, "shapes": shapes}


def fp32_newton_schulz():
    """Patch torch's Newton-Schulz to run in fp32 (torch's runs in bf16) in this process."""
    def ns(grad, coefficients, steps, eps):
        a, b, c = coefficients
        x = grad.float()
        if grad.size(0) > grad.size(1):
            x = x.T
        x = x / x.norm().clamp(min=eps)
        for _ in range(steps):
            g = x @ x.T
            x = torch.addmm(x, torch.addmm(g, g, g, beta=b, alpha=c), x, beta=a)
        return x.T if grad.size(0) > grad.size(1) else x

    _muon._zeropower_via_newtonschulz = ns


def hybrid_parity(rank, ws, fp32_ns):
    """The battery's parity of Muon + AdamW with hybrid sharding (2 groups of 2): each
    step's worst parameter error over tol(float32), and the last step's extra bytes sent
    beside Ψ_m (the exchanges run within each shard group)."""
    from tests.zero import _battery as b
    from tests.zero import test_battery as tb
    if fp32_ns:
        fp32_newton_schulz()
    extra = {}

    def measure(opt, ws, stage, offload, K, state=None, row=None):   # (the bytes beside Ψ_m)
        sent = opt.stats()["comm_bytes"]
        base = sum(4 * u.layout.padded_numel for u in opt.units) * (K - 1) // K
        extra["bytes"] = sent["reduce_scatter"] + sent["all_gather"] - 2 * base
        extra["psi_m"] = 4 * sum(it.numel for it in opt.shard_update.matrix.items)

    tb.hybrid_traffic_memory = measure
    res = tb.parity(rank, ws, row=b.Row(2, shard_size=2, steps=3, optim="muon_adamw"))
    return {"params": [c["params"] for c in res["compare"]], **extra}
