"""What each rank runs in test_import_deepspeed.py (module-level so spawned ranks import it).

One run of ``tests/integrations/_ds_script.py``'s model and config (fp32, AdamW, WarmupLR,
``gradient_clipping: 0``) over ``STEPS`` steps of a global batch of ``GLOBAL`` samples, the
same samples whatever the world size (rank r of N takes its contiguous ``GLOBAL // N``),
so the mean of the ranks' losses is the loss of the global batch at any world size.
"""
import os

import torch
import torch.nn.functional as F

from tests.integrations._ds_script import _config, _model

GLOBAL, STEPS = 8, 6


def batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(GLOBAL, 8, generator=g), torch.randn(GLOBAL, 4, generator=g))
            for _ in range(STEPS)]


def _env(rank, world):
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))


def _steps(engine, rank, world, which):
    assert GLOBAL % world == 0, f"world size {world} does not divide the global batch {GLOBAL}"
    per = GLOBAL // world
    losses = []
    data = batches()
    for i in which:
        x, y = data[i]
        loss = F.mse_loss(engine(x[rank * per:(rank + 1) * per]),
                          y[rank * per:(rank + 1) * per])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def deepspeed_run(rank, world, stage, ckpt, save_after):
    """Real DeepSpeed: ``STEPS`` steps, a checkpoint after ``save_after`` of them; the
    per-step losses of this rank."""
    _env(rank, world)
    import deepspeed
    model = _model(0)
    cfg = dict(_config(stage, 1), train_micro_batch_size_per_gpu=GLOBAL // world)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)
    losses = _steps(engine, rank, world, range(save_after))
    engine.save_checkpoint(ckpt)
    return losses + _steps(engine, rank, world, range(save_after, STEPS))


def zkernels_resume(rank, world, stage, ckpt, save_after):
    """Ours, from the DeepSpeed checkpoint: the imported fp32 masters (rank 0), what
    import_deepspeed returned, and the per-step losses of the remaining steps."""
    _env(rank, world)
    from zkernels.checkpoint import import_deepspeed
    from zkernels.checkpoint._view import OptimizerView
    from zkernels.integrations import deepspeed as ds
    model = _model(1)       # another seed: every value must come from the checkpoint
    cfg = dict(_config(stage, 1), train_micro_batch_size_per_gpu=GLOBAL // world)
    engine, opt, _, sched = ds.initialize(model=model, model_parameters=model.parameters(),
                                          config=cfg)
    got = import_deepspeed(opt, ckpt)
    # DeepSpeed's iteration i is LambdaLR's epoch i + 1 (see build_scheduler).
    sched.last_epoch = got["lr_scheduler"]["last_batch_iteration"] + 1
    engine.global_steps = got["global_steps"]
    masters = {n: t.clone().numpy() for n, t in OptimizerView(opt).full_units()}
    states = {}
    view = OptimizerView(opt)
    for piece in view.pieces():
        states[(piece.name, piece.start)] = (piece.step, {f: t.clone().numpy() for f, t in
                                                          piece.tensors.items()})
    losses = _steps(engine, rank, world, range(save_after, STEPS))
    return {"masters": masters if rank == 0 else None, "pieces": states,
            "returned": {k: v for k, v in got.items() if k != "ds_config"},
            "lr": engine.get_lr(), "losses": losses, "global_steps": engine.global_steps}
