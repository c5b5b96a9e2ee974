"""Bytes per rank held after backward and before ``step()``: zkernels stage 3 beside FSDP2's
``fully_shard`` (2 gloo ranks on CPU, fp32, AdamW), on the tiny untied-head GPT of issue 24
(1.86M parameters), against 16Ψ/N.

    python benchmarks/after_backward.py                 # zk_stage3 and fsdp2, 3 steps
    python benchmarks/after_backward.py --methods zk_stage2,zk_stage3,fsdp2 --steps 2

Each row is built by benchmarks/_zero_step_methods.py (the rows zero_step.py times), alone in
the process (the one before it is dropped first), and runs ``--steps`` steps; after the last
backward it reports the bytes by kind the way zero_step.py counts them ([Note: memory counted
by zkernels' own counter] in _zero_step_methods.py) and, as an independent check, every
tensor storage alive in the process (``zkernels.zero.stats.live_tensor_bytes``, the batch
excluded). The bar: zk_stage3 at most FSDP2's bytes + 2%.
"""
from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zero_step import _on_path, launch  # noqa: E402 - the shared launcher, from here

# The model: 4 blocks of 128, a 4096-token vocabulary, an untied head.
MODEL = dict(vocab_size=4096, block_size=128, n_layer=4, n_head=4, n_embd=128,
             tie_weights=False)
BATCH = 4
MIB = 2.0 ** 20


def _run(rank: int, world_size: int, opts: dict) -> dict:
    """One rank: each row in turn, alone; its bytes after the last backward."""
    import torch

    from _zero_step_methods import Context, build
    from zkernels.demo.model import GPTConfig
    from zkernels.zero.stats import live_tensor_bytes

    cfg = GPTConfig(**MODEL)
    ctx = Context(lr=1e-3, world_size=world_size, batch_size=BATCH)
    rows = {}
    for name in opts["methods"]:
        m = build(name, cfg, 0, ctx)
        gen = torch.Generator().manual_seed(1 + rank)
        for step in range(opts["steps"]):
            x = torch.randint(cfg.vocab_size, (BATCH, cfg.block_size), generator=gen)
            m.forward_backward(x, x)
            if step == opts["steps"] - 1:
                rows[name] = {"after_backward": m.memory(),
                              "walked": live_tensor_bytes(skip=(x,))}
            m.update()
            m.zero_grad()
        rows[name]["between_steps"] = m.memory()["total"]
        del m
        gc.collect()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="zk_stage3,fsdp2",
                   help="rows of benchmarks/_zero_step_methods.py, comma-separated")
    p.add_argument("--steps", type=int, default=3, help="steps per row (>= 2: AdamW's "
                   "states exist from the first step on)")
    args = p.parse_args(argv)
    _on_path()
    from zkernels.demo.model import GPT, GPTConfig

    world_size = 2
    methods = [m for m in args.methods.split(",") if m]
    psi = sum(t.numel() for t in GPT(GPTConfig(**MODEL)).parameters())
    per_rank = launch(_run, {"methods": methods, "steps": args.steps}, world_size, 900.0)
    rows = per_rank[0]
    formula = 16 * psi / world_size
    print(f"{psi / 1e6:.2f}M parameters, {world_size} ranks, fp32; 16Ψ/N = "
          f"{formula / MIB:.2f} MiB. Bytes per rank (rank 0) after backward, before step():")
    print(f"{'method':<12}{'total':>9}{'params':>9}{'grads':>9}{'states':>9}{'buffers':>9}"
          f"{'walked':>9}{'x16Ψ/N':>8}{'between':>9}  (MiB)")
    for name in methods:
        r = rows[name]
        a = r["after_backward"]
        print(f"{name:<12}{a['total'] / MIB:>9.2f}{a['params'] / MIB:>9.2f}"
              f"{a['grads'] / MIB:>9.2f}{a['optimizer_states'] / MIB:>9.2f}"
              f"{a['buffers'] / MIB:>9.2f}{r['walked'] / MIB:>9.2f}"
              f"{a['total'] / formula:>8.3f}{r['between_steps'] / MIB:>9.2f}")
    if "zk_stage3" in rows and "fsdp2" in rows:
        zk, fs = (rows[m]["after_backward"]["total"] for m in ("zk_stage3", "fsdp2"))
        ok = zk <= 1.02 * fs
        print(f"zk_stage3 after backward x{zk / fs:.4f} FSDP2's (bar: at most 1.02): "
              f"{'met' if ok else 'NOT met'}")
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
