"""The owners' exchanges of a whole-matrix class in the estimate ([Note: the matrix exchanges
in the estimate] in zkernels/zero/planning/matrix_plan.py): ``estimate_memory(model, N,
stage, param_groups=...)``'s ``comm_matrix_bytes`` against the meter of a Muon + AdamW run
on the battery's GPT (the bytes the two all-to-alls sent in a steady step: the step's
reduce-scatter and all-gather bytes less the padded layout's 2Ψ / 3Ψ), byte for byte at
stages 1-3, with CPU offload and with hybrid sharding; ``comm_bytes`` is the fused AdamW's
plus that; ``plan``'s comm column carries it for a count."""
import pytest
import torch

import zkernels as zk
from tests._dist import run_ranks
from tests.zero import _battery as b
from tests.zero._harness import MICRO_BATCH, chunk, make_batches

CASES = [dict(stage=2), dict(stage=3)]
MORE = [dict(stage=1), dict(stage=2, offload="cpu")]   # the full suite's


def measure(rank, ws, cases, shard_size=None):
    """Per case: the estimate's matrix bytes, the meter's (a steady step: the third), the
    estimate's comm_bytes and that of the same rung with the fused AdamW everywhere."""
    out = []
    for case in cases:
        model = b.make_model(0)
        groups = b.matrix_groups(model, "muon_adamw")
        kw = dict(case, **({} if case["stage"] == 3 else {"bucket_bytes": b.SMALL_BUCKET}),
                  shard_size=shard_size)
        est = zk.estimate_memory(model, ws, param_groups=groups, **kw)
        plain = zk.estimate_memory(model, ws, **kw)
        opt = zk.ZeroOptimizer(model, param_groups=groups, **kw)
        for batch in make_batches(3, ws * MICRO_BATCH):
            opt.backward(model(*chunk(batch, rank)))
            opt.step()
            opt.zero_grad()
        k = opt.comm.world_size
        padded = sum(u.layout.padded_numel for u in opt.units)
        gathers = 2 if case["stage"] == 3 else 1
        sent = opt.stats()["comm_bytes"]
        moved = sent["reduce_scatter"] + sent["all_gather"]
        out.append({"case": case, "estimate": est.comm_matrix_bytes,
                    "meter": moved - (1 + gathers) * padded * 4 * (k - 1) // k,
                    "comm": est.comm_bytes, "plain_comm": plain.comm_bytes})
        opt.close()
    return out


def _check(res):
    for per_rank in res:
        for r in per_rank:
            assert r["estimate"] > 0, r
            # the meter counts the rank's own sends; the chunks are equal: every rank alike
            assert r["estimate"] == r["meter"], r
            assert r["comm"] == r["plain_comm"] + r["estimate"], r


def test_estimate_counts_the_owners_exchanges_two_ranks():
    _check(run_ranks(measure, 2, CASES, timeout=300.0))


@pytest.mark.slow
def test_estimate_counts_the_owners_exchanges_stage1_and_offload():
    _check(run_ranks(measure, 2, MORE, timeout=300.0))


@pytest.mark.slow
def test_estimate_counts_the_owners_exchanges_hybrid():
    """Hybrid 2 x 2: the exchanges run within each shard group of 2."""
    _check(run_ranks(measure, 4, [dict(stage=2), dict(stage=3)], 2, timeout=600.0))


def test_a_count_takes_the_balanced_layout():
    """Without the model: 2 · 4 · M (N - 1) / N² (each rank's 1/N of every matrix), in
    ``comm_bytes`` and in plan's comm column; none at data parallel."""
    n, m = 4, 10 ** 6
    est = zk.estimate_memory(m, n, 2, optimizer="muon")
    adamw = zk.estimate_memory(m, n, 2)
    assert est.comm_matrix_bytes == round(2 * 4 * m * (n - 1) / n ** 2)
    assert est.comm_bytes == adamw.comm_bytes + est.comm_matrix_bytes
    assert zk.estimate_memory(m, n, 0, optimizer="muon").comm_matrix_bytes == 0
    from zkernels.plan import ladder_table
    kw = dict(param_dtype=None, reduce_dtype=None, grad_shard_dtype=None, bucket_bytes=None,
              device_bytes=None, headroom=0.0)
    rows, _ = ladder_table(m, n, optimizer="muon", **kw)
    base, _ = ladder_table(m, n, **kw)
    assert [r.comm_bytes - a.comm_bytes for r, a in zip(rows, base)] == \
        [0] + [est.comm_matrix_bytes] * (len(rows) - 1)


def test_param_groups_need_the_model():
    with pytest.raises(ValueError, match="param_groups needs the model"):
        zk.estimate_memory(10 ** 6, 2, 2, param_groups=[{"params": []}])
    model = b.make_model(0)
    with pytest.raises(TypeError, match="param_groups must be a list of dicts"):
        zk.estimate_memory(model, 2, 2, param_groups={"params": list(model.parameters())})
    with pytest.raises(ValueError, match=r"param_groups\[0\]"):
        zk.estimate_memory(model, 2, 2, param_groups=[
            {"params": list(model.parameters()), "optimizer": torch.optim.LBFGS}])
