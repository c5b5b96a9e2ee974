"""A rung of ``master_dtype=torch.bfloat16`` ([Note: bf16 master] in
zkernels/zero/state/bf16_master.py) beside the battery's ``master=`` rows, against the same
oracle (torch's AdamW in fp32 rounded to nearest even, [Note: a bf16 master against its
oracle] in _battery.py), through the battery's ``parity``:

- the parameter shards in NVMe files (stage 3, ``offload="nvme"``, ``offload_params=True``,
  [Note: parameters on NVMe]): parity on 1 rank here and 2 ranks spawned, a truncated
  master write-back caught by it, and a folder kept by ``close(keep_files=True)`` resumed bit
  for bit against a run that never stopped.

The hybrid bf16-master rows are the battery's (``_battery.TABLE``, run by test_hybrid.py).
"""
import os
from functools import partial

import pytest
import torch

import zkernels as zk
from tests.zero import _battery
from tests.zero._battery import Row, offload_kw, row_model, temp_folder
from tests.zero._harness import (EPS, LR, MICRO_BATCH, chunk, make_batches, rank_fixture)
from tests.zero.test_battery import beyond, catches, check_parity, parity

ROW = Row(3, "bf16", offload="nvme", offload_params=True, steps=3, master="bf16")

BODIES = {"parity": partial(parity, row=ROW),
          "catches": partial(catches, row=ROW, fault=_battery.MASTER_FAULT)}
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
