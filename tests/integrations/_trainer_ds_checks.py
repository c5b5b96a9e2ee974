"""ZeroTrainer given a DeepSpeed config (TrainingArguments(deepspeed=path)) or a pretrained
folder for a meta-device model (rank side; module-level for spawned ranks). The oracle of
each is the same ZeroTrainer given the equivalent zero_config / a materialized model: the
logged loss and gradient norm of every step and the final weights, within tol(float32)."""
from __future__ import annotations

import json
import os

import torch

from tests.conftest import tol
from tests.integrations._trainer_checks import (BUCKET, STEPS, TokenRows, _distributed_env,
                                                _release, dataset, losses, training_args)
from tests.zero._hf_checks import make_hf

# transformers' tests' ds_config_zero2.json without its optimizer and scheduler blocks (so
# Trainer's AdamW, its no-decay group and its linear schedule run, as under --deepspeed), and
# the bucket of the oracle's zero_config (elements: bucket_bytes / 4).
ZERO2 = {"fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
                  "initial_scale_power": 16, "hysteresis": 1},
         "bf16": {"enabled": "auto"},
         "zero_optimization": {"stage": 2, "allgather_partitions": True,
                               "allgather_bucket_size": 2e8, "overlap_comm": True,
                               "reduce_scatter": True, "reduce_bucket_size": BUCKET // 4,
                               "contiguous_gradients": True},
         "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
         "steps_per_print": 2000, "train_batch_size": "auto",
         "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False}
# transformers' ds_config_zero3.json with its AdamW block (every "auto" from the arguments),
# without its WarmupLR block (Trainer's linear schedule runs: see the in-process test for the
# scheduler block).
ZERO3 = {"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
         "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto",
                                                    "eps": "auto", "weight_decay": "auto"}},
         "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                               "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                               "stage3_prefetch_bucket_size": "auto",
                               "stage3_param_persistence_threshold": "auto",
                               "stage3_max_live_parameters": 1e9,
                               "stage3_max_reuse_distance": 1e9,
                               "stage3_gather_16bit_weights_on_model_save": True},
         "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
         "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}
# DeepSpeed's optimizer block decays every parameter (one group): weight_decay 0 on both
# sides keeps the oracle's groups equivalent (the grouping is checked in-process).
CASES = [(2, ZERO2, {}, {"bucket_bytes": BUCKET}), (3, ZERO3, {"weight_decay": 0.0}, {})]


def _compare(name, got, want, got_norms, want_norms):
    assert sorted(got) == sorted(want) and len(got) == STEPS, (name, got, want)
    for step in got:
        torch.testing.assert_close(got[step], want[step], **tol(torch.float32),
                                   msg=lambda m, s=step: f"{name}, step {s} loss: {m}")
        torch.testing.assert_close(got_norms[step], want_norms[step], **tol(torch.float32),
                                   msg=lambda m, s=step: f"{name}, step {s} norm: {m}")


def deepspeed_parity(rank: int, ws: int, tmp: str, cases=None):
    """Per case: ZeroTrainer with ``zero_config`` (the oracle), then with the DeepSpeed
    config as a file in ``TrainingArguments(deepspeed=...)``: same losses, norms, weights."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    from zkernels.integrations.transformers import ZeroTrainer, full_state_dict
    _distributed_env(rank, ws)
    out = {}
    for stage, ds, args_kw, zero_kw in cases or CASES:
        ref = ZeroTrainer(model=make_hf("llama"),
                          args=training_args(os.path.join(tmp, f"ref{stage}"), **args_kw),
                          train_dataset=dataset(), zero_config=dict(zero_kw, stage=stage))
        ref.train()
        want, want_norms = losses(ref), losses(ref, key="grad_norm")
        want_full = full_state_dict(ref.optimizer)
        ref.optimizer.close()
        _release(ref)

        path = os.path.join(tmp, f"ds_config_zero{stage}.json")
        if rank == 0:
            with open(path + ".tmp", "w") as f:
                json.dump(ds, f)
            os.replace(path + ".tmp", path)
        torch.distributed.barrier()
        args = training_args(os.path.join(tmp, f"ds{stage}"), deepspeed=path, **args_kw)
        trainer = ZeroTrainer(model=make_hf("llama"), args=args, train_dataset=dataset())
        # transformers' DeepSpeed set-up is undone: zkernels alone trains
        assert not trainer.is_deepspeed_enabled and trainer.args.deepspeed is None
        assert not is_deepspeed_zero3_enabled() and trainer.deepspeed_config == path
        trainer.train()
        opt = trainer.optimizer
        assert opt.stage == stage and trainer.model_wrapped is trainer.model
        got = losses(trainer)
        _compare(f"zero{stage}", got, want, losses(trainer, key="grad_norm"), want_norms)
        full = full_state_dict(opt)
        for k, v in want_full.items():
            torch.testing.assert_close(full[k], v, **tol(torch.float32),
                                       msg=lambda m, k=k: f"zero{stage} {k}: {m}")
        out[stage] = got
        opt.close()
        _release(trainer)
    return out


def pretrained_flow(rank: int, ws: int, tmp: str, pre: str, stage: int):
    """The oracle: ZeroTrainer over ``from_pretrained(pre)`` (materialized on every rank).
    Then ZeroTrainer over the same class built on the meta device with ``pretrained=pre``:
    evaluated before training (the optimizer is built and the weights loaded then), trained
    with a checkpoint at step 2 (Trainer calls save_model on every rank), saved with
    ``save_model`` into its output folder (which holds the checkpoint): the same eval loss,
    per-step losses and final weights; the saved folder loads with from_pretrained and holds
    them. Returns the losses."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from zkernels.integrations.transformers import ZeroTrainer, full_state_dict
    _distributed_env(rank, ws)
    evalset = TokenRows(2 * ws, seed=2)
    kw = dict(train_dataset=dataset(), eval_dataset=evalset, zero_config={"stage": stage})
    ref = ZeroTrainer(model=AutoModelForCausalLM.from_pretrained(pre),
                      args=training_args(os.path.join(tmp, "ref"), per_device_eval_batch_size=2),
                      **kw)
    want_eval = ref.evaluate()["eval_loss"]
    ref.train()
    want, want_norms = losses(ref), losses(ref, key="grad_norm")
    want_full = full_state_dict(ref.optimizer)
    ref.optimizer.close()
    _release(ref)

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(pre))
    run = os.path.join(tmp, "run")
    trainer = ZeroTrainer(model=model, pretrained=pre,
                          args=training_args(run, per_device_eval_batch_size=2,
                                             save_strategy="steps", save_steps=2), **kw)
    assert next(model.parameters()).device.type == "meta"
    got_eval = trainer.evaluate()["eval_loss"]
    torch.testing.assert_close(got_eval, want_eval, **tol(torch.float32))
    trainer.train()
    _compare("meta+pretrained", losses(trainer), want, losses(trainer, key="grad_norm"),
             want_norms)
    full = full_state_dict(trainer.optimizer, keep=rank == 0)
    trainer.save_model()   # into args.output_dir, beside checkpoint-2/ and checkpoint-4/
    if rank == 0:
        for k, v in want_full.items():
            torch.testing.assert_close(full[k], v, **tol(torch.float32),
                                       msg=lambda m, k=k: f"meta+pretrained {k}: {m}")
        names = set(os.listdir(run))
        assert {"checkpoint-2", "checkpoint-4", "model.safetensors", "config.json",
                "training_args.bin"} <= names, sorted(names)
        assert {"zero", "model.safetensors"} <= set(os.listdir(os.path.join(run,
                                                                            "checkpoint-2")))
        loaded = AutoModelForCausalLM.from_pretrained(run).state_dict()
        assert sorted(loaded) == sorted(full), (sorted(loaded), sorted(full))
        for k, v in loaded.items():
            assert torch.equal(v, full[k]), k
    got = losses(trainer)
    trainer.optimizer.close()
    _release(trainer)
    return got


def deepspeed_state_undone(rank: int, ws: int, tmp: str):
    """Off the CPU path (no ``use_cpu``), ``TrainingArguments(deepspeed=...)`` sets up a
    DEEPSPEED distributed state through ``deepspeed.init_distributed``; ZeroTrainer resets it
    to what the same arguments without ``deepspeed`` give (on this CPU machine Accelerate's
    plain state; on GPUs MULTI_GPU) over the same group, and trains (no engine, no DDP)."""
    from zkernels.integrations.transformers import ZeroTrainer
    _distributed_env(rank, ws)
    plain = training_args(os.path.join(tmp, "plain"), use_cpu=False, ddp_backend="gloo")
    want = (plain.distributed_state.distributed_type, plain.world_size)  # without deepspeed
    args = training_args(os.path.join(tmp, "ds"), deepspeed=ZERO2, use_cpu=False,
                         ddp_backend="gloo")
    assert str(args.distributed_state.distributed_type).endswith("DEEPSPEED")
    trainer = ZeroTrainer(model=make_hf("llama"), args=args, train_dataset=dataset())
    state = trainer.accelerator.state
    assert not trainer.is_deepspeed_enabled and state.deepspeed_plugin is None
    assert (state.distributed_type, trainer.args.world_size) == want, (state, want)
    trainer.train()
    assert trainer.model_wrapped is trainer.model and trainer.optimizer.stage == 2
    got = losses(trainer)
    trainer.optimizer.close()
    _release(trainer)
    return got
