"""ZeroOptimizer stage 3 at world sizes 1 (no process group), 2 and 4 (gloo): loops without
gradients (each rank returns what it measured, one spawn per world size for the selected
rows; the test asserts here); then a rank that takes another path. Stage 3's parity, round
trip, fp16, traffic and memory are the battery's rows (test_battery.py). Parameters are read
inside ``opt.gathered()``: between uses a stage-3 parameter has no storage."""
from __future__ import annotations

import pytest
import torch

import zkernels as zk
from tests._dist import run_ranks
from tests.zero._harness import (EPS, LR, MICRO_BATCH, chunk, make_batches, make_model,
                                 rank_fixture, variant)


def no_grad_loops(rank, ws) -> dict:
    """100 forwards under torch.no_grad() (eval), a generation loop, then opt.gathered() and
    opt.gathered(one block), a training step, gathered() of a foreign module: what each
    stage left (bytes held, live bytes, units allocated, gathers, losses)."""
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=3, lr=LR, eps=EPS)
    batches = make_batches(2, ws * MICRO_BATCH)
    model(*chunk(batches[0], rank)).backward()
    opt.step()
    opt.zero_grad()
    out = {"held": opt.stats()["memory_bytes"]}

    def left(stage):   # nothing gathered and the bytes held unchanged
        out.setdefault("left", []).append((stage, opt.schedule.live_bytes(),
                                           opt.stats()["memory_bytes"] == out["held"]))

    model.eval()
    x, y = chunk(batches[1], rank)
    with torch.no_grad():
        losses = [model(x, y).item() for _ in range(100)]
        idx = x[:, :4]
        for _ in range(6):  # greedy generation, one token at a time
            nxt = model(idx)[:, -1].argmax(-1, keepdim=True)
            idx = torch.cat([idx, nxt], dim=1)
    out["distinct_eval_losses"] = len(set(losses))
    left("eval")
    with opt.gathered():
        out["gathered_all_allocated"] = all(u.allocated for u in opt.schedule.units if u.flats)
        before = opt.meter.current_step()["all_gather"]
        with torch.no_grad():
            again = model(x, y).item()
        out["gathers_inside_gathered"] = opt.meter.current_step()["all_gather"] - before
        out["loss_inside_gathered"], out["eval_loss"] = again, losses[0]
    left("gathered()")
    with opt.gathered(model.blocks[1].attn):
        out["one_block_allocated"] = [u.allocated for u in opt.schedule.units]
        out["one_block_storage"] = model.blocks[1].attn.weight.untyped_storage().nbytes()
    out["live_after_one_block"] = opt.schedule.live_bytes()
    model.train()
    loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    left("train step")
    try:
        with opt.gathered(torch.nn.Linear(2, 2)):
            pass
        out["foreign_module"] = None
    except ValueError as exc:
        out["foreign_module"] = str(exc)
    return out


ranks = rank_fixture({"no_grad_loops_gathered": no_grad_loops}, timeout=600.0)

WORLD_SIZES = (1, 2, pytest.param(4, marks=pytest.mark.slow))  # 4 ranks: the full suite


@pytest.mark.parametrize("row", ["no_grad_loops_gathered"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_no_grad_loops(ranks, world_size, row):
    """Eval forwards are deterministic and leave nothing gathered; opt.gathered() gathers
    every unit once (a forward inside gathers nothing again), gathered(one block) exactly the
    units holding its parameters; train()/eval() switch; a foreign module is refused."""
    for res in ranks(row, world_size):
        assert res["distinct_eval_losses"] == 1, "eval forwards must be deterministic"
        assert res["left"] == [("eval", 0, True), ("gathered()", 0, True),
                               ("train step", 0, True)]
        assert res["gathered_all_allocated"]
        assert res["gathers_inside_gathered"] == 0, "gathered: no new gathers"
        assert res["loss_inside_gathered"] == res["eval_loss"]
        assert res["one_block_allocated"] == [False, True, False]
        assert res["one_block_storage"] > 0
        assert res["live_after_one_block"] == 0
        assert res["foreign_module"] is not None, "gathered() of a foreign module must fail"
        assert "not a submodule" in res["foreign_module"]


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


@pytest.mark.parametrize("mode", ["skip", "stop"])
def test_divergent_path_fails_naming_the_unit(mode):
    """Rank 1's forward skips a block (both ranks see that they disagree, and on which units)
    or rank 1 stops (rank 0 fails within the process group's timeout, 10 s here): an error
    naming the unit instead of a hang, a crash or wrong shards."""
    errors = run_ranks(divergent_path, 2, mode, timeout=120.0, pg_timeout_s=10.0)
    if mode == "skip":
        for rank, err in enumerate(errors):
            assert err is not None and "ranks disagree on what comes next" in err, (rank, err)
            assert "'blocks.1'" in err and "'<root>'" in err, err
    else:
        assert errors[1] == "stopped"
        assert errors[0] is not None and "waited to gather unit '<root>'" in errors[0], errors
