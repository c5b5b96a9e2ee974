"""zkernels.integrations.lightning.ZeroStrategy on 2 gloo ranks with the harness GPT: the loss
of every micro-batch equals Lightning's own DDPStrategy with the same AdamW (two param groups,
a LambdaLR schedule) at stages 1-3, with accumulate_grad_batches=2 and gradient_clip_val;
bf16-mixed stays within bf16's tolerance; a ModelCheckpoint folder saved at 2 ranks resumes at
1 rank on the uninterrupted curve. Rank side: _lightning_checks.py."""
import os

import pytest
import torch

pytest.importorskip("lightning")

from tests._dist import run_ranks  # noqa: E402
from tests._stages import ALL_STAGES  # noqa: E402
from tests.conftest import tol  # noqa: E402
from tests.integrations._lightning_checks import (MICRO_BATCH, STEPS, battery,  # noqa: E402
                                                  resume_at, save_then_resume_rows)

ACC = {"max_epochs": 1, "accumulate_grad_batches": 2, "gradient_clip_val": 0.05}
PLAIN = {"max_epochs": 1}


def _assert_curve(got, want, what, **tolerance):
    assert len(got) == len(want), (what, len(got), len(want))
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                               torch.tensor(want, dtype=torch.float64), **tolerance,
                               msg=lambda m: f"{what}: {m}")


@pytest.mark.timeout(300)
def test_zero_strategy_matches_ddp_strategy():
    """fp32: every stage's losses equal DDP's to fp32 round-off; then accumulation over 2
    micro-batches with norm clipping (0.05 clips every step here: the grad norm is ~1) at
    stage 2 against DDP with the same Trainer arguments."""
    rows = {"ddp": ({"kind": "ddp"}, PLAIN), "ddp_acc": ({"kind": "ddp"}, ACC)}
    rows.update({f"stage{s}": ({"kind": "zero", "stage": s}, PLAIN) for s in ALL_STAGES})
    rows["stage2_acc"] = ({"kind": "zero", "stage": 2}, ACC)
    out = run_ranks(battery, 2, rows, timeout=280.0)[0]
    ddp, ddp_acc = out["ddp"], out["ddp_acc"]
    assert ddp["global_step"] == 2 * STEPS and ddp_acc["global_step"] == STEPS
    assert ddp["losses"] != ddp_acc["losses"]   # the rows differ: the checks can fail
    for s in ALL_STAGES:
        row = out[f"stage{s}"]
        assert row["global_step"] == ddp["global_step"]
        _assert_curve(row["losses"], ddp["losses"], f"stage {s}", **tol(torch.float32))
        assert row["lr"] == ddp["lr"]    # the LambdaLR schedule drove our param groups
    _assert_curve(out["stage2_acc"]["losses"], ddp_acc["losses"], "stage 2, accumulation 2 "
                  "+ clipping", **tol(torch.float32))


@pytest.mark.slow   # the quick suite's Lightning parity row is AdamW's
@pytest.mark.timeout(300)
def test_torch_optimizer_class_matches_ddp_strategy():
    """configure_optimizers returns torch.optim.SGD (momentum, nesterov, two groups' weight
    decay, the LambdaLR): ZeroStrategy runs the class on the stage-3 shards and every
    micro-batch's loss equals DDPStrategy's with the same SGD to fp32 round-off."""
    rows = {"ddp": ({"kind": "ddp"}, PLAIN), "stage3": ({"kind": "zero", "stage": 3}, PLAIN)}
    out = run_ranks(battery, 2, rows, "sgd", timeout=280.0)[0]
    ddp, zero = out["ddp"], out["stage3"]
    assert ddp["global_step"] == zero["global_step"] == 2 * STEPS
    assert abs(ddp["losses"][-1] - ddp["losses"][0]) > 1e-2   # SGD moved the loss
    _assert_curve(zero["losses"], ddp["losses"], "stage 3, SGD", **tol(torch.float32))
    assert zero["lr"] == ddp["lr"]


# [Note: bf16-mixed against fp32 DDP]
# bf16-mixed here is DeepSpeed's meaning: bf16 parameters and activations (8 significant
# bits, a relative rounding error of 2**-9 ~ 2e-3 per operation) with fp32 master shards and
# fp32 AdamW. The tiny GPT's loss (~4.6, a log-softmax over 97 classes) goes through ~10
# rounded matmul/norm stages, whose errors add up to a few 2**-9 in the logits and much less
# in their mean cross-entropy; the fp32 master keeps the parameters from drifting further over
# 8 steps. rtol 2e-2 is ~10 roundings of bf16 on the loss, and far below the loss's own change
# over the run; the run must also differ from fp32 (it really computed in bf16).
BF16_RTOL = 2e-2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bf16_mixed_within_tolerance():
    rows = {"ddp": ({"kind": "ddp"}, PLAIN),
            "bf16": ({"kind": "zero", "stage": 3}, dict(PLAIN, precision="bf16-mixed"))}
    out = run_ranks(battery, 2, rows, timeout=280.0)[0]
    _assert_curve(out["bf16"]["losses"], out["ddp"]["losses"], "bf16-mixed stage 3",
                  rtol=BF16_RTOL, atol=0.0)
    assert out["bf16"]["losses"] != out["ddp"]["losses"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_checkpoint_at_2_ranks_resumes_at_1(tmp_path):
    """Stage 3 at 2 ranks: ModelCheckpoint writes a zkernels folder at the end of epoch 1;
    fit(ckpt_path=...) at 1 rank with twice the batch (the same global batches) runs epoch 2
    with the uninterrupted 2-rank run's losses."""
    stage = 3
    out = run_ranks(save_then_resume_rows, 2, stage, str(tmp_path), timeout=300.0)[0]
    assert out["files"] == [f"epoch=0-step={2 * STEPS}.ckpt"], out["files"]
    ckpt = tmp_path / "ckpt" / out["files"][0]
    assert (ckpt / "manifest.json").exists() or any(ckpt.iterdir())
    resumed = run_ranks(resume_at, 1, stage, str(ckpt), 2 * MICRO_BATCH, timeout=300.0)[0]
    second_epoch = out["full"]["losses"][2 * STEPS:]
    _assert_curve(resumed["losses"], second_epoch, "epoch 2 resumed at 1 rank",
                  **tol(torch.float32))
    assert resumed["global_step"] == out["full"]["global_step"]
    assert second_epoch != out["saved"]["losses"]   # epoch 2 is not epoch 1 again


def test_refusals():
    from zkernels.integrations.lightning import ZeroPrecision, ZeroStrategy, zero_param_groups
    with pytest.raises(ValueError, match=r"\['lr'\].*configure_optimizers"):
        ZeroStrategy(stage=2, lr=1e-3)
    with pytest.raises(ValueError, match="max_grad_norm.*gradient_clip_val"):
        ZeroStrategy(max_grad_norm=1.0)
    with pytest.raises(ValueError, match="not ZeroOptimizer arguments"):
        ZeroStrategy(stages=3)
    with pytest.raises(ValueError, match="bf16-true"):
        ZeroPrecision("bf16-true")
    p = [torch.nn.Parameter(torch.ones(3))]
    # a class the fused AdamW does not compute runs itself on the shards
    for torch_opt in (torch.optim.SGD(p, lr=0.1, momentum=0.9),
                      torch.optim.AdamW(p, amsgrad=True), torch.optim.Adam(p, weight_decay=0.1)):
        (group,) = zero_param_groups(torch_opt)
        assert group["optimizer"] is type(torch_opt)
        assert {k: v for k, v in group.items() if k not in ("optimizer", "params")} == \
            {k: v for k, v in torch_opt.param_groups[0].items() if k != "params"}
    with pytest.raises(ValueError, match="LBFGS is refused"):
        zero_param_groups(torch.optim.LBFGS(p))
    with pytest.raises(TypeError, match="torch.optim.Optimizer, got builtins.dict"):
        zero_param_groups({"params": p})
    groups = zero_param_groups(torch.optim.AdamW(p, lr=0.5, betas=(0.8, 0.9), eps=1e-7,
                                                 weight_decay=0.2))
    assert {k: groups[0][k] for k in ("lr", "betas", "eps", "weight_decay")} == \
        {"lr": 0.5, "betas": (0.8, 0.9), "eps": 1e-7, "weight_decay": 0.2}


def test_value_clipping_refused_in_the_ranks():
    import lightning.pytorch as pl

    from zkernels.integrations.lightning import ZeroStrategy
    trainer = pl.Trainer(strategy=ZeroStrategy(), accelerator="cpu", devices=1, logger=False,
                         gradient_clip_val=1.0, gradient_clip_algorithm="value",
                         enable_progress_bar=False, enable_model_summary=False)
    from tests.integrations._lightning_checks import _data, module_class
    env = dict(os.environ)
    try:
        with pytest.raises(ValueError, match="gradient_clip_algorithm='value'"):
            trainer.fit(module_class()(1), torch.utils.data.DataLoader(_data(), batch_size=2))
    finally:   # Lightning set up a one-rank process group and its env in this process
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(env)
