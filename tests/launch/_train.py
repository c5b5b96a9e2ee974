"""The training run the launch tests start under ``torchrun``: the harness GPT (fp32) for a
few steps at each stage given, every rank on its rows of the same global batches.

    python -m torch.distributed.run ... tests/launch/_train.py OUT_DIR --stages 2 3

Rank 0 writes ``OUT_DIR/result.pt``: per stage the world-mean loss of every step and the
final parameters; every rank writes ``OUT_DIR/where-rank{R}.json``: the node (torchrun's
GROUP_RANK), local rank and agent pid it ran under, so a test can tell how it was launched.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))))

import zkernels as zk  # noqa: E402
from tests.zero._harness import (EPS, LR, MICRO_BATCH, chunk, make_batches,  # noqa: E402
                                 make_model, world_mean)


def train(stage: int, rank: int, ws: int, steps: int):
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=stage, lr=LR, eps=EPS, weight_decay=0.1,
                           bucket_bytes=3000, timeout=60)
    losses = []
    for batch in make_batches(steps, ws * MICRO_BATCH):
        loss = model(*chunk(batch, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(world_mean(loss.item(), ws))
    # Stage 3 keeps only shards between steps: read full parameters inside gathered().
    with opt.gathered() if stage == 3 else contextlib.nullcontext():
        return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--stages", type=int, nargs="+", default=[2])
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, ws = dist.get_rank(), dist.get_world_size()
    with open(os.path.join(args.out_dir, f"where-rank{rank}.json"), "w") as f:
        json.dump({"node": int(os.environ["GROUP_RANK"]),
                   "local_rank": int(os.environ["LOCAL_RANK"]),
                   "agent_pid": os.getppid(), "world_size": ws}, f)
    result = {s: train(s, rank, ws, args.steps) for s in args.stages}
    if rank == 0:
        torch.save(result, os.path.join(args.out_dir, "result.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
