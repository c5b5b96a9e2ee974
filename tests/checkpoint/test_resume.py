"""Save at world size 2 (stage 2), resume at world sizes 1, 2 and 4, at every rung of the
ladder the optimizer implements, in fp32 and bf16: the resumed run continues as if it had
never stopped.

One spawn saves (fp32 and bf16 checkpoints); one spawn per world size runs every resume case
(each spawn pays a torch import per rank). Cases are parametrized over the ladder's rungs
(``zkernels.zero.planning.policy.RUNGS``, the stage registry), so a new rung is tested the day
it is registered; a rung the optimizer refuses fails.
"""
import os

import pytest
import torch

import zkernels as zk
from tests._dist import run_ranks
from tests.checkpoint import _ranks
from tests.conftest import tol
from zkernels.zero.planning.policy import RUNGS

WORLD_SIZES = (pytest.param(1, marks=pytest.mark.slow), 2,
               pytest.param(4, marks=pytest.mark.slow))  # 1 and 4 ranks: the full suite
CASES = [(stage, offload, dtype) for stage, offload in RUNGS for dtype in _ranks.DTYPES]
# Stage 3 with offload_params (the parameter shards in host RAM): the same checkpoints load.
CASES += [(3, "cpu+params", dtype) for dtype in _ranks.DTYPES] + [(3, "nvme+params", "bf16")]


def _in_process(fn, *args):
    """World size 1 without torch.distributed, one thread like the spawned ranks (see
    tests/zero/test_zero_ranks.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("ckpt"))
    uninterrupted = _ranks.tensors(run_ranks(_ranks.save_run, 2, folder, timeout=300.0)[0])
    return folder, uninterrupted


@pytest.fixture(scope="module")
def resumed(saved, tmp_path_factory):
    folder, _ = saved
    offload_root = str(tmp_path_factory.mktemp("offload"))
    cache = {}

    def get(ws, case):
        if ws not in cache:
            # Every rung of the ladder is implemented: one the optimizer refuses fails its
            # case (resume_battery reports the error), it is not skipped.
            if ws == 1:
                cache[ws] = [_in_process(_ranks.resume_battery, 0, 1, folder, CASES,
                                         offload_root)]
            else:
                cache[ws] = run_ranks(_ranks.resume_battery, ws, folder, CASES, offload_root,
                                      timeout=400.0)
        for r, per_rank in enumerate(cache[ws]):
            status, payload = per_rank[case]
            assert status == "ok", f"rank {r} of {ws}, case {case}:\n{payload}"
        return _ranks.tensors(cache[ws][0][case][1])

    return get


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"stage{c[0]}-{c[1] or 'device'}-{c[2]}")
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_resume(saved, resumed, world_size, case):
    stage, _, dtype = case
    _, uninterrupted = saved
    got = resumed(world_size, case)   # fp32: checked against torch.optim.AdamW in the ranks
    want = uninterrupted[dtype]
    same_run = world_size == want["saved_ws"] and stage == want["saved_stage"]
    for step, (a, b) in enumerate(zip(got["params"], want["params"])):
        for name in b:
            if same_run:
                # Same world size and stage: the same arithmetic in the same order, so the
                # resumed run is the uninterrupted one bit for bit (masters, moments, step
                # counts and the rounded compute copy all restored).
                assert torch.equal(a[name], b[name]), f"step {step}, {name}"
                assert a[name].dtype == torch.float32  # bf16 comes back widened, exactly
            elif dtype == "bf16":
                # bf16 trajectory: another world size or stage sums the gradients in another
                # order; tests/zero's bf16 tolerance for the compute parameters.
                torch.testing.assert_close(a[name].float(), b[name].float(),
                                           **tol(torch.bfloat16),
                                           msg=lambda m, n=name: f"step {step}, {n}: {m}")
            else:
                torch.testing.assert_close(a[name], b[name], **tol(torch.float32),
                                           msg=lambda m, n=name: f"step {step}, {n}: {m}")
    assert len(got["params"]) == _ranks.STEPS_AFTER
    if same_run:
        assert got["losses"] == want["losses"]


def test_consolidate_equals_state_dict(saved):
    """The consolidated fp32 checkpoint is the model's state_dict() at the save, bit for bit
    (every rank holds the full fp32 parameters after a step), and matches single-process
    AdamW's to round-off."""
    folder, uninterrupted = saved
    sd = zk.checkpoint.consolidate(os.path.join(folder, "fp32"))
    at_save = uninterrupted["fp32"]["at_save"]
    assert list(sd) == list(at_save)
    for key, t in at_save.items():
        assert torch.equal(sd[key], t), key
    model, _ = _ranks.build(0, stage=1, dtype="fp32", bucket_bytes=_ranks.SAVE_BUCKET)
    ref_loss, ref_params = _ranks.reference()[_ranks.STEPS_BEFORE - 1]
    assert list(sd) == list(model.state_dict())           # every key, in order, tied included
    assert sd["head.weight"] is sd["wte.weight"]
    assert torch.equal(sd["seen"], torch.full((3,), _ranks.STEPS_BEFORE))
    for name, p in ref_params.items():
        torch.testing.assert_close(sd[name], p, **tol(torch.float32), msg=name)
    model.load_state_dict(sd)  # strict: the keys and shapes fit
    # bf16 run: the consolidated weights are the fp32 masters, not the rounded compute copy.
    sd16 = zk.checkpoint.consolidate(os.path.join(folder, "bf16"))
    assert sd16["wte.weight"].dtype == torch.float32
    assert not torch.equal(sd16["wte.weight"], sd16["wte.weight"].bfloat16().float())
    assert zk.checkpoint.consolidate(os.path.join(folder, "bf16"),
                                     dtype="bf16")["wte.weight"].dtype == torch.bfloat16
