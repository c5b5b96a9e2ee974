"""The checks beside the battery's (``_battery.py``: parity, round trip, fp16, traffic and
memory): the non-finite gradient policies (stages 1-3), run on every rank (module-level so
spawned ranks can import them).

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


CHECKS = {f"nonfinite_{policy}_{name}_stage{s}": partial(nonfinite_policy, stage=s,
                                                         policy=policy, param_dtype=dt)
          for policy in ("skip", "raise")
          for name, dt in (("fp32", None), ("bf16", torch.bfloat16)) for s in STAGES}
