"""``"pin_memory": true`` where no GPU is present, as transformers' own DeepSpeed example
configs say it: ZeroTrainer(TrainingArguments(deepspeed=...)) warns once that the offloaded
memory is not pinned and trains exactly as with ``"pin_memory": false`` (DeepSpeed treats
pinning as a hint: [Note: pinning is a hint] in zkernels/zero/state/transfer.py). The configs
are the "ZeRO-2 Example" and "ZeRO-3 Example" of transformers' DeepSpeed integration docs
(docs/source/en/main_classes/deepspeed.md), verbatim: every "auto" filled from the arguments,
their WarmupLR scheduler and AdamW optimizer blocks included. One process, a tiny GPT-2 from a
config, three steps (DeepSpeed's WarmupLR keeps lr at
warmup_min_lr, 0, for the first two)."""
import json
import warnings

import pytest
import torch

pytest.importorskip("transformers", minversion="5")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")   # TrainingArguments(deepspeed=...) imports it

from tests.integrations._trainer_checks import TokenRows  # noqa: E402
from tests.zero._hf_checks import make_hf  # noqa: E402
from zkernels.zero.state.transfer import PIN_MEMORY_IGNORED, PinMemoryIgnored  # noqa: E402

# The two examples, verbatim: the text they share (fp16, optimizer, scheduler blocks; the
# batch, clipping and logging keys) once, then each zero_optimization block.
_HEAD = """\
{
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1
    },

    "optimizer": {
        "type": "AdamW",
        "params": {
            "lr": "auto",
            "betas": "auto",
            "eps": "auto",
            "weight_decay": "auto"
        }
    },

    "scheduler": {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto"
        }
    },

"""
_TAIL = """\
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": false
}
"""
ZERO2_EXAMPLE = _HEAD + """\
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {
            "device": "cpu",
            "pin_memory": true
        },
        "allgather_partitions": true,
        "allgather_bucket_size": 2e8,
        "overlap_comm": true,
        "reduce_scatter": true,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": true
    },

""" + _TAIL
ZERO3_EXAMPLE = _HEAD + """\
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {
            "device": "cpu",
            "pin_memory": true
        },
        "offload_param": {
            "device": "cpu",
            "pin_memory": true
        },
        "overlap_comm": true,
        "contiguous_gradients": true,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": true
    },

""" + _TAIL


@pytest.fixture
def no_gpu(monkeypatch):
    """A machine without a GPU, whatever this one has (pinning works where one is present)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _train(tmp_path, config: dict):
    """Three steps of ZeroTrainer under ``config``: (the PinMemoryIgnored warnings raised, every
    one counted, the logged losses, the final full weights)."""
    from transformers import TrainingArguments

    from zkernels.integrations.transformers import ZeroTrainer, full_state_dict
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, seed=0,
                             max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2,
                             warmup_steps=1, logging_steps=1, save_strategy="no",
                             disable_tqdm=True, dataloader_num_workers=0, deepspeed=config)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")   # each raise recorded, not only a place's first
        trainer = ZeroTrainer(model=make_hf("gpt2"), args=args, train_dataset=TokenRows(6))
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    weights = full_state_dict(trainer.optimizer)
    assert trainer.optimizer.offload == "cpu"
    trainer.optimizer.close()
    return [w for w in seen if issubclass(w.category, PinMemoryIgnored)], losses, weights


def _unpinned(config: dict) -> dict:
    z = config["zero_optimization"]
    for part in ("offload_optimizer", "offload_param"):
        if part in z:
            z[part]["pin_memory"] = False
    return config


@pytest.mark.timeout(300)
@pytest.mark.parametrize("example", [ZERO2_EXAMPLE, ZERO3_EXAMPLE], ids=["zero2", "zero3"])
def test_transformers_example_config_trains_unpinned_without_a_gpu(tmp_path, no_gpu, example):
    config = json.loads(example)
    assert config["zero_optimization"]["offload_optimizer"]["pin_memory"] is True
    warned, losses, weights = _train(tmp_path / "pinned", config)
    assert [str(w.message) for w in warned] == [PIN_MEMORY_IGNORED]   # once
    assert len(losses) == 3 and all(map(torch.isfinite, torch.tensor(losses))), losses
    warned, want_losses, want = _train(tmp_path / "unpinned", _unpinned(json.loads(example)))
    assert warned == []
    assert losses == want_losses
    assert sorted(weights) == sorted(want)
    for k, v in want.items():
        assert torch.equal(weights[k], v), k
    start = make_hf("gpt2").state_dict()
    assert any(not torch.equal(v, start[k]) for k, v in want.items())   # it trained
