"""Issue 29's model shapes at stages 1-3 on gloo ranks against single-process AdamW (the
oracle of ``_shapes.py``): a dataclass / namedtuple / nested dict passed between blocks and
returned; a parameter read outside its unit (the parent's ``F.linear`` on a block's weight,
an L2 penalty on ``head.weight`` in the training loop) works inside ``opt.gathered()`` and
otherwise raises an error naming the parameter; a plain read between steps raises, by name,
while metadata, ``opt.gathered()`` and ``state_dict()`` keep working; a mixture-of-experts
block routed per rank trains as one unit (``units=``), and split into units fails with the
divergent-path error that says so. World size 2 in the quick suite, 4 in the slow one."""
from __future__ import annotations

from functools import partial

import pytest
import torch

import zkernels as zk
from zkernels.zero.parameters.freed_guard import FreedParameterError

from tests.zero import _shapes as S
from tests.zero._harness import rank_fixture

BODIES = {}
for _st in (1, 2, 3):
    BODIES[f"dataclass-s{_st}"] = partial(S._parity_body, S.DCModel, _st)
    BODIES[f"external-gathered-s{_st}"] = partial(S._parity_body, S.ExternalModel, _st,
                                                  gathered=True)
    BODIES[f"penalty-gathered-s{_st}"] = partial(S._parity_body, S.PlainModel, _st,
                                                 penalty=True, gathered=True)
    BODIES[f"moe-units-s{_st}"] = partial(S._parity_body, S.MoEModel, _st, units=S.moe_units)
    BODIES[f"plain-read-s{_st}"] = partial(S._plain_body, _st)
for _st in (1, 2):  # stages 1-2 keep every parameter whole: these just train
    BODIES[f"external-s{_st}"] = partial(S._parity_body, S.ExternalModel, _st)
    BODIES[f"penalty-s{_st}"] = partial(S._parity_body, S.PlainModel, _st, penalty=True)
BODIES["external-error-s3"] = partial(S._error_body, S.ExternalModel, 3)
BODIES["penalty-error-s3"] = partial(S._error_body, S.PlainModel, 3, penalty=True)
BODIES["moe-split-error-s3"] = partial(S._error_body, S.MoEModel, 3, units=S.linear_units)

ranks = rank_fixture(BODIES, timeout=600.0)
WS = [2, pytest.param(4, marks=pytest.mark.slow)]
SLOW = pytest.mark.slow
# The quick suite runs stage 3's rows at 2 ranks (what issue 29 found broken); stages 1-2,
# which keep every parameter whole, and 4 ranks run in the full suite.
PARITY = [r if r.endswith("s3") else pytest.param(r, marks=SLOW) for r in BODIES
          if r.startswith(("dataclass", "external-", "penalty-", "moe-units"))
          and "error" not in r]


@pytest.mark.parametrize("world_size", WS)
@pytest.mark.parametrize("row", PARITY)
def test_parity(ranks, world_size, row):
    for rank, res in enumerate(ranks(row, world_size)):
        assert res["worst"] <= 1.0, (rank, res)


@pytest.mark.parametrize("world_size", WS)
@pytest.mark.parametrize("row, name", [("external-error-s3", "blocks.0.fc.weight"),
                                       ("penalty-error-s3", "head.weight")])
def test_read_outside_unit_names_parameter(ranks, world_size, row, name):
    for msg in ranks(row, world_size):
        assert msg.startswith("FreedParameterError"), msg
        assert f"parameter {name!r}" in msg and "opt.gathered()" in msg, msg


@pytest.mark.parametrize("world_size", WS)
@pytest.mark.parametrize("row", ["moe-split-error-s3"])  # a row parameter: one spawn for all
def test_per_rank_experts_split_into_units_say_units(ranks, world_size, row):
    for msg in ranks(row, world_size):
        assert "ranks disagree on what comes next" in msg and "units=" in msg, msg
        assert "mixture-of-experts" in msg, msg


@pytest.mark.parametrize("world_size", WS)
@pytest.mark.parametrize("row", [pytest.param("plain-read-s1", marks=SLOW),
                                 pytest.param("plain-read-s2", marks=SLOW), "plain-read-s3"])
def test_plain_read_between_steps(ranks, world_size, row):
    stage = int(row[-1])
    results = ranks(row, world_size)
    for res in results:
        assert res["shape"] == (S.D, S.D) and res["requires_grad"]
        assert res["gathered_sum"] == res["state_dict_sum"]
        assert res["after"] != res["gathered_sum"]  # it trained on after the reads
        if stage == 3:
            assert isinstance(res["sum"], str) and "FreedParameterError" in res["sum"], res
            assert "parameter 'head.weight'" in res["sum"], res
            assert res["numel"] == 0  # metadata still answers: the shard-free stand-in
        else:
            assert res["sum"] == res["gathered_sum"]
    assert len({r["gathered_sum"] for r in results}) == 1  # every rank gathered the same


def test_no_op_moves_of_a_freed_model_pass_real_moves_raise():
    """``model.cpu()`` / ``.to("cpu")`` where a stage-3 model already is (Lightning's
    teardown does it) are no-ops that pass the freed-parameter guard; a real move (to
    float64) would move the empty stand-ins, so it raises naming the parameter."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = zk.ZeroOptimizer(model, stage=3, ops_backend="reference")
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    model.cpu()
    model.to("cpu")
    with pytest.raises(FreedParameterError, match=r"parameter '0\.weight'"):
        model.double()
    with opt.gathered():
        assert model[0].weight.shape == (4, 4)
