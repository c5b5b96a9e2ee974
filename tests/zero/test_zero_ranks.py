"""The non-finite gradient policies (stages 1-3) at world sizes 1 (no process group), 2 and 4
(gloo); parity, round trips, fp16, traffic and memory are the battery's (test_battery.py).

Each rank runs ``nonfinite_policy`` for the selected rows (one spawn per world size) and
returns what it saw step by step; the tests assert on that here.
"""
from __future__ import annotations

import logging
from functools import partial

import pytest
import torch

import zkernels as zk
from tests.zero._battery import SMALL_BUCKET
from tests.zero._harness import (EPS, LR, MICRO_BATCH, chunk, make_batches, make_model,
                                 rank_fixture, world_mean)

STAGES = (1, 2, 3)  # the rows parametrized over stages
BAD_STEPS = (1, 2)  # an inf gradient at step index 1, a NaN at 2, on the last rank only


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def nonfinite_policy(rank, ws, *, stage, policy, param_dtype) -> dict:
    """fp32/bf16 (no loss scaling), 5 steps, an inf gradient at step 2 and a NaN at step 3 on
    the last rank only (after the reduce-scatter only the owner of that element sees it). Per
    step: the error step() raised (None if none), whether parameters and states stayed bit
    for bit, whether every parameter is finite, and how many ranks named ln_f.bias; then the
    stats, rank 0's warnings and the bucket steps."""
    from zkernels.zero.gradients.nonfinite import NonFiniteGradientError
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=stage, lr=LR, eps=EPS, param_dtype=param_dtype,
                           bucket_bytes=SMALL_BUCKET, nonfinite=policy)
    records = _Records()
    logging.getLogger("zkernels.zero").addHandler(records)
    steps = []
    try:
        for step, batch in enumerate(make_batches(5, ws * MICRO_BATCH)):
            with opt.gathered():  # stage 3: parameters have storage only inside
                before = [p.detach().clone() for p in model.parameters()]
            states = [t.clone() for b in opt.shard_update.states
                      for t in (b.master, b.exp_avg, b.exp_avg_sq)]
            loss = model(*chunk(batch, rank))
            hook = None
            if step in BAD_STEPS and rank == ws - 1:
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
            named = world_mean(float(error is not None and "ln_f.bias" in error), ws) * ws
            steps.append({"step": step, "error": error, "same": same, "finite": finite,
                          "ranks_naming_the_parameter": named})
        st = opt.stats()
        return {"steps": steps, "num_steps": st["step"], "overflow_skips": st["overflow_skips"],
                "warned": [m for m in records.messages if "inf/NaN" in m],
                "bucket_steps": [b.step for b in opt.shard_update.states]}
    finally:
        logging.getLogger("zkernels.zero").removeHandler(records)


ROWS = {f"nonfinite_{policy}_{name}_stage{s}": partial(nonfinite_policy, stage=s,
                                                       policy=policy, param_dtype=dt)
        for policy in ("skip", "raise")
        for name, dt in (("fp32", None), ("bf16", torch.bfloat16)) for s in STAGES}

ranks = rank_fixture(ROWS, timeout=400.0)

WORLD_SIZES = (1, 2, pytest.param(4, marks=pytest.mark.slow))  # 4 ranks: the full suite


@pytest.mark.parametrize("row", list(ROWS))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_nonfinite_policy(ranks, world_size, row):
    """"skip": every rank skips both steps bit for bit (params, masters, moments, bucket
    steps), ``overflow_skips`` counts 2, rank 0 logs one WARNING per skip naming the step, and
    clean steps update. "raise": every rank raises NonFiniteGradientError naming the step,
    exactly one rank (the owner) names ln_f.bias, nothing changes, stats() counts the skip,
    and training goes on after zero_grad."""
    policy = row.split("_")[1]
    for rank, res in enumerate(ranks(row, world_size)):
        steps = res["steps"]
        clean = [s for s in steps if s["step"] not in BAD_STEPS]
        bad = [s for s in steps if s["step"] in BAD_STEPS]
        # clean steps update, with finite parameters
        assert [(s["error"], s["same"], s["finite"]) for s in clean] == [(None, False, True)] * 3
        # non-finite steps change nothing
        assert [s["same"] for s in bad] == [True, True]
        if policy == "raise":
            for s in bad:
                assert s["error"] is not None and f"step {s['step'] + 1}:" in s["error"]
                assert s["ranks_naming_the_parameter"] == 1.0, s["error"]
        else:
            assert [s["error"] for s in bad] == [None, None]
        assert res["num_steps"] == 5
        assert res["overflow_skips"] == 2
        warned = res["warned"]
        if policy == "skip" and rank == 0:
            assert len(warned) == 2 and "step 2:" in warned[0] and "step 3:" in warned[1]
        else:
            assert warned == []
        assert set(res["bucket_steps"]) == {3}
