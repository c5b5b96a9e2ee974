"""Train a small GPT with zkernels' ZeroOptimizer: the whole loop, ready to copy.

What it shows: ``ZeroOptimizer`` (stage 1, 2, 3 or "auto"), a warmup + cosine learning-rate
schedule (``LambdaLR``), gradient accumulation (``opt.no_sync()`` on all but the last
micro-step), clipping by the global norm (``max_grad_norm``), and checkpoint save / resume.
At ``--stage 3`` each block's parameters are sharded and gathered just in time: reading them
outside a forward (saving, evaluating, generating) goes inside ``with opt.gathered():``, which
every rank enters.

Checkpoints are ``zkernels.checkpoint``: every rank writes only its own shards (per
parameter, so any world size and stage can load them) into the folder ``--ckpt-dir`` (default
``runs/train_gpt/``, which the repository's .gitignore ignores), published atomically once all
ranks are done; ``--resume`` loads it, at this world size or another. Keep the global batch
(ranks x ``--batch-size``) when you change the world size, and the run continues on the same
trajectory (to round-off).

Launch (torchrun is PyTorch's own launcher; gloo on CPU, NCCL on GPU), with zkernels installed
(or ``PYTHONPATH`` pointing at a checkout):

    # one machine, 2 processes (CPU or 2 GPUs)
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --steps 200

    # two machines with 8 GPUs each: run on both, MASTER = the first machine's address
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint $MASTER:29500 --rdzv-id gpt1 examples/train_gpt.py --stage auto

    # in time slices: stop after step 100, then resume from the checkpoint, here on one
    # process with twice the per-rank batch (same --steps, so the schedule is the same)
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --steps 200 --batch-size 4 \\
        --stop-at 100
    torchrun --standalone --nproc-per-node 1 examples/train_gpt.py --steps 200 --batch-size 8 \\
        --resume

    # full weights for model.load_state_dict (or Hugging Face tools), streamed
    python -m zkernels checkpoint consolidate runs/train_gpt gpt.safetensors --dtype bf16
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist

import zkernels as zk
from zkernels.demo.data import get_batch, load_corpus
from zkernels.demo.model import GPT, GPTConfig


def lr_lambda(warmup_steps: int, total_steps: int, min_ratio: float = 0.1):
    """Linear warmup to 1, then cosine down to ``min_ratio`` (a factor of the base lr)."""
    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        t = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))
    return f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stage", default="2", help='1, 2, 3 or "auto"')
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup-steps", type=int, default=20)
    ap.add_argument("--accum-steps", type=int, default=2, help="micro-batches per step")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 master (GPU)")
    ap.add_argument("--ckpt-dir", default=os.path.join("runs", "train_gpt"),
                    help="checkpoint folder (runs/train_gpt, ignored by the repository's "
                    ".gitignore)")
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--stop-at", type=int, default=None, help="checkpoint and stop after this "
                    "step (a job's time slice); --resume continues the same schedule")
    args = ap.parse_args()

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # zkernels is imported above, before the group exists: that is what lets
    # destroy_process_group() below end it ([Note: process group teardown] in
    # zkernels/comm/select.py).
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=timedelta(minutes=5))
    try:
        train(args, device)
    finally:
        dist.destroy_process_group()   # every rank, also when training raised


def train(args, device) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)        # the same initial weights on every rank
    model = GPT(GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd,
                          block_size=args.block_size)).to(device)
    opt = zk.ZeroOptimizer(
        model, stage=args.stage if args.stage == "auto" else int(args.stage), lr=args.lr,
        betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=args.max_grad_norm,
        param_dtype=torch.bfloat16 if args.bf16 else None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.warmup_steps, args.steps))

    global_batch = world_size * args.batch_size * args.accum_steps   # sequences per step
    start = 0
    if args.resume:
        # Any world size and stage: each rank reads the parts of the saved shards it owns now.
        extra = zk.checkpoint.load(opt, args.ckpt_dir)
        sched.load_state_dict(extra["sched"])
        start = extra["step"]
        if rank == 0:
            print(f"resumed {args.ckpt_dir} at step {start} (saved on {extra['world_size']} ranks, "
                  f"now {world_size})", flush=True)
            if extra["global_batch"] != global_batch:
                print(f"note: the global batch was {extra['global_batch']} sequences, now "
                      f"{global_batch}: the run continues on another trajectory", flush=True)

    tokens = load_corpus()
    stop = args.steps if args.stop_at is None else min(args.stop_at, args.steps)
    for step in range(start, stop):
        for micro in range(args.accum_steps):
            x, y = (t.to(device) for t in get_batch(
                tokens, seed=1, step=step * args.accum_steps + micro, rank=rank,
                world_size=world_size, batch_size=args.batch_size, block_size=args.block_size))
            last = micro == args.accum_steps - 1
            # Accumulate locally; only the last micro-step's backward reduces across ranks.
            with opt.no_sync() if not last else contextlib.nullcontext():
                loss = model(x, y) / args.accum_steps
                opt.backward(loss)
        opt.step()              # clips to max_grad_norm over all shards, updates (stages 1-2:
        #                         all-gathers; stage 3 gathers each block at its next use)
        opt.zero_grad()
        sched.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step:5d}  loss {loss.item() * args.accum_steps:.4f}  "
                  f"lr {sched.get_last_lr()[0]:.2e}", flush=True)
        if (step + 1) % args.ckpt_every == 0 or step + 1 == stop:
            zk.checkpoint.save(opt, args.ckpt_dir, model_extra={
                "sched": sched.state_dict(), "step": step + 1, "world_size": world_size,
                "global_batch": global_batch})
    if rank == 0:
        print(f"done: {stop} of {args.steps} steps; stats of the last step: {opt.stats()}")


if __name__ == "__main__":
    main()
