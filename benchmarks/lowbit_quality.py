"""Quality of low-bit optimizer state (issue 28) on the demo's GPT: eval loss after 300 and
600 steps, four seeds, 2 ranks, bf16 compute, stage 2, with the AdamW moments in fp32, bf16
and int8 (``ZeroOptimizer(state_dtype=...)``), beside the compute-dtype control (fp32 compute,
fp32 moments) and, where it runs, torchao's ``AdamW8bit`` (single process, the same global
batches, fp32 parameters with a bf16 autocast forward).

    python benchmarks/lowbit_quality.py --json lowbit_quality.json        # the full table
    python benchmarks/lowbit_quality.py --steps 20 --seeds 0 --n-layer 1  # a smoke run
    python benchmarks/lowbit_quality.py --configs "int8 state" --no-torchao  # one row only

Each (configuration, seed, length) is one ``python -m zkernels demo --rungs 2`` run (its
``--eval-batches`` eval loss); ``--jobs`` runs that many at once (2 ranks each). The table
gives, per length and configuration, the mean eval loss over seeds, its relative difference
from fp32 state's mean, and the spread (max - min over seeds) of each; the verdict asks for
|difference| <= 1% for bf16 and int8 state, to be read beside the control's own difference
(fp32 vs bf16 compute) and the runs' spread (the standard set for quantized collectives).
torchao's AdamW8bit keeps parameters under 4096 elements (or not a multiple of its block) in
fp32 state, and its fp32 parameters under autocast are not our bf16 weights with an fp32
master, so its row is a peer, not a like-for-like control; it needs
``torchao`` importable (``pip install --no-deps torchao``; without it the row says why).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout: its zkernels, as the demo runs (cwd ROOT) do
from zkernels.demo.worker import WORKER_OPTS, model_config  # noqa: E402

# (name, --param-dtype, --state-dtype)
CONFIGS = [("fp32 state", "bf16", "fp32"), ("bf16 state", "bf16", "bf16"),
           ("int8 state", "bf16", "int8"), ("control: fp32 compute", "fp32", "fp32")]
# the demo's options every run takes from this command line (the demo's defaults)
DEMO_FLAGS = ("--n-layer", "--n-head", "--n-embd", "--block-size", "--batch-size", "--lr",
              "--weight-decay", "--state-block-size")
BASE = "fp32 state"
PEER = "torchao AdamW8bit (1 process)"
TOLERANCE = 0.01


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", default="300,600", help="comma list of run lengths")
    ap.add_argument("--seeds", default="0,1,2,3", help="comma list of seeds")
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--jobs", type=int, default=1, help="demo runs at once (2 ranks each)")
    for flag, typ, default, doc in WORKER_OPTS:  # the demo's own, handed on to every run
        if flag in DEMO_FLAGS:
            ap.add_argument(flag, type=typ, default=default, help=doc)
    ap.add_argument("--no-torchao", action="store_true", help="leave out the torchao row")
    ap.add_argument("--configs", default=",".join(n for n, _, _ in CONFIGS),
                    help="comma list of the configurations to run (default: all of them); "
                         "without 'fp32 state' the table has no differences")
    ap.add_argument("--json", default=None, help="write every run and the table here")
    args = ap.parse_args(argv)
    args.steps = [int(s) for s in args.steps.split(",")]
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in [n for n, _, _ in CONFIGS]]
    if unknown or not args.configs:
        ap.error(f"--configs must name some of {[n for n, _, _ in CONFIGS]}, got {unknown}")
    if min(args.steps) < 1 or args.eval_batches < 1 or args.jobs < 1:
        ap.error("--steps, --eval-batches and --jobs must be >= 1")
    return args


def _model_flags(args) -> List[str]:
    return [x for f in DEMO_FLAGS for x in (f, str(getattr(args, f[2:].replace("-", "_"))))]


def demo_run(args, steps: int, seed: int, param_dtype: str, state_dtype: str) -> float:
    """One 2-rank stage-2 demo run: its eval loss."""
    with tempfile.TemporaryDirectory(prefix="zk-lowbit-") as tmp:
        out = os.path.join(tmp, "r.json")
        cmd = [sys.executable, "-m", "zkernels", "demo", "--nproc", "2", "--rungs", "2",
               "--device", "cpu", "--steps", str(steps), "--seed", str(seed),
               "--param-dtype", param_dtype, "--state-dtype", state_dtype,
               "--eval-batches", str(args.eval_batches), "--timeout-s", "7200",
               "--json", out] + _model_flags(args)
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}"
                               f"\n{proc.stderr[-2000:]}")
        with open(out) as f:
            return float(json.load(f)["rungs"][0]["eval_loss"])


def torchao_run(args, steps: int, seed: int) -> float:
    """torchao's AdamW8bit on the demo GPT in one process, fed the 2-rank run's global
    batches (both ranks' rows), fp32 parameters under a bf16 autocast; its eval loss."""
    import torch
    from torchao.optim import AdamW8bit
    from zkernels.demo.data import get_batch, load_corpus
    from zkernels.demo.model import GPT
    torch.set_num_threads(2)
    tokens = load_corpus()
    torch.manual_seed(seed)
    model = GPT(model_config(args))   # the demo's GPT at these sizes
    opt = AdamW8bit(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                    weight_decay=args.weight_decay)

    def batch(step, stream="train"):
        parts = [get_batch(tokens, seed=seed, step=step, rank=r, world_size=2,
                           batch_size=args.batch_size, block_size=args.block_size,
                           stream=stream) for r in range(2)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    for step in range(steps):
        x, y = batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        losses = [float(model(*batch(i, "eval"))) for i in range(args.eval_batches)]
    return sum(losses) / len(losses)


def table(runs: Dict[str, Dict[int, Dict[int, float]]], steps: List[int]) -> str:
    lines = []
    for s in steps:
        base = statistics.mean(runs[BASE][s].values()) if runs.get(BASE, {}).get(s) else None
        lines.append(f"{s} steps: eval loss, mean over seeds; diff = (mean - fp32 state's) / "
                     f"fp32 state's; spread = max - min over seeds")
        lines.append(f"{'state':32s} {'mean':>8s} {'diff':>8s} {'spread':>8s}  per seed")
        for name, by_steps in runs.items():
            vals = by_steps.get(s)
            if not vals:
                continue
            mean = statistics.mean(vals.values())
            spread = max(vals.values()) - min(vals.values())
            per = " ".join(f"{v:.4f}" for _, v in sorted(vals.items()))
            diff = f"{(mean - base) / base:+8.2%}" if base is not None else f"{'n/a':>8s}"
            lines.append(f"{name:32s} {mean:8.4f} {diff} {spread:8.4f}  {per}")
        lines.append("")
    return "\n".join(lines)


def verdict(runs, steps) -> Dict[str, bool]:
    out = {}
    for s in steps:
        if not runs.get(BASE, {}).get(s):
            continue
        base = statistics.mean(runs[BASE][s].values())
        for name in ("bf16 state", "int8 state"):
            if not runs.get(name, {}).get(s):
                continue
            mean = statistics.mean(runs[name][s].values())
            out[f"{name}, {s} steps"] = abs(mean - base) / base <= TOLERANCE
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    runs: Dict[str, Dict[int, Dict[int, float]]] = {n: {s: {} for s in args.steps}
                                                    for n, _, _ in CONFIGS if n in args.configs}
    jobs = [(n, p, d, s, seed) for n, p, d in CONFIGS if n in args.configs
            for s in args.steps for seed in args.seeds]
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futs = {pool.submit(demo_run, args, s, seed, p, d): (n, s, seed)
                for n, p, d, s, seed in jobs}
        for fut in concurrent.futures.as_completed(futs):
            n, s, seed = futs[fut]
            runs[n][s][seed] = fut.result()
            print(f"{n}, {s} steps, seed {seed}: {runs[n][s][seed]:.4f}", flush=True)
    peer_note: Optional[str] = None
    if args.no_torchao:
        peer_note = "left out (--no-torchao)"
    else:
        try:
            runs[PEER] = {s: {seed: torchao_run(args, s, seed) for seed in args.seeds}
                          for s in args.steps}
        except ImportError as exc:
            peer_note = f"torchao not importable here: {exc}"
    text = table(runs, args.steps)
    ok = verdict(runs, args.steps)
    print(text)
    print("within 1% of fp32 state's mean:", ok)
    if peer_note:
        print(f"{PEER}: {peer_note}")
    if args.json:
        import torch
        from zkernels.bench._common import git_revision
        meta = {"machine": platform.node(), "cpu_count": os.cpu_count(),
                "torch": torch.__version__, "commit": git_revision(),
                "args": {k: v for k, v in vars(args).items()}}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "runs": runs, "within_1pct": ok, "table": text,
                       "torchao": peer_note or "ran"}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
