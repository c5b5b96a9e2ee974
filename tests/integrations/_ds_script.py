"""One DeepSpeed-style training script, run by test_deepspeed.py under real DeepSpeed and
under ``zkernels.integrations.deepspeed`` with only the import changed."""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

MICRO, STEPS = 4, 6


def _config(stage, gas):
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
            "gradient_clipping": 0, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {
                "lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01,
                "torch_adam": True}},
            "scheduler": {"type": "WarmupLR", "params": {
                "warmup_min_lr": 0.001, "warmup_max_lr": 1e-2, "warmup_num_steps": 3,
                "warmup_type": "linear"}},
            "zero_optimization": {"stage": stage, "overlap_comm": False,
                                  "contiguous_gradients": True}}


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4))


def train(rank, world, backend, runs, ckpt_root):
    """For each (stage, gas): the micro-step losses of a full run, and those of a run
    resumed from the checkpoint saved halfway, with what load_checkpoint returned."""
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    if backend == "deepspeed":
        import deepspeed as ds
    else:
        from zkernels.integrations import deepspeed as ds
    g = torch.Generator().manual_seed(100 + rank)
    out = {}
    for stage, gas in runs:
        data = [(torch.randn(MICRO, 8, generator=g), torch.randn(MICRO, 4, generator=g))
                for _ in range(STEPS * gas)]
        half = STEPS * gas // 2
        ckpt = os.path.join(ckpt_root, f"{backend}-s{stage}-g{gas}")

        def run(engine, micro_steps, save_at=None):
            losses = []
            for i in micro_steps:
                x, y = data[i]
                loss = F.mse_loss(engine(x), y)
                boundary = engine.is_gradient_accumulation_boundary()
                scaled = engine.backward(loss)     # DeepSpeed returns the loss / gas
                engine.step()
                losses.append((loss.item(), scaled.item(), boundary))
                if i == save_at:
                    engine.save_checkpoint(ckpt, client_state={"micro": i})
            return losses

        model = _model(0)
        engine, _, _, _ = ds.initialize(model=model, model_parameters=model.parameters(),
                                        config=_config(stage, gas))
        assert engine.gradient_accumulation_steps() == gas
        assert engine.train_micro_batch_size_per_gpu() == MICRO
        full = run(engine, range(len(data)), save_at=half - 1)
        steps, lr = engine.global_steps, engine.get_lr()
        del engine
        model = _model(1)
        engine, _, _, _ = ds.initialize(model=model, model_parameters=model.parameters(),
                                        config=_config(stage, gas))
        path, client = engine.load_checkpoint(ckpt)
        loaded_steps = engine.global_steps
        resumed = run(engine, range(half, len(data)))
        out[(stage, gas)] = {"full": full, "resumed": resumed, "client": dict(client),
                             "steps": steps, "loaded_steps": loaded_steps,
                             "lr": lr, "lr_resumed": engine.get_lr(),
                             "latest": open(os.path.join(ckpt, "latest")).read().strip()}
        del engine
    return out
