"""The checks beside the battery's (``_battery.py``: parity, round trip, fp16): the
non-finite gradient policies (stages 1-3) and stages 1-2's traffic and memory against the
formulas, run on every rank (module-level so spawned ranks can import them).

``_harness.rank_check_tests`` runs every check of ``CHECKS`` once per world size and reports
per check, so one spawn per world size covers them all (each spawn pays a torch import per
rank).
"""
from __future__ import annotations

import logging
from functools import partial

import torch

import zkernels as zk
from tests.zero._battery import SMALL_BUCKET
from tests.zero._harness import (EPS, LR, MICRO_BATCH, chunk, make_batches, make_model,
                                 world_mean)

STAGES = (1, 2, 3)  # the checks parametrized over stages


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def nonfinite_policy(rank, ws, *, stage, policy, param_dtype):
    """fp32/bf16 (no loss scaling): an inf gradient at step 2 and a NaN at step 3, on the last
    rank only (after the reduce-scatter only the owner of that element sees it).

    "skip": every rank skips both steps bit for bit (params, masters, moments, bucket steps),
    ``overflow_skips`` counts 2, rank 0 logs one WARNING per skip naming the step, and clean
    steps update. "raise": every rank raises NonFiniteGradientError naming the step, exactly
    one rank (the owner) names ln_f.bias, nothing changes, stats() counts the skip, and training
    goes on after zero_grad."""
    from zkernels.zero.gradients.nonfinite import NonFiniteGradientError
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=stage, lr=LR, eps=EPS, param_dtype=param_dtype,
                           bucket_bytes=SMALL_BUCKET, nonfinite=policy)
    records = _Records()
    logging.getLogger("zkernels.zero").addHandler(records)
    try:
        for step, batch in enumerate(make_batches(5, ws * MICRO_BATCH)):
            with opt.gathered():  # stage 3: parameters have storage only inside
                before = [p.detach().clone() for p in model.parameters()]
            states = [t.clone() for b in opt.shard_update.states
                      for t in (b.master, b.exp_avg, b.exp_avg_sq)]
            loss = model(*chunk(batch, rank))
            hook = None
            if step in (1, 2) and rank == ws - 1:
                # ln_f.bias[0]'s gradient becomes inf (step 2) or NaN (step 3). A gradient
                # hook, not a loss term: at stage 3 the root unit (ln_f) is freed after forward.
                bad_value = float("inf" if step == 1 else "nan")
                hook = model.ln_f.bias.register_hook(
                    lambda g: g + torch.zeros_like(g).index_fill_(
                        0, torch.tensor([0], device=g.device), bad_value))
            loss.backward()
            if hook is not None:
                hook.remove()
            error = None
            try:
                opt.step()
            except NonFiniteGradientError as exc:
                error = str(exc)
            opt.zero_grad()
            with opt.gathered():
                same = (all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
                        and all(torch.equal(a, t) for a, t in zip(
                            states, [t for b in opt.shard_update.states
                                     for t in (b.master, b.exp_avg, b.exp_avg_sq)])))
                finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
            bad = step in (1, 2)
            if not bad:
                assert error is None and not same, f"step {step + 1} must update"
                assert finite
                continue
            assert same, f"step {step + 1} (non-finite) changed something"
            if policy == "raise":
                assert error is not None and f"step {step + 1}:" in error, error
                named = world_mean(float("ln_f.bias" in error), ws) * ws
                assert named == 1.0, f"{named} ranks named the parameter: {error}"
        st = opt.stats()
        assert st["step"] == 5
        assert st["overflow_skips"] == 2, st
        warned = [m for m in records.messages if "inf/NaN" in m]
        if policy == "skip" and rank == 0:
            assert len(warned) == 2 and "step 2:" in warned[0] and "step 3:" in warned[1], \
                warned
        else:
            assert warned == [], warned
        assert all(b.step == 3 for b in opt.shard_update.states)
    finally:
        logging.getLogger("zkernels.zero").removeHandler(records)


def traffic_and_memory(rank, ws, *, stage, param_dtype):
    """Bytes sent per step (volume meter) and held per rank (allocated storages) against the
    ring formula and DESIGN.md's table. Exact against the padded layout; within 1% of the
    unpadded formula (padding is at most align*(tensors+N) elements per bucket)."""
    model = make_model()
    psi = sum(p.numel() for p in model.parameters())  # the tied weight once
    opt = zk.ZeroOptimizer(model, stage=stage, lr=LR, param_dtype=param_dtype,
                           bucket_bytes=2 ** 16)
    for batch in make_batches(2, ws * MICRO_BATCH):
        model(*chunk(batch, rank)).backward()
        opt.step()
        opt.zero_grad()
    st = opt.stats()
    pel = 2 if param_dtype is not None else 4
    rel = 4
    padded = sum(b.layout.padded_numel for b in opt.units)
    shard = sum(b.layout.shard_numel for b in opt.units)
    comm = st["comm_bytes"]
    assert comm["reduce_scatter"] == padded * rel * (ws - 1) // ws, comm
    assert comm["all_gather"] == padded * pel * (ws - 1) // ws, comm
    # One 4-byte all-reduce per step: the non-finite check (clip.py's Note), metered apart
    # from the 2 Psi, which counts reduce-scatter and all-gather only.
    flag = 2 * 4 * (ws - 1) // ws
    assert comm["all_reduce"] == flag, comm
    moved = comm["reduce_scatter"] + comm["all_gather"]
    assert comm["total"] == moved + flag
    ideal = psi * (rel + pel) * (ws - 1) / ws  # 2 Psi (N-1)/N in the two dtypes
    assert ws == 1 and moved == 0 or abs(moved - ideal) <= 0.01 * ideal, (comm, ideal)
    mem = st["memory_bytes"]
    biggest = max(b.layout.padded_numel for b in opt.units)
    pooled = stage == 2 or param_dtype is not None  # stage 1 casts through the pool
    expected = {"params": padded * pel,
                "grads": padded * pel if stage == 1 else shard * 4,
                "master": shard * 4 if param_dtype is not None else 0,
                "optimizer_states": shard * 8,
                "buffers": 2 * biggest * rel if pooled else 0}
    expected["total"] = sum(expected.values())
    assert mem == expected, (mem, expected)
    # DESIGN.md: fp32 stage 1 4+4+8/N, stage 2 4+12/N; bf16 stage 1 2+2+12/N, stage 2
    # 2+(4+12)/N (our grad shard is fp32, the reduce dtype), bucket buffers aside.
    if param_dtype is None:
        design = psi * (8 + 8 / ws) if stage == 1 else psi * (4 + 12 / ws)
    else:
        design = psi * (4 + 12 / ws) if stage == 1 else psi * (2 + 16 / ws)
    held = mem["total"] - mem["buffers"]
    assert abs(held - design) <= 0.01 * design, (held, design)
    return {"comm": comm, "memory": mem, "psi": psi}


CHECKS = {
    **{f"nonfinite_{policy}_{name}_stage{s}": partial(nonfinite_policy, stage=s,
                                                       policy=policy, param_dtype=dt)
       for policy in ("skip", "raise") for name, dt in (("fp32", None), ("bf16", torch.bfloat16))
       for s in STAGES},
    "traffic_memory_fp32_stage1": partial(traffic_and_memory, stage=1, param_dtype=None),
    "traffic_memory_fp32_stage2": partial(traffic_and_memory, stage=2, param_dtype=None),
    "traffic_memory_bf16_stage1": partial(traffic_and_memory, stage=1,
                                          param_dtype=torch.bfloat16),
    "traffic_memory_bf16_stage2": partial(traffic_and_memory, stage=2,
                                          param_dtype=torch.bfloat16),
}
