"""ZeroTrainer with TrainingArguments(deepspeed=...) (read through
zkernels.integrations.deepspeed.read_config, transformers' own DeepSpeed set-up undone), and
fine-tuning a meta-device model from a pretrained folder with save_model through
zk.checkpoint.save_pretrained. Rank side: _trainer_ds_checks.py."""
import copy
import warnings

import pytest
import torch

pytest.importorskip("transformers", minversion="5")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")   # TrainingArguments(deepspeed=...) imports it

from tests._dist import run_ranks  # noqa: E402
from tests.integrations._trainer_ds_checks import ZERO2, ZERO3, deepspeed_parity  # noqa: E402
from tests.zero._hf_checks import make_hf  # noqa: E402


@pytest.mark.slow   # four Trainer runs on 2 ranks
@pytest.mark.timeout(600)
def test_deepspeed_config_file_trains_like_zero_config(tmp_path):
    """transformers' zero2 and zero3 configs (every "auto" filled from the arguments) as a
    file in TrainingArguments(deepspeed=path), on 2 ranks: each step's loss and grad norm and
    the final weights equal ZeroTrainer with zero_config={"stage": s}."""
    out = run_ranks(deepspeed_parity, 2, str(tmp_path), timeout=540.0)
    assert out[0] == out[1] and sorted(out[0]) == [2, 3]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_catches_a_config_read_wrongly(tmp_path):
    """The comparison above fails when the config is not what the oracle runs: a zero2 file
    whose gradient_clipping is off (0.0: no contradiction with max_grad_norm would be
    refused, so the arguments say 0.0 too, while the oracle clips at 0.5)."""
    from tests.integrations import _trainer_ds_checks as checks
    ds = dict(copy.deepcopy(ZERO2), gradient_clipping=0.0)
    case = [(2, ds, {}, {"bucket_bytes": checks.BUCKET})]
    with pytest.raises(AssertionError, match=r"zero2, step \d+ (loss|norm)"):
        run_ranks(_unclipped_parity, 2, str(tmp_path), case, timeout=280.0)


def _unclipped_parity(rank, ws, tmp, case):
    """deepspeed_parity with the DeepSpeed side's max_grad_norm 0 (its config's clipping 0),
    the oracle's 0.5: must differ."""
    from tests.integrations import _trainer_checks, _trainer_ds_checks
    real = _trainer_checks.training_args

    def args(out, ws=2, **kw):
        if kw.get("deepspeed"):
            kw["max_grad_norm"] = 0.0
        return real(out, ws, **kw)
    _trainer_ds_checks.training_args = args
    return _trainer_ds_checks.deepspeed_parity(rank, ws, tmp, case)


def _args(tmp_path, **kw):
    from transformers import TrainingArguments
    base = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True, learning_rate=3e-3,
                weight_decay=0.1, warmup_steps=2, max_grad_norm=0.5)
    base.update(kw)
    return TrainingArguments(**base)


def test_deepspeed_keys_refused_by_name(tmp_path):
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    from zkernels.integrations.transformers import ZeroTrainer
    for bad, match in [({"activation_checkpointing": {"partition_activations": True}},
                        "activation_checkpointing"),
                       ({"zero_optimization": dict(ZERO3["zero_optimization"], bogus=1)},
                        "zero_optimization.bogus"),
                       ({"gradient_clipping": 2.0}, "gradient_clipping=2.0 contradicts"),
                       ({"optimizer": {"type": "Lamb", "params": {}}}, "optimizer.type")]:
        ds = dict(copy.deepcopy(ZERO3), **bad)
        with pytest.raises(ValueError, match=match):
            ZeroTrainer(model=make_hf("llama"), args=_args(tmp_path, deepspeed=ds))
        assert not is_deepspeed_zero3_enabled()   # from_pretrained no longer uses zero.Init
    with pytest.raises(ValueError, match="both"):
        ZeroTrainer(model=make_hf("llama"), args=_args(tmp_path, deepspeed=ZERO2),
                    zero_config={"stage": 2})
    model = make_hf("llama")
    model.lm_head.weight.ds_id = 7   # what DeepSpeed's zero.Init leaves on a parameter
    with pytest.raises(ValueError, match="'lm_head.weight' was partitioned by DeepSpeed"):
        ZeroTrainer(model=model, args=_args(tmp_path, deepspeed=ZERO3))


def test_deepspeed_optimizer_and_scheduler_blocks(tmp_path):
    """The optimizer block: AdamW over one group of every trainable parameter with the
    arguments' weight decay (as DeepSpeed builds it); the scheduler block: DeepSpeed's
    WarmupDecayLR with "auto" from the arguments and the step count. A DeepSpeed config given
    as zero_config is read the same way."""
    from zkernels.integrations.deepspeed import build_scheduler
    from zkernels.integrations.transformers import ZeroTrainer
    ds = dict(copy.deepcopy(ZERO3), scheduler={
        "type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                            "warmup_num_steps": "auto",
                                            "total_num_steps": "auto", "warmup_type": "linear"}})
    for trainer in (ZeroTrainer(model=make_hf("llama"), args=_args(tmp_path, deepspeed=ds)),
                    ZeroTrainer(model=make_hf("llama"), args=_args(tmp_path), zero_config=ds)):
        opt = trainer.create_optimizer()
        assert opt.stage == 3 and len(opt.param_groups) == 1
        assert opt.param_groups[0]["weight_decay"] == 0.1 and opt.param_groups[0]["lr"] == 3e-3
        assert opt.max_grad_norm == 0.5
        sched = trainer.create_scheduler(num_training_steps=10)
        ref = build_scheduler(torch.optim.SGD([torch.zeros(1)], lr=3e-3), {
            "type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                                                "warmup_num_steps": 2, "total_num_steps": 10,
                                                "warmup_type": "linear"}})
        with warnings.catch_warnings():   # stepped without optimizer steps, on purpose
            warnings.filterwarnings("ignore", ".*lr_scheduler.step.*before.*optimizer.step")
            for _ in range(10):
                assert sched.get_last_lr() == ref.get_last_lr()
                sched.step()
                ref.step()
        assert sched.get_last_lr() != [3e-3]
        opt.close()


@pytest.mark.timeout(400)
@pytest.mark.parametrize("stage", [3])
def test_meta_model_fine_tunes_from_pretrained_and_saves(tmp_path, stage):
    """A model built on the meta device, ZeroTrainer(pretrained=folder) on 2 ranks: evaluates,
    trains, checkpoints and saves like ZeroTrainer over from_pretrained(folder); save_model
    (called by Trainer at each checkpoint and by the script at the end, on every rank) writes
    a folder from_pretrained loads, beside the checkpoints. Bounded: a rank left out of
    save_pretrained's gathers fails the run instead of hanging it."""
    from tests.integrations._trainer_ds_checks import pretrained_flow
    pre = tmp_path / "pretrained"
    make_hf("llama", seed=3).save_pretrained(pre)
    out = run_ranks(pretrained_flow, 2, str(tmp_path), str(pre), stage, timeout=360.0)
    assert out[0] == out[1] and len(out[0]) == 4


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_deepspeed_distributed_state_is_reset(tmp_path):
    """Without use_cpu (as on GPUs) transformers makes a DEEPSPEED distributed state;
    ZeroTrainer resets it and trains on the same gloo group."""
    from tests.integrations._trainer_ds_checks import deepspeed_state_undone
    out = run_ranks(deepspeed_state_undone, 2, str(tmp_path), timeout=280.0)
    # (each rank logs its own loss: off use_cpu on this CPU machine Accelerate's state is
    # single-process, with or without deepspeed, so Trainer neither shards nor averages)
    assert len(out[0]) == len(out[1]) == 4


def test_pretrained_goes_into_a_given_optimizer_once(tmp_path):
    """pretrained= with optimizers=(a ZeroOptimizer, None): loaded into that optimizer when
    Trainer first asks for it (here evaluate's materialize step), not again on the next
    create_optimizer (train() calls it), so training state is not overwritten. One process."""
    from zkernels import ZeroOptimizer
    from zkernels.integrations.transformers import ZeroTrainer
    pre = tmp_path / "pretrained"
    source = make_hf("llama", seed=3)
    source.save_pretrained(pre)
    model = make_hf("llama", seed=0)
    opt = ZeroOptimizer(model, stage=2, lr=1e-3)
    trainer = ZeroTrainer(model=model, args=_args(tmp_path), optimizers=(opt, None),
                          pretrained=pre)
    trainer._materialize()
    for n, p in model.named_parameters():
        assert torch.equal(p, source.get_parameter(n)), n
    with torch.no_grad():
        next(model.parameters()).add_(1.0)   # stands for a training step
    assert trainer.create_optimizer() is opt
    assert not torch.equal(next(model.parameters()), next(source.parameters()))
    opt.close()
