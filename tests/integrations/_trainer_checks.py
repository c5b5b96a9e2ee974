"""ZeroTrainer against transformers.Trainer with DDP + AdamW (rank side; module-level for
spawned ranks). A tiny Llama from a config (random init, nothing downloaded: see
tests/zero/_hf_checks.py), fixed-length random token rows, 4 optimizer steps of 2 accumulated
micro-batches, a linear LR schedule with warmup and clipping by max_grad_norm: everything a
Trainer configures on the optimizer runs in each step.
"""
from __future__ import annotations

import gc
import os

import torch

from tests.conftest import tol
from tests.zero._hf_checks import SEQ, VOCAB, make_hf

try:
    # Where deepspeed is installed, Trainer imports it, and deepspeed.comm binds the world
    # group as a default argument of its barriers when imported: after init_process_group that
    # keeps the group alive past destroy_process_group() (see [Note: process group teardown]
    # in zkernels/comm/select.py). A spawned rank imports this module before the harness makes
    # the group, so imported here its defaults stay None.
    import deepspeed.comm  # noqa: F401
except ImportError:
    pass

STEPS = 4
MICRO = 2          # per-device batch at 2 ranks
ACCUM = 2
MAX_GRAD_NORM = 0.5
BUCKET = 2 ** 13   # several buckets over the tiny model


class TokenRows(torch.utils.data.Dataset):
    """``n`` rows of ``SEQ`` random tokens, as causal-LM inputs and labels."""

    def __init__(self, n: int, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(1, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def dataset() -> TokenRows:
    """One epoch is exactly ``STEPS`` steps of the global batch (2 ranks x MICRO x ACCUM)."""
    return TokenRows(STEPS * 2 * MICRO * ACCUM)


def _distributed_env(rank: int, ws: int) -> None:
    """What torchrun sets, so that TrainingArguments / Accelerate see the gloo group the
    harness made."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(ws), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(ws))


def training_args(out: str, ws: int = 2, **kw):
    from transformers import TrainingArguments
    base = dict(output_dir=out, per_device_train_batch_size=MICRO * 2 // ws,
                gradient_accumulation_steps=ACCUM, max_steps=STEPS, learning_rate=3e-3,
                lr_scheduler_type="linear", warmup_steps=1, weight_decay=0.1,
                adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-6,
                max_grad_norm=MAX_GRAD_NORM, logging_steps=1, save_strategy="no",
                report_to=[], disable_tqdm=True, seed=0, use_cpu=True, optim="adamw_torch",
                dataloader_num_workers=0)
    base.update(kw)
    return TrainingArguments(**base)


def losses(trainer, after: int = 0, key: str = "loss"):
    """{global step: logged loss} (the world mean of the step's loss) for steps > after (or
    another logged value: ``key="grad_norm"``)."""
    return {h["step"]: h[key] for h in trainer.state.log_history
            if key in h and h["step"] > after}


def _release(trainer) -> None:
    """Drop a trainer and whatever holds the process group (DDP) before teardown."""
    trainer.accelerator.free_memory()
    del trainer
    gc.collect()


def rung_name(cfg: dict) -> str:
    """``stage3+cpu+params`` for ``{"stage": 3, "offload": "cpu", "offload_params": True}``."""
    return "+".join([f"stage{cfg['stage']}"] + ([cfg["offload"]] if cfg.get("offload") else [])
                    + (["params"] if cfg.get("offload_params") else []))


def trainer_parity(rank: int, ws: int, rungs, tmp: str, args_kw=None):
    """ZeroTrainer at each rung (a ``zero_config``) == Trainer with DDP + AdamW: the logged
    loss and gradient norm of every step, then every parameter after the last step, within
    tol(float32). Returns ``{"ddp": losses, rung_name: losses}`` for the parent.
    ``args_kw``: TrainingArguments keywords of both sides (``optim="sgd"``, ...)."""
    args_kw = dict(args_kw or {})
    from torch.nn.parallel import DistributedDataParallel
    from transformers import Trainer

    from zkernels.integrations.transformers import ZeroTrainer, full_state_dict
    _distributed_env(rank, ws)
    ref = Trainer(model=make_hf("llama"), args=training_args(os.path.join(tmp, "ddp"), **args_kw),
                  train_dataset=dataset())
    ref.train()
    assert isinstance(ref.model_wrapped, DistributedDataParallel), type(ref.model_wrapped)
    out = {"ddp": losses(ref)}
    assert len(out["ddp"]) == STEPS, ref.state.log_history
    norms = losses(ref, key="grad_norm")
    assert max(norms.values()) > MAX_GRAD_NORM, f"clipping never acts: grad norms {norms}"
    expected = {n: p.detach().clone() for n, p in ref.model.named_parameters()}
    _release(ref)

    for cfg in rungs:
        stage = name = rung_name(cfg)
        trainer = ZeroTrainer(model=make_hf("llama"),
                              args=training_args(os.path.join(tmp, name), **args_kw),
                              train_dataset=dataset(), zero_config=dict(cfg, bucket_bytes=BUCKET))
        trainer.train()
        assert trainer.model_wrapped is trainer.model, type(trainer.model_wrapped)
        opt = trainer.optimizer
        assert (opt.stage, opt.offload) == (cfg["stage"], cfg.get("offload")), name
        got = losses(trainer)
        assert sorted(got) == sorted(out["ddp"]), (got, out["ddp"])
        for step, loss in got.items():
            torch.testing.assert_close(loss, out["ddp"][step], **tol(torch.float32),
                                       msg=lambda m, s=step: f"stage {stage}, step {s}: {m}")
        got_norms = losses(trainer, key="grad_norm")   # global, before clipping, as DDP's
        assert sorted(got_norms) == sorted(norms), (got_norms, norms)
        for step, norm in got_norms.items():
            torch.testing.assert_close(norm, norms[step], **tol(torch.float32),
                                       msg=lambda m, s=step: f"stage {stage}, step {s} norm: {m}")
        full = full_state_dict(trainer.optimizer)
        for n, q in expected.items():
            torch.testing.assert_close(full[n], q, **tol(torch.float32),
                                       msg=lambda m, n=n: f"stage {stage}, {n}: {m}")
        out[name] = got
        trainer.optimizer.close()
        _release(trainer)
    return out


def trainer_save(rank: int, ws: int, stage: int, tmp: str):
    """ZeroTrainer at ``ws`` ranks, evaluated and checkpointed every 2 steps, keeping the best
    checkpoint (``load_best_model_at_end``); then ``save_model``, which ``from_pretrained``
    loads: the best checkpoint's weights, bit for bit, and ``evaluate()`` (a forward that
    gathers every unit at stage 3) gives the loaded model's loss. Returns the losses by step."""
    import safetensors.torch
    from transformers import AutoModelForCausalLM

    from zkernels.integrations.transformers import ZeroTrainer, full_state_dict
    if ws > 1:
        _distributed_env(rank, ws)
    evalset = TokenRows(4 * ws, seed=2)
    trainer = ZeroTrainer(model=make_hf("llama"),
                          args=training_args(os.path.join(tmp, "run"), ws, save_strategy="steps",
                                             save_steps=2, eval_strategy="steps", eval_steps=2,
                                             per_device_eval_batch_size=2,
                                             load_best_model_at_end=True,
                                             metric_for_best_model="eval_loss",
                                             # the higher loss wins: checkpoint-2 (4.5927 vs
                                             # 4.5899 at step 4), so loading it is seen
                                             greater_is_better=True),
                          train_dataset=dataset(), eval_dataset=evalset,
                          zero_config={"stage": stage})
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best is not None and best.endswith("checkpoint-2"), best
    final = os.path.join(tmp, "final")
    trainer.save_model(final)
    full = full_state_dict(trainer.optimizer, keep=rank == 0)
    metrics = trainer.evaluate()
    if rank == 0:
        best_weights = safetensors.torch.load_file(os.path.join(best, "model.safetensors"))
        loaded = AutoModelForCausalLM.from_pretrained(final)
        assert type(loaded).__name__ == "LlamaForCausalLM"
        state = loaded.state_dict()
        assert sorted(state) == sorted(full), (sorted(state), sorted(full))
        for k, v in state.items():
            assert torch.equal(v, full[k]), k   # bit-exact: a copy of the parameters
            if k in best_weights:
                assert torch.equal(v, best_weights[k]), f"{k} is not the best checkpoint's"
        with torch.no_grad():
            expected = loaded(input_ids=evalset.rows, labels=evalset.rows).loss.item()
        torch.testing.assert_close(metrics["eval_loss"], expected, **tol(torch.float32))
    got = losses(trainer)
    trainer.optimizer.close()
    _release(trainer)
    return got


def trainer_resume(rank: int, ws: int, stage: int, tmp: str, checkpoint: str):
    """ZeroTrainer at ``ws`` ranks resuming from ``checkpoint``; the losses of the steps it
    ran (those after the checkpoint's)."""
    from zkernels.integrations.transformers import ZeroTrainer
    if ws > 1:
        _distributed_env(rank, ws)
    trainer = ZeroTrainer(model=make_hf("llama", seed=7),   # other weights: the checkpoint's win
                          args=training_args(os.path.join(tmp, "resumed"), ws),
                          train_dataset=dataset(), zero_config={"stage": stage})
    trainer.train(resume_from_checkpoint=checkpoint)
    start = int(checkpoint.rstrip("/").rsplit("-", 1)[1])
    got = losses(trainer, after=start)
    trainer.optimizer.close()
    _release(trainer)
    return got


def trainer_fp16(rank: int, ws: int, stage: int, tmp: str, fp32_losses):
    """``fp16=True``: fp16 compute parameters with dynamic loss scaling, backward through
    ``opt.backward`` (``step()`` raises on an unscaled backward). The curve stays within
    fp16's tolerance of the fp32 one, the scale is still the initial one (no overflow here)."""
    from zkernels.integrations.transformers import ZeroTrainer
    _distributed_env(rank, ws)
    trainer = ZeroTrainer(model=make_hf("llama"),
                          args=training_args(os.path.join(tmp, "fp16"), fp16=True),
                          train_dataset=dataset(), zero_config={"stage": stage})
    trainer.train()
    opt = trainer.optimizer
    assert opt.precision.param_dtype == torch.float16
    assert next(trainer.model.parameters()).dtype == torch.float16
    stats = opt.stats()
    assert stats["loss_scale"] is not None and stats["overflow_skips"] == 0, stats
    got = losses(trainer)
    assert sorted(got) == sorted(fp32_losses), got
    for step, loss in got.items():
        torch.testing.assert_close(loss, fp32_losses[step], **tol(torch.float16),
                                   msg=lambda m, s=step: f"fp16 step {s}: {m}")
    opt.close()
    _release(trainer)
    return got


def battery(rank: int, ws: int, rungs, tmp: str):
    """trainer_parity at every rung, then trainer_fp16 at the highest stage, in one spawn."""
    out = trainer_parity(rank, ws, rungs, tmp)
    out["fp16"] = trainer_fp16(rank, ws, max(r["stage"] for r in rungs), tmp, out["ddp"])
    return out
