"""Stage 3's checks beside the battery's (``_battery.py``: parity, round trip, fp16): traffic
and memory against the formulas, loops without gradients, a rank that takes another path; run
on every rank (module-level so spawned ranks can import them).

``_harness.rank_check_tests`` runs every check of ``CHECKS`` once per world size and reports
per check (one spawn per world size). Parameters are read inside ``opt.gathered()``: between uses a stage-3 parameter
has no storage.
"""
from __future__ import annotations

from functools import partial

import torch

import zkernels as zk
from tests.zero._harness import (EPS, LR, MICRO_BATCH, chunk, make_batches, make_model,
                                 variant)


def traffic_and_memory(rank, ws, *, reshard, param_dtype=None):
    """Per step: all-gathers 2Ψ(N-1)/N (1Ψ without resharding) + reduce-scatter Ψ(N-1)/N,
    exact against the padded layout and within 1% of the unpadded 3Ψ (2Ψ); one all-gather per
    flat unit per direction; params held between steps = this rank's shards (about Ψ/N,
    nothing gathered); every kind exact against the layout, the total within 2% of DESIGN.md's
    16Ψ/N (fp32) beside the reduce buffers; peak gathered bytes under the prefetch bound."""
    model = make_model()
    psi = sum(p.numel() for p in model.parameters())  # the tied weight once
    opt = zk.ZeroOptimizer(model, stage=3, lr=LR, param_dtype=param_dtype,
                           reshard_after_forward=reshard)
    for batch in make_batches(3, ws * MICRO_BATCH):
        model(*chunk(batch, rank)).backward()
        opt.step()
        opt.zero_grad()
    st = opt.stats()
    pel = 2 if param_dtype is not None else 4
    rel = 4
    padded = sum(u.layout.padded_numel for u in opt.units)
    shard = sum(u.layout.shard_numel for u in opt.units)
    comm = st["comm_bytes"]
    gathers = 2 if reshard else 1
    assert comm["reduce_scatter"] == padded * rel * (ws - 1) // ws, comm
    assert comm["all_gather"] == gathers * padded * pel * (ws - 1) // ws, comm
    # [Note: divergent paths]: one check per gather, and one as step() begins
    checks = (gathers * len(opt.units) + 1) if ws > 1 else 0
    # The path checks (16 bytes each) plus the 4-byte gradient-norm all-reduce every step
    # (clip.py's Note: it carries the non-finite flag), ring-metered as 2(N-1)/N.
    assert comm["all_reduce"] == (checks * 16 + 4) * 2 * (ws - 1) // ws, comm
    ideal = psi * (rel + gathers * pel) * (ws - 1) / ws
    assert ws == 1 and comm["total"] == 0 or abs(comm["total"] - ideal) <= 0.01 * ideal, \
        (comm, ideal)
    g = st["gather"]
    assert g["all_gathers"] == gathers * len(opt.units), g
    assert g["gathered_bytes"] == 0, g
    biggest = max(u.nbytes for u in opt.schedule.units[:-1])
    assert g["limit_bytes"] == opt.schedule.root.nbytes + 2 * biggest
    if reshard:
        assert 0 < g["peak_gathered_bytes"] <= g["limit_bytes"], g
    else:
        assert g["peak_gathered_bytes"] == padded * pel, g
    mem = st["memory_bytes"]
    # Between steps: the shards and nothing else (the reduce buffers live only while
    # gradients are in flight: [Note: transient reduce buffers]).
    expected = {"params": shard * pel, "grads": shard * 4,
                "master": shard * 4 if param_dtype is not None else 0,
                "optimizer_states": shard * 8, "buffers": 0}
    expected["total"] = sum(expected.values())
    assert mem == expected, (mem, expected)
    assert opt.reducer.held_buffers() == []
    design = psi * (16 if param_dtype is None else 18) / ws  # bf16: 2 + 4 (grad fp32) + 12
    assert abs(mem["total"] - design) <= 0.02 * design, (mem["total"], design)
    # The step's peak: the two unit-sized reduce buffers and the gathered units beside it.
    peak = st["step_peak_bytes"]
    buffers = 2 * max(u.layout.padded_numel for u in opt.units) * rel
    assert peak == {"buffers": buffers, "gathered_params": g["peak_gathered_bytes"],
                    "total": mem["total"] + buffers + g["peak_gathered_bytes"]}, peak
    return {"comm": comm, "memory": mem, "psi": psi, "gather": g}


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


CHECKS = {
    "traffic_memory_fp32": partial(traffic_and_memory, reshard=True),
    "traffic_memory_fp32_keep": partial(traffic_and_memory, reshard=False),
    "traffic_memory_bf16": partial(traffic_and_memory, reshard=True,
                                   param_dtype=torch.bfloat16),
    "no_grad_loops_gathered": no_grad_loops,
}


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
