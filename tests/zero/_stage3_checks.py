"""Stage 3's checks beside the battery's (``_battery.py``: parity, round trip, fp16, traffic
and memory): loops without gradients, a rank that takes another path; run on every rank
(module-level so spawned ranks can import them).

``_harness.rank_check_tests`` runs every check of ``CHECKS`` once per world size and reports
per check (one spawn per world size). Parameters are read inside ``opt.gathered()``: between
uses a stage-3 parameter has no storage.
"""
from __future__ import annotations

import torch

import zkernels as zk
from tests.zero._harness import (EPS, LR, MICRO_BATCH, chunk, make_batches, make_model,
                                 variant)


def no_grad_loops(rank, ws):
    """100 forwards under torch.no_grad() (eval), a generation loop, then opt.gathered() and
    opt.gathered(one block): bytes held unchanged, nothing left gathered; train()/eval()
    switches; gathered() gathers exactly the units holding the module's parameters and a
    forward inside gathers nothing again."""
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=3, lr=LR, eps=EPS)
    batches = make_batches(2, ws * MICRO_BATCH)
    model(*chunk(batches[0], rank)).backward()
    opt.step()
    opt.zero_grad()
    held = opt.stats()["memory_bytes"]
    model.eval()
    x, y = chunk(batches[1], rank)
    with torch.no_grad():
        losses = [model(x, y).item() for _ in range(100)]
        idx = x[:, :4]
        for _ in range(6):  # greedy generation, one token at a time
            nxt = model(idx)[:, -1].argmax(-1, keepdim=True)
            idx = torch.cat([idx, nxt], dim=1)
    assert len(set(losses)) == 1, "eval forwards must be deterministic"
    assert opt.schedule.live_bytes() == 0 and opt.stats()["memory_bytes"] == held
    with opt.gathered():
        assert all(u.allocated for u in opt.schedule.units if u.flats)
        before = opt.meter.current_step()["all_gather"]
        with torch.no_grad():
            again = model(x, y).item()
        assert opt.meter.current_step()["all_gather"] == before, "gathered: no new gathers"
        assert again == losses[0]
    assert opt.schedule.live_bytes() == 0 and opt.stats()["memory_bytes"] == held
    with opt.gathered(model.blocks[1].attn):
        assert [u.allocated for u in opt.schedule.units] == [False, True, False]
        assert model.blocks[1].attn.weight.untyped_storage().nbytes() > 0
    assert opt.schedule.live_bytes() == 0
    model.train()
    loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    assert opt.schedule.live_bytes() == 0 and opt.stats()["memory_bytes"] == held
    try:
        with opt.gathered(torch.nn.Linear(2, 2)):
            pass
    except ValueError as exc:
        assert "not a submodule" in str(exc)
    else:
        raise AssertionError("gathered() of a foreign module must fail")


CHECKS = {"no_grad_loops_gathered": no_grad_loops}


def divergent_path(rank, world_size, mode):
    """``mode="skip"``: rank 1 skips block 1; ``"stop"``: rank 1 runs nothing at all. Every
    rank that runs must fail (not hang, not exchange wrong shards) with an error naming a
    unit."""
    model = variant(make_model(), (0, 1) if rank == 0 or mode == "stop" else (0,))
    opt = zk.ZeroOptimizer(model, stage=3, lr=LR)
    if mode == "stop" and rank == 1:
        return "stopped"
    try:
        for batch in make_batches(2, world_size * MICRO_BATCH):
            model(*chunk(batch, rank)).backward()
            opt.step()
    except RuntimeError as exc:
        return str(exc)
    return None
