"""A torch.optim class's state through zkernels.checkpoint (issue 26 item 6): saved per
parameter (name, global range, state key) at 2 ranks stage 2, it resumes at 1 rank at stage
3 and with CPU offload as if never stopped (SGD nesterov + Adagrad groups); the state is
really restored (a resume with zeroed state differs); another optimizer's checkpoint is
refused by name."""
import json
import os

import pytest
import torch

import zkernels as zk
from tests._dist import run_ranks
from tests.conftest import tol
from tests.zero import _optim_checks as oc


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("optim_ckpt") / "ck")
    return folder, [torch.tensor(p) for p in
                    run_ranks(oc.save_then_continue, 2, folder, timeout=300.0)[0]]


def _single(fn, *args):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(0, 1, *args)
    finally:
        torch.set_num_threads(threads)


def test_saved_per_parameter_with_state_keys(saved):
    folder, _ = saved
    with open(os.path.join(folder, "manifest.json")) as f:
        m = json.load(f)
    assert [g.get("optimizer") for g in m["param_groups"]] == ["SGD", "Adagrad"]
    sgd = m["params"]["0.weight"]["pieces"]
    assert len(sgd) == 2 and all(p["fields"] == ["master", "momentum_buffer"] for p in sgd)
    ada = m["params"]["2.weight"]["pieces"]
    assert all(p["fields"] == ["master", "sum"] and p["scalars"] == {"step": 3.0} for p in ada)


@pytest.mark.parametrize("stage, offload", [(3, None), (2, "cpu"), (1, None)])
def test_resumes_at_another_world_size_and_stage(saved, stage, offload):
    folder, uninterrupted = saved
    got = _single(oc.resume, folder, stage, offload)
    for p, q in zip(got, uninterrupted):
        torch.testing.assert_close(p, q, **tol(torch.float32))


def test_zeroed_state_is_noticed(saved, tmp_path):
    """The check can fail: the same resume with the saved momentum and sums zeroed (the
    manifest's pieces rewritten to read a zero field) ends elsewhere."""
    folder, uninterrupted = saved
    m = oc.model(seed=7)
    opt = zk.ZeroOptimizer(m, stage=2, param_groups=oc.groups(m), **oc.KW)
    zk.checkpoint.load(opt, folder)
    for rec in opt.shard_update.states:
        for t in rec.rule.flat.values():
            t.zero_()
    for s in range(oc.STEPS, 2 * oc.STEPS):
        oc.train(m, opt, s, 0, 1)
    got = oc.params(m, opt)
    assert max((p - q).abs().max().item() for p, q in zip(got, uninterrupted)) > 1e-5


def test_another_optimizer_refused_by_name(saved):
    folder, _ = saved
    m = oc.model()
    opt = zk.ZeroOptimizer(m, stage=2, param_groups=oc.groups(m), optimizer="rmsprop")
    with pytest.raises(zk.checkpoint.IncompatibleCheckpointError,
                       match=r"param_groups\[0\] was saved with SGD's state but runs RMSprop"):
        zk.checkpoint.load(opt, folder)
    adamw = zk.ZeroOptimizer(oc.model(), stage=2)
    with pytest.raises(zk.checkpoint.IncompatibleCheckpointError, match="saved with SGD's"):
        zk.checkpoint.load(adamw, folder)
