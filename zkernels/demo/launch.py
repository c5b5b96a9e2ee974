"""``python -m zkernels demo``: train the small GPT on N ranks at every rung and compare.

Runs ``zkernels.demo.worker`` on N local ranks (gloo on CPU, NCCL on GPU) through
:func:`zkernels.launch.run_ranks`, which reports a failing rank's traceback once with the
command that reproduces it, then prints two tables: per rung (data parallel,
stages 1-3, CPU and NVMe offload: ``rungs.py``) the loss after K steps (see [Note: what the
demo's losses show] in report.py for how equal) and, with ``--eval-batches N``, the eval
loss on N fixed batches after the last step, the median step time, bytes sent per step
and bytes held per rank on the device, in host RAM and on disk, each measured beside
:func:`zkernels.estimate_memory`'s estimate; then the bytes held by kind in each place. With
``--device-memory``, '*' marks the rung ``plan`` would choose (``zero.ladder.choose_rung``).
Options (--rungs, sizes, output paths) are checked before any rank starts.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
from typing import List, Optional

from .._cli import byte_size, output_file, writable_folder
from ..launch import RanksFailed, RanksTimedOut, run_ranks
from .report import plot, render_table
from .rungs import parse_rungs
from .worker import WORKER_OPTS, model_config


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m zkernels demo", description=__doc__.split(
        "\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    for flag, typ, default, doc in WORKER_OPTS:
        ap.add_argument(flag, type=typ, default=default, help=f"{doc} ({default})")
    ap.add_argument("--resume", action="store_true", help="each ZeRO rung continues from its "
                    "checkpoint in --ckpt-dir (saved by an earlier demo, at any --nproc)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="auto: cuda when there is a GPU per rank, else cpu")
    ap.add_argument("--json", type=output_file, default=None, metavar="PATH",
                    help="write the results as JSON to this file (its folder must exist)")
    ap.add_argument("--plot", type=output_file, default=None, metavar="PNG",
                    help="draw the ZeRO paper's memory figure (bytes per rank by kind on the "
                         "device, in host RAM and on disk, measured beside the estimate), the "
                         "loss curves and step times to this file (needs matplotlib)")
    ap.add_argument("--device-memory", type=byte_size("--device-memory"), default=None,
                    metavar="SIZE", help="memory per device with its unit, e.g. 8MiB: '*' "
                    "marks the rung plan would choose for the demo model in fp32 (the lowest "
                    "whose estimate fits, as python -m zkernels plan --device-memory does)")
    ap.add_argument("--headroom", type=float, default=0.10, help="fraction of "
                    "--device-memory plan keeps for activations etc. (0.10)")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="kill the ranks after this")
    return ap.parse_args(argv)


def check_args(args) -> Optional[str]:
    """The first problem with the numeric options, or None: checked before any rank starts,
    so that a bad value fails in a second instead of after a rung has trained (or trains on
    NaN losses, as --batch-size 0 did)."""
    for flag in ("nproc", "steps", "n_layer", "n_head", "n_embd", "block_size", "batch_size",
                 "bucket_bytes"):
        value = getattr(args, flag)
        if value is not None and value < 1:   # None: --bucket-bytes auto
            return f"--{flag.replace('_', '-')} must be >= 1, got {value}"
    if args.eval_batches < 0:
        return f"--eval-batches must be >= 0, got {args.eval_batches}"
    if args.n_embd % args.n_head:
        return (f"--n-embd must be a multiple of --n-head, got --n-embd {args.n_embd} and "
                f"--n-head {args.n_head}")
    for flag in ("lr", "weight_decay"):
        value = getattr(args, flag)
        if not value >= 0.0:
            return f"--{flag.replace('_', '-')} must be >= 0, got {value}"
    if args.param_dtype not in ("fp32", "bf16"):
        return f"--param-dtype must be fp32 or bf16, got {args.param_dtype!r}"
    if args.state_dtype not in ("fp32", "bf16", "int8"):
        return f"--state-dtype must be fp32, bf16 or int8, got {args.state_dtype!r}"
    from ..ops.quant import check_block_size
    try:
        check_block_size(args.state_block_size, "--state-block-size")
    except ValueError as exc:
        return str(exc)
    if args.master_dtype not in ("fp32", "bf16"):
        return f"--master-dtype must be fp32 or bf16, got {args.master_dtype!r}"
    if args.master_dtype == "bf16" and args.param_dtype != "bf16":
        return "--master-dtype bf16 needs --param-dtype bf16 (the master is the bf16 weights)"
    if not args.timeout_s > 0.0:
        return f"--timeout-s must be > 0, got {args.timeout_s}"
    if not 0.0 <= args.headroom < 1.0:
        return f"--headroom must be a fraction in [0, 1), got {args.headroom}"
    return None


def plan_choice(args, world_size: int) -> Optional[dict]:
    """The rung ``plan`` would choose for the demo model with ``--device-memory`` (None when
    not given): ``{"device_memory", "headroom", "rung" (key, or None when nothing fits),
    "name", "reason" (the planner's sentence), "device_bytes" (the rung's estimated
    peak)}``. The planner's own choice (``choose_rung``) on the model's estimate in fp32 with
    the demo's buckets; the model is built on the meta device (no memory, no time)."""
    if args.device_memory is None:
        return None
    import torch

    from ..zero.planning.ladder import NoRungFitsError, choose_rung
    from .model import GPT
    from .rungs import Rung
    with torch.device("meta"):
        model = GPT(model_config(args))
    out = dict(device_memory=args.device_memory, headroom=args.headroom, device_bytes=None)
    try:
        (stage, offload), est, reason = choose_rung(
            model, world_size, args.device_memory, headroom=args.headroom,
            bucket_bytes=args.bucket_bytes)
    except NoRungFitsError as exc:
        return dict(out, rung=None, name=None, reason=str(exc))
    rung = Rung(stage, offload, est.offload_params)
    return dict(out, rung=rung.key, name=rung.name, reason=reason,
                device_bytes=est.device_bytes)


def _device(choice: str, nproc: int) -> str:
    if choice != "auto":
        return choice
    import torch
    # One GPU per rank (NCCL); with fewer GPUs than ranks, gloo on CPU.
    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= nproc \
        else "cpu"


def run_workers(args, out_dir: str, reproduce: str) -> dict:
    """Run the ranks; return rank 0's results.

    Raises:
        RuntimeError: a rank failed (the first failure's traceback and ``reproduce``, the
            command that runs the demo again) or the ranks did not finish in time.
    """
    device = _device(args.device, args.nproc)
    if device == "cuda":
        import torch
        if args.nproc > torch.cuda.device_count():
            raise RuntimeError(f"--nproc {args.nproc} needs as many GPUs, this machine has "
                               f"{torch.cuda.device_count()} (use --device cpu for gloo)")
    cmd = ["--out", out_dir, "--device", device, "--timeout-s", str(min(args.timeout_s, 300.0))]
    for flag, _typ, _default, _doc in WORKER_OPTS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:   # None: the worker's own default (e.g. buckets sized "auto")
            cmd += [flag, str(value)]
    if args.resume:
        cmd.append("--resume")
    env = dict(os.environ)
    # The ranks must import this same zkernels, installed or not.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    # One report when a rank fails: its traceback once and this command ([Note: one report
    # per failure] in zkernels/launch.py).
    try:
        run_ranks("zkernels.demo.worker:main", cmd, args.nproc, env=env,
                  timeout_s=args.timeout_s, reproduce=reproduce)
    except RanksTimedOut:
        raise RuntimeError(f"the demo's ranks did not finish within {args.timeout_s:g}s "
                           f"(--timeout-s)\nreproduce: {reproduce}") from None
    except RanksFailed as exc:
        raise RuntimeError(f"the demo's ranks failed: {exc}") from None
    path = os.path.join(out_dir, "results.json")
    with open(path) as f:
        return json.load(f)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    problem = check_args(args)
    if problem:
        print(f"zkernels demo: error: {problem}", file=sys.stderr)
        return 2
    try:
        rungs = parse_rungs(args.rungs)
    except ValueError as exc:
        print(f"zkernels demo: error: {exc}", file=sys.stderr)
        return 2
    args.rungs = ",".join(r.key for r in rungs)     # the worker's canonical form
    if args.resume and (not args.ckpt_dir or any(r.stage == 0 for r in rungs)):
        print("zkernels demo: error: --resume continues the ZeRO rungs from their checkpoints: "
              "give --ckpt-dir and --rungs without ddp (e.g. --rungs 1,2)", file=sys.stderr)
        return 2
    if args.offload_dir:    # written to, as ZeroOptimizer will: /proc exists, takes no file
        try:
            writable_folder(args.offload_dir)
        except argparse.ArgumentTypeError as exc:
            print(f"zkernels demo: error: --offload-dir {exc}", file=sys.stderr)
            return 2
    if args.plot:   # fail before training, not after
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("zkernels demo: error: --plot needs matplotlib (pip install matplotlib)",
                  file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory(prefix="zkernels-demo-") as out_dir:
        try:
            reproduce = shlex.join([sys.executable, "-m", "zkernels", "demo", *argv])
            results = run_workers(args, out_dir,
                                  f"cd {shlex.quote(os.getcwd())} && {reproduce}")
        except RuntimeError as exc:
            print(f"zkernels demo: error: {exc}", file=sys.stderr)
            return 1
    results["plan"] = plan_choice(args, results["meta"]["world_size"])
    table, summary = render_table(results)
    print(table)
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(dict(results, summary=summary), f, indent=1)
        os.replace(tmp, args.json)
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    return 0
