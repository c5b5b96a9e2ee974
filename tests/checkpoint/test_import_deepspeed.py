"""zk.checkpoint.import_deepspeed: a DeepSpeed ZeRO 1-3 checkpoint starts a zkernels run at
another world size and stage; a file that pickles anything outside the allow-list is refused.

[Note: the tolerance of a continued DeepSpeed curve]
The imported state is data movement: the fp32 masters must equal ``zero_to_fp32``'s
consolidation bit for bit, and the moments and step count are carried the same way. The
losses after the import are arithmetic: DeepSpeed (2 ranks) and we (4 ranks) reduce the
same global-batch gradient in a different order, so each AdamW step differs by fp32
round-off of the mean (a few ulps), amplified over 3 steps by lr / sqrt(v) of order 1;
rel 1e-5 (as tests/integrations/test_deepspeed.py) is far above that and far below the
change a lost moment or step count makes (a fresh AdamW's first step moves every weight by
~lr, changing the loss in the second significant digit: the negative below checks it).
"""
import argparse
import os

import numpy as np
import pytest
import torch

from tests._dist import run_ranks
from zkernels.checkpoint import NotACheckpointError, UnsafeCheckpointError, import_deepspeed
from zkernels.checkpoint._safe_pickle import load_pt


def test_unexpected_pickled_type_refused_by_name(tmp_path):
    tag = tmp_path / "global_step1"
    tag.mkdir()
    (tmp_path / "latest").write_text("global_step1")
    torch.save({"optimizer_state_dict": {"zero_stage": 2}, "args": argparse.Namespace(lr=1)},
               tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"argparse\.Namespace"):
        import_deepspeed(object(), str(tmp_path))
    # The allow-list itself: a plain file loads, a tensor subclass's rebuild is refused too.
    torch.save({"a": [1, (2.0, "x")], "t": torch.ones(2)}, tmp_path / "plain.pt")
    assert load_pt(str(tmp_path / "plain.pt"))["a"] == [1, (2.0, "x")]


def test_missing_latest_and_tag(tmp_path):
    with pytest.raises(NotACheckpointError, match="latest"):
        import_deepspeed(object(), str(tmp_path))
    with pytest.raises(NotACheckpointError, match="global_step9"):
        import_deepspeed(object(), str(tmp_path), tag="global_step9")


def _zero_to_fp32(ckpt):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    return {k: v.float() for k, v in get_fp32_state_dict_from_zero_checkpoint(ckpt).items()}


def _deepspeed(tmp_path, stage, monkeypatch):
    pytest.importorskip("deepspeed")   # the reference; not a zkernels dependency
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from tests.checkpoint._peer_ranks import deepspeed_run
    ckpt = str(tmp_path / f"ds-zero{stage}")
    losses = run_ranks(deepspeed_run, 2, stage, ckpt, 3, timeout=600, check_teardown=False)
    return ckpt, np.mean(losses, axis=0)


def _ours(ckpt, stage, world):
    from tests.checkpoint._peer_ranks import zkernels_resume
    return run_ranks(zkernels_resume, world, stage, ckpt, 3, timeout=600)


def _check_import(ckpt, out):
    want = _zero_to_fp32(ckpt)
    got = out[0]["masters"]
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(torch.from_numpy(got[k]), want[k]), k
    for r in out:
        assert r["returned"]["global_steps"] == 3 and r["returned"]["tag"] == "global_step3"
        assert r["returned"]["lr_scheduler"] == {"last_batch_iteration": 2}
        assert {step for step, _ in r["pieces"].values()} == {3}


@pytest.mark.slow
def test_zero2_on_2_ranks_continues_at_stage3_on_4(tmp_path, monkeypatch):
    ckpt, ds_losses = _deepspeed(tmp_path, 2, monkeypatch)
    out = _ours(ckpt, 3, 4)
    _check_import(ckpt, out)
    # The moments: the importing rank's pieces hold DeepSpeed's exp_avg_sq (never zero
    # after 3 steps of nonzero gradients) and the curve continues DeepSpeed's.
    assert all((f["exp_avg_sq"] > 0).all() for r in out for _, f in r["pieces"].values())
    ours = np.mean([r["losses"] for r in out], axis=0)
    assert ours == pytest.approx(ds_losses[3:], rel=1e-5)
    assert all(r["global_steps"] == 6 for r in out)
    # catches a lost moment or step count: a fresh AdamW from the same masters departs.
    fresh = _fresh_losses(ckpt)
    assert fresh != pytest.approx(ds_losses[4:], rel=1e-3)


def _fresh_losses(ckpt):
    """The same continuation from zero_to_fp32's weights with fresh AdamW state (single
    process, torch.optim), to show the curve check would fail without the moments."""
    from tests.checkpoint._peer_ranks import GLOBAL, STEPS, batches
    from tests.integrations._ds_script import _model
    import torch.nn.functional as F
    model = _model(1)
    model.load_state_dict(_zero_to_fp32(ckpt))
    opt = torch.optim.AdamW(model.parameters(), lr=0.007, betas=(0.9, 0.99), eps=1e-8,
                            weight_decay=0.01)
    losses = []
    for x, y in batches()[3:STEPS]:
        loss = F.mse_loss(model(x[:GLOBAL]), y[:GLOBAL])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses[1:]


@pytest.mark.slow
# (world sizes dividing GLOBAL: every world size trains on the same global batch)
@pytest.mark.parametrize("stage,ours,world", [(1, 2, 4), (3, 1, 1)])
def test_zero1_and_zero3_checkpoints_import(tmp_path, monkeypatch, stage, ours, world):
    ckpt, ds_losses = _deepspeed(tmp_path, stage, monkeypatch)
    assert os.path.isfile(os.path.join(ckpt, "latest"))
    out = _ours(ckpt, ours, world)
    _check_import(ckpt, out)
    assert np.mean([r["losses"] for r in out], axis=0) == pytest.approx(ds_losses[3:],
                                                                        rel=1e-5)
