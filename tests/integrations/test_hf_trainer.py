"""ZeroTrainer (zkernels.integrations.transformers) on 2 gloo ranks with a tiny Llama: the loss
and gradient norm of every step and the final parameters equal transformers.Trainer with DDP +
AdamW at every stage and with offload (accumulation, clipping, LR schedule included), fp16
trains through opt.backward, and a checkpoint saved at 2 ranks resumes at 1 rank on the same
curve; save_model loads with from_pretrained. Rank side: _trainer_checks.py."""
import os

import pytest
import torch

pytest.importorskip("transformers", minversion="5")  # ZeroTrainer needs Trainer 5's hooks
pytest.importorskip("accelerate")

from tests._dist import run_ranks  # noqa: E402
from tests._stages import ALL_STAGES  # noqa: E402
from tests.conftest import tol  # noqa: E402
from tests.integrations._trainer_checks import (STEPS, battery, rung_name,  # noqa: E402
                                                trainer_resume, trainer_save)


@pytest.mark.timeout(600)
def test_zero_trainer_matches_trainer_with_ddp(tmp_path):
    """Every stage, and the offload rungs (stage 2 with the optimizer states in host RAM,
    stage 3 with the parameter shards there too)."""
    rungs = [{"stage": s} for s in ALL_STAGES] + [{"stage": 2, "offload": "cpu"},
                                                  {"stage": 3, "offload": "cpu",
                                                   "offload_params": True}]
    per_rank = run_ranks(battery, 2, rungs, str(tmp_path), timeout=540.0)
    out = per_rank[0]
    assert sorted(k for k in out if k.startswith("stage")) == sorted(map(rung_name, rungs))
    assert per_rank[1] == out   # every rank logs the same world-mean losses
    assert len(out["ddp"]) == STEPS and out["ddp"][STEPS] != out["ddp"][1]


@pytest.mark.timeout(600)
def test_zero_trainer_honours_optim(tmp_path):
    """TrainingArguments.optim="sgd" (momentum and nesterov from optim_args, as Trainer reads
    them): ZeroTrainer runs torch.optim.SGD on the shards and matches Trainer with DDP + SGD
    step for step (the class, its keywords and the groups' weight decay are Trainer's)."""
    from tests.integrations._trainer_checks import trainer_parity
    per_rank = run_ranks(trainer_parity, 2, [{"stage": 2}], str(tmp_path),
                         {"optim": "sgd", "optim_args": "momentum=0.9,nesterov=true",
                          "learning_rate": 0.05}, timeout=540.0)
    out = per_rank[0]
    assert len(out["ddp"]) == STEPS and out["ddp"][STEPS] != out["ddp"][1]


@pytest.mark.slow  # two Trainer runs and a resume (other world sizes: tests/checkpoint)
@pytest.mark.timeout(600)
def test_resume_at_another_world_size(tmp_path):
    """Stage 3 at 2 ranks, evaluated and checkpointed at steps 2 and 4 (the best one loaded at
    the end, saved and evaluated: see trainer_save); resumed from step 2 at 1 rank (twice
    the per-device batch: the same global batches), steps 3-4 repeat the 2-rank losses."""
    stage = max(ALL_STAGES)
    saved = run_ranks(trainer_save, 2, stage, str(tmp_path), timeout=300.0)[0]
    assert sorted(saved) == list(range(1, STEPS + 1))
    ckpt = tmp_path / "run" / "checkpoint-2"
    for name in ("zero", "model.safetensors", "config.json", "scheduler.pt",
                 "trainer_state.json"):
        assert (ckpt / name).exists(), sorted(os.listdir(ckpt))
    assert not (ckpt / "optimizer.pt").exists()   # the state is in zero/, sharded
    resumed = run_ranks(trainer_resume, 1, stage, str(tmp_path), str(ckpt), timeout=300.0)[0]
    assert sorted(resumed) == list(range(3, STEPS + 1)), resumed
    for step, loss in resumed.items():
        torch.testing.assert_close(loss, saved[step], **tol(torch.float32),
                                   msg=lambda m, s=step: f"step {s} after resuming: {m}")


def test_zero_config_errors(tmp_path):
    from zkernels.integrations.transformers import optimizer_kwargs, read_zero_config
    with pytest.raises(ValueError, match=r"\['lr'\].*learning_rate"):
        read_zero_config({"stage": 2, "lr": 1e-3})
    with pytest.raises(ValueError, match="reduce_dtype"):
        read_zero_config({"reduce_dtype": "int8"})
    with pytest.raises(TypeError, match="zero_config"):
        read_zero_config([("stage", 2)])
    path = tmp_path / "zero.json"
    path.write_text('{"stage": 3, "reduce_dtype": "bf16", "offload_config": {"pin_memory": false}}')
    cfg = read_zero_config(str(path))
    assert cfg["stage"] == 3 and cfg["reduce_dtype"] == torch.bfloat16
    assert cfg["offload_config"].pin_memory is False

    from transformers import TrainingArguments
    args = TrainingArguments(output_dir=str(tmp_path), optim="adafactor", report_to=[],
                             use_cpu=True)
    with pytest.raises(ValueError, match="optim.*'adafactor'"):
        optimizer_kwargs(args, {})
    # sgd, adagrad, rmsprop: the torch class on the shards, optim_args as its keywords
    args = TrainingArguments(output_dir=str(tmp_path), optim="sgd", report_to=[],
                             use_cpu=True, learning_rate=0.1,
                             optim_args="momentum=0.9,nesterov=true")
    kw = optimizer_kwargs(args, {})
    assert kw["optimizer"] is torch.optim.SGD and kw["lr"] == 0.1
    assert kw["momentum"] == 0.9 and kw["nesterov"] is True and "betas" not in kw
    # lion_32bit: the fused Lion, betas from adam_beta1/2 as Trainer's Lion takes them
    args = TrainingArguments(output_dir=str(tmp_path), optim="lion_32bit", report_to=[],
                             use_cpu=True, learning_rate=1e-4, adam_beta2=0.98)
    kw = optimizer_kwargs(args, {})
    assert kw["optimizer"] == "lion" and kw["betas"] == (0.9, 0.98) and "eps" not in kw
    for refused in ("lion_8bit", "paged_lion_32bit"):
        args = TrainingArguments(output_dir=str(tmp_path), optim=refused, report_to=[],
                                 use_cpu=True)
        with pytest.raises(ValueError, match=f"optim.*'{refused}'"):
            optimizer_kwargs(args, {})
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                             max_grad_norm=0.0, learning_rate=5e-4, weight_decay=0.01)
    kw = optimizer_kwargs(args, {"stage": 2})
    assert kw["max_grad_norm"] is None and kw["lr"] == 5e-4 and kw["config"].stage == 2
    assert kw["config"].precision.param_dtype is None and kw["weight_decay"] == 0.01

    from tests.zero._hf_checks import make_hf
    from zkernels.integrations.transformers import ZeroTrainer
    model = make_hf("llama")
    adamw = torch.optim.AdamW(model.parameters())
    with pytest.raises(TypeError, match="must be a zkernels.ZeroOptimizer.*AdamW"):
        ZeroTrainer(model=model, args=args, optimizers=(adamw, None))


@pytest.mark.parametrize("stage", list(ALL_STAGES))
def test_full_state_dict_is_the_model_state_dict(stage):
    """full_state_dict (what save_model writes): every key of model.state_dict(), bit-exact,
    a frozen parameter included (whether stage 3 shards it or not), tied keys one
    tensor. One process: no group, one rank."""
    from tests.zero._hf_checks import make_hf
    from zkernels import ZeroOptimizer
    from zkernels.integrations.transformers import full_state_dict
    model = make_hf("llama_tied")
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    opt = ZeroOptimizer(model, stage=stage)
    full = full_state_dict(opt)
    assert sorted(full) == sorted(expected)
    for k, v in expected.items():
        assert torch.equal(full[k], v), k
    assert full["lm_head.weight"] is full["model.embed_tokens.weight"]
    assert full_state_dict(opt, keep=False) is None
    opt.close()
