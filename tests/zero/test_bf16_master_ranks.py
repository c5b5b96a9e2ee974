"""Two rungs of ``master_dtype=torch.bfloat16`` ([Note: bf16 master] in
zkernels/zero/state/bf16_master.py) beside the battery's ``master=`` rows, against the same
oracle (torch's AdamW in fp32 rounded to nearest even, [Note: a bf16 master against its
oracle] in _battery.py), through the battery's ``parity``:

- the parameter shards in NVMe files (stage 3, ``offload="nvme"``, ``offload_params=True``,
  [Note: parameters on NVMe]): parity on 1 rank here and 2 ranks spawned, a truncated
  master write-back caught by it, and a folder kept by ``close(keep_files=True)`` resumed bit
  for bit against a run that never stopped;
- hybrid sharding (4 ranks as 2 groups of 2, stages 2 and 3): parity, with the hybrid traffic
  and memory check made for bf16 parameters and master (``_traffic.hybrid_traffic_memory``
  assumes fp32 parameters: fp32 gathers, an fp32 master apart)."""
import os
from functools import partial

import pytest
import torch
import torch.distributed as dist

import zkernels as zk
from tests.zero import _battery, test_battery
from tests.zero._battery import Row, offload_kw, row_model, temp_folder
from tests.zero._harness import (EPS, LR, MICRO_BATCH, chunk, make_batches, make_model,
                                 rank_fixture)
from tests.zero.test_battery import beyond, catches, check_parity, parity

ROW = Row(3, "bf16", offload="nvme", offload_params=True, steps=3, master="bf16")
# Hybrid sharding (2 groups of K = 2 ranks) with a bf16 master, stages 2 and 3.
HYBRID_ROWS = {f"hybrid_stage{s}": Row(s, "bf16", shard_size=2, steps=3, master="bf16")
               for s in (2, 3)}


def _bf16_hybrid_traffic_memory(opt, ws, stage, offload, K, state=None, row=None) -> None:
    """_traffic.hybrid_traffic_memory for a bf16-master row (which assumes fp32 parameters):
    the last step's bytes exact against the layouts (the gradients reduced in fp32, the
    parameters gathered in bf16, the reduced fp32 shards all-reduced across the groups), and
    the bytes held: bf16 parameters, fp32 gradient shards and moments, no master apart (the
    bf16 parameter shard is the master), as estimate_memory says with N replaced by K."""
    assert offload is None and state is None and row.master == "bf16"
    g, world = ws // K, dist.get_world_size()
    padded = sum(u.layout.padded_numel for u in opt.units)
    shard = sum(u.layout.shard_numel for u in opt.units)
    assert all(u.layout.world_size == K for u in opt.units) and padded == K * shard
    comm = opt.stats()["comm_bytes"]
    gathers = 2 if stage == 3 else 1
    rs = padded * 4 * (K - 1) // K
    ag = gathers * padded * 2 * (K - 1) // K
    across = sum(2 * u.layout.shard_numel * 4 * (g - 1) // g for u in opt.units)
    checks = gathers * len(opt.units) + 1 if stage == 3 else 0
    small = (checks * 16 + 4) * 2 * (K - 1) // K + \
        opt.reducer.presence.nbytes * 2 * (world - 1) // world
    assert comm["reduce_scatter"] == rs, comm
    assert comm["all_gather"] == ag, comm
    assert comm["across_groups"] == across, (comm, across)
    assert comm["within_group"] == rs + ag + small, comm
    assert comm["all_reduce"] == across + small, comm
    mem = opt.stats()["memory_bytes"]
    want = {"params": 2 * (shard if stage == 3 else padded), "grads": 4 * shard,
            "master": 0, "optimizer_states": 8 * shard}
    assert {k: mem[k] for k in want} == want, mem
    kw = dict(param_dtype=torch.bfloat16, master_dtype=torch.bfloat16)
    est = zk.estimate_memory(make_model(), ws, stage, shard_size=K, **kw)
    plain = zk.estimate_memory(make_model(), K, stage, **kw)
    for kind in ("params_bytes", "grads_bytes", "master_bytes", "optimizer_states_bytes"):
        assert getattr(est, kind) == getattr(plain, kind), kind
    assert est.master_bytes == 0


def hybrid_parity(rank, ws, *, row: Row) -> dict:
    """The battery's parity of a hybrid bf16-master row, its traffic and memory checked by
    :func:`_bf16_hybrid_traffic_memory` (in this rank's process, for the row's run)."""
    keep, calls = test_battery.hybrid_traffic_memory, []

    def check(*args, **kw):
        _bf16_hybrid_traffic_memory(*args, **kw)
        calls.append(True)

    test_battery.hybrid_traffic_memory = check
    try:
        res = parity(rank, ws, row=row)
    finally:
        test_battery.hybrid_traffic_memory = keep
    return dict(res, traffic_checked=len(calls))


BODIES = {"parity": partial(parity, row=ROW),
          "catches": partial(catches, row=ROW, fault=_battery.MASTER_FAULT),
          **{k: partial(hybrid_parity, row=r) for k, r in HYBRID_ROWS.items()}}
ranks = rank_fixture(BODIES, timeout=600.0)


@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("row", ["parity"])
def test_parity_with_the_battery_oracle(ranks, world_size, row):
    for res in ranks(row, world_size):
        check_parity(res, ROW, world_size)
        assert res["file_bytes"] > 0   # the parameter shards were in files


@pytest.mark.parametrize("world_size", [1])
@pytest.mark.parametrize("row", ["catches"])
def test_catches_a_truncated_master(ranks, world_size, row):
    """The same comparison fails when the bf16 master is written back truncated instead of
    rounded to nearest even (the battery's MASTER_FAULT) on this rung."""
    for res in ranks(row, world_size):
        assert any(beyond(c) for c in res["compare"]), res["compare"]


@pytest.mark.slow   # (4 spawned ranks)
@pytest.mark.parametrize("row", list(HYBRID_ROWS))
def test_hybrid_parity_with_the_battery_oracle(ranks, row):
    for res in ranks(row, 4):
        check_parity(res, HYBRID_ROWS[row], 4)
        assert res["traffic_checked"] == 1


def _build(folder, seed=0, **config):
    model = row_model(ROW, seed)
    kw = offload_kw("nvme", folder, offload_params=True,
                    nvme_buffer_bytes=_battery.NVME_LOWBIT_BUDGET, **config)
    return model, zk.ZeroOptimizer(model, stage=3, lr=LR, betas=_battery.BETAS, eps=EPS,
                                   weight_decay=_battery.WD, param_dtype=torch.bfloat16,
                                   master_dtype=torch.bfloat16, **kw)


def _train(model, opt, batches):
    for batch in batches:
        opt.backward(model(*chunk(batch, 0)))
        opt.step()
        opt.zero_grad()


def _params(model, opt):
    with opt.gathered():
        return [p.detach().clone() for p in model.parameters()]


def test_kept_folder_resumes_bit_for_bit():
    """2 steps, close(keep_files=True); a new optimizer over another initialization adopts
    the folder (the bf16 master and the moments in it; the parameter files rebuilt from the
    master) and 2 more steps give the bits of 4 steps without a stop."""
    batches = make_batches(4, MICRO_BATCH)
    with temp_folder() as folder:
        straight, opt0 = _build(os.path.join(folder, "straight"))
        _train(straight, opt0, batches)
        want = _params(straight, opt0)
        opt0.close()
        model, opt = _build(os.path.join(folder, "run"))
        masters = [f.dtype for rec in opt.shard_update.states
                   for k, f in rec.files.items() if k == "master"]
        assert masters and set(masters) == {torch.bfloat16}   # a bf16 master file
        _train(model, opt, batches[:2])
        first = _params(model, opt)
        kept = opt.close(keep_files=True)
        resumed, opt2 = _build(os.path.join(folder, "again"), seed=7, resume_dir=kept)
        assert all(torch.equal(a, b) for a, b in zip(first, _params(resumed, opt2)))
        _train(resumed, opt2, batches[2:])
        got = _params(resumed, opt2)
        assert all(s.step == 4 for s in opt2.shard_update.states)
        opt2.close()
    assert all(torch.equal(a, b) for a, b in zip(want, got))
