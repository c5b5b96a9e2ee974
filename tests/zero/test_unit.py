"""One unit's step (``zkernels/zero/unit.py``), single process: it updates its own state and
parameters as one ``torch.optim.AdamW`` step over them would, and nothing else."""
import pytest
import torch

import zkernels as zk
from tests.conftest import tol
from tests.zero._harness import EPS, LR, MICRO_BATCH, chunk, clone_model, make_batches, make_model

WD = 0.1


def _params(opt, model):
    with opt.gathered():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("row", ["own_grad", "catches_shifted_grad"])
def test_a_unit_step_touches_only_its_own_state_and_parameters(stage, row):
    model = make_model()
    ref = clone_model(model)
    opt = zk.ZeroOptimizer(model, stage=stage, lr=LR, eps=EPS, weight_decay=WD,
                           bucket_bytes=3000)
    assert len(opt.zero_units) >= 3
    batch = chunk(make_batches(1, MICRO_BATCH)[0], 0)
    model(*batch).backward()
    ref(*batch).backward()
    before = _params(opt, model)
    states = [tuple(t.clone() for t in z.read_state()[1]) for z in opt.zero_units]
    shards, _ = opt.reducer.finish()
    k = len(opt.zero_units) // 2
    unit = opt.zero_units[k]
    # The catches_ row gives each element its neighbour's gradient: the oracle comparison
    # below must fail.
    grad = shards[k].roll(1) if row.startswith("catches_") else shards[k]
    unit.step(grad, 1.0, None, opt.comm).wait()
    opt.shard_update.finish_step()

    names = set(unit.flat.names)
    oracle = torch.optim.AdamW([p for n, p in ref.named_parameters() if n in names], lr=LR,
                               eps=EPS, weight_decay=WD)
    oracle.step()
    after = _params(opt, model)
    mine = dict(ref.named_parameters())
    for n in before:
        if n in names:
            if row.startswith("catches_"):
                continue
            torch.testing.assert_close(after[n], mine[n].detach(), **tol(torch.float32))
        else:
            assert torch.equal(after[n], before[n]), f"{n} of another unit changed"
    if row.startswith("catches_"):
        with pytest.raises(AssertionError):
            for n in names:
                torch.testing.assert_close(after[n], mine[n].detach(), **tol(torch.float32))
    for i, z in enumerate(opt.zero_units):
        step, now = z.read_state()
        assert step == (1 if i == k else 0)
        if i != k:
            assert all(torch.equal(a, b) for a, b in zip(now, states[i])), f"unit {i} state"
