"""Rank side of tests/integrations/test_lightning.py: Lightning's Trainer on the harness GPT,
with Lightning's DDPStrategy (the reference) or zkernels' ZeroStrategy, inside the ranks that
tests/_dist.py started (Lightning sees a torchrun-like environment and joins the process group
already there instead of launching processes)."""
from __future__ import annotations

import gc
import os
import warnings
from typing import Dict, List

import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.zero._harness import CFG, EPS, MICRO_BATCH, make_model, no_decay, world_mean

STEPS = 4             # optimizer steps per epoch at 2 ranks
SAMPLES = 2 * MICRO_BATCH * 2 * STEPS   # 2 ranks x 2 micro-batches (accumulation) x STEPS
LR = 3e-3
SGD_LR = 0.5   # large enough that SGD moves the loss within the run


def _env(rank: int, world_size: int) -> None:
    # TorchElasticEnvironment: Lightning creates no processes and joins the existing group.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0")


def _data():
    g = torch.Generator().manual_seed(1)
    shape = (SAMPLES, CFG.block_size)
    return TensorDataset(torch.randint(0, CFG.vocab_size, shape, generator=g),
                         torch.randint(0, CFG.vocab_size, shape, generator=g))


def module_class():
    import lightning.pytorch as pl

    class GPTModule(pl.LightningModule):
        """The harness GPT; AdamW (or ``adam``: "adam", "sgd") with a no-decay group and a
        LambdaLR warm-up."""

        def __init__(self, world_size: int, adam: str = "adamw"):
            super().__init__()
            self.gpt = make_model()
            self.world_size, self.adam = world_size, adam
            self.losses: List[float] = []    # world mean per micro-batch

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = self.gpt(x, y)
            self.losses.append(world_mean(loss.item(), self.world_size))
            return loss

        def configure_optimizers(self):
            named = list(self.gpt.named_parameters())
            groups = [{"params": [p for n, p in named if not no_decay(n)], "weight_decay": 0.1},
                      {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0}]
            if self.adam == "sgd":   # a torch class that runs itself on the shards
                opt = torch.optim.SGD(groups, lr=SGD_LR, momentum=0.9, nesterov=True)
            else:
                cls = torch.optim.AdamW if self.adam == "adamw" else torch.optim.Adam
                if self.adam == "adam":
                    for g in groups:
                        g["weight_decay"] = 0.0
                opt = cls(groups, lr=LR, betas=(0.9, 0.95), eps=EPS)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return GPTModule


def fit(rank: int, world_size: int, strategy: dict, trainer_kwargs: dict,
        ckpt_dir: str = None, resume: str = None, adam: str = "adamw") -> Dict[str, object]:
    """One ``trainer.fit``; returns the per-micro-batch world-mean losses (and the final
    learning rate, the optimizer steps taken)."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    from zkernels.integrations.lightning import ZeroStrategy
    _env(rank, world_size)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    torch.manual_seed(0)
    module = module_class()(world_size, adam)
    spec = dict(strategy)
    kind = spec.pop("kind")
    strat = DDPStrategy(process_group_backend="gloo") if kind == "ddp" else ZeroStrategy(**spec)
    batch = trainer_kwargs.pop("batch_size", MICRO_BATCH)
    callbacks = []
    if ckpt_dir is not None:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1,
                                                      every_n_epochs=1))
    trainer = pl.Trainer(strategy=strat, accelerator="cpu", devices=world_size, logger=False,
                         enable_checkpointing=ckpt_dir is not None, callbacks=callbacks,
                         enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, **trainer_kwargs)
    loader = DataLoader(_data(), batch_size=batch, shuffle=False)
    trainer.fit(module, loader, ckpt_path=resume)
    out = {"losses": module.losses, "global_step": trainer.global_step,
           "lr": [g["lr"] for g in trainer.optimizers[0].param_groups]}
    del trainer, strat, module
    gc.collect()
    return out


def battery(rank: int, world_size: int, rows: Dict[str, tuple],
            adam: str = "adamw") -> Dict[str, object]:
    """Every row (name -> (strategy spec, Trainer kwargs)) in these ranks, in turn, with the
    optimizer ``adam`` selects in configure_optimizers."""
    return {name: fit(rank, world_size, dict(spec), dict(kwargs), adam=adam)
            for name, (spec, kwargs) in rows.items()}


def save_then_resume_rows(rank: int, world_size: int, stage: int, root: str) -> Dict[str, object]:
    """Uninterrupted 2 epochs, and 1 epoch with ModelCheckpoint saving (both at this world
    size, ``stage``); the resumed run is resume_at."""
    full = fit(rank, world_size, {"kind": "zero", "stage": stage}, {"max_epochs": 2})
    saved = fit(rank, world_size, {"kind": "zero", "stage": stage}, {"max_epochs": 1},
                ckpt_dir=os.path.join(root, "ckpt"))
    return {"full": full, "saved": saved, "files": sorted(os.listdir(os.path.join(root, "ckpt")))}


def resume_at(rank: int, world_size: int, stage: int, ckpt: str, batch_size: int):
    """Epoch 2 from the checkpoint at ``ckpt``, at this world size and ``batch_size``."""
    return fit(rank, world_size, {"kind": "zero", "stage": stage},
               {"max_epochs": 2, "batch_size": batch_size}, resume=ckpt)
