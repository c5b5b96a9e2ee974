"""Run 2-rank trainings many times and report how each rank process ended (used by
tests/test_clean_exit.py).

``python -m tests._exit_zygote --runs N --out DIR`` imports torch and zkernels once, then for
each run forks two ranks that run ``examples/train_gpt.py``'s ``main()`` (even runs) or the
demo worker's ``main()`` (odd runs, data parallel and stage 2) on a tiny GPT under the same
environment variables torchrun sets, exactly as those programs end: each rank returns from
``main()`` and leaves through the interpreter's own finalization (``SystemExit`` unwinding to
the top, not ``os._exit``), which is where the abort of [Note: process group teardown]
(zkernels/comm/select.py) happened. Forking from one process that has imported torch costs a
fraction of a second per run instead of two fresh interpreters. The first two runs (one of
each program) import ``torch._dynamo`` in the ranks, after their process group exists, as the
programs do (through their first optimizer); later runs fork from a process that has imported
it (3 s saved per rank).

A rank that ends with a signal (SIGABRT) or a non-zero status, or that still has gloo threads
after ``main()`` returned, fails its run. Prints one line per run and a summary; exits 1 if
any run failed.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import os
import signal
import socket
import sys
import time

import torch

import zkernels  # noqa: F401 - imported before any group exists, as the programs do
from tests._dist import TEARDOWN_GRACE_S, gloo_threads_after

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--n-layer", "1", "--n-embd", "32", "--block-size", "16", "--batch-size", "2"]
LEAKED_THREADS = 3      # the exit status of a rank whose gloo threads outlived main()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _programs():
    spec = importlib.util.spec_from_file_location(
        "train_gpt", os.path.join(ROOT, "examples", "train_gpt.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    from zkernels.demo import worker
    return example, worker


def _rank(run: int, rank: int, port: int, out: str, example, worker) -> None:
    """One rank of one run, in the forked child; returns when the program's main() did."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    folder = os.path.join(out, f"run{run}")
    if run % 2 == 0:
        sys.argv = ["train_gpt.py", *TINY, "--steps", "2", "--warmup-steps", "1",
                    "--accum-steps", "1", "--ckpt-dir", folder]
        example.main()
    else:
        worker.main([*TINY, "--steps", "2", "--rungs", "ddp,2", "--bucket-bytes", "16384",
                     "--out", folder, "--timeout-s", "60"])
    alive = gloo_threads_after(TEARDOWN_GRACE_S)
    if alive:
        print(f"run {run} rank {rank}: gloo threads {alive} outlived main()", flush=True)
        raise SystemExit(LEAKED_THREADS)


def _wait(pids, timeout_s: float):
    """{pid: 'ok' | 'signal N' | 'exit N' | 'timeout'} once every pid ended (or was killed)."""
    ends, deadline = {}, time.monotonic() + timeout_s
    while len(ends) < len(pids):
        for pid in pids:
            if pid in ends:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                ends[pid] = ("ok" if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 else
                             f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else
                             f"exit {os.WEXITSTATUS(status)}")
        if time.monotonic() > deadline:
            for pid in set(pids) - set(ends):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                ends[pid] = "timeout"
        time.sleep(0.01)
    return [ends[p] for p in pids]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout-s", type=float, default=120.0, help="per run")
    args = ap.parse_args()
    torch.set_num_threads(1)
    example, worker = _programs()
    failed = 0
    for run in range(args.runs):
        if run == 2:
            importlib.import_module("torch._dynamo")    # see the module's docstring
        os.makedirs(os.path.join(args.out, f"run{run}"), exist_ok=True)
        port, pids, t0 = _free_port(), [], time.monotonic()
        gc.freeze()     # the ranks' finalization skips the zygote's objects (torch's modules)
        for rank in range(2):
            pid = os.fork()
            if pid == 0:
                _rank(run, rank, port, args.out, example, worker)
                raise SystemExit(0)     # unwinds to the top: the interpreter finalizes
            pids.append(pid)
        ends = _wait(pids, args.timeout_s)
        failed += ends != ["ok", "ok"]
        print(f"run {run} ({'example' if run % 2 == 0 else 'demo worker'}): ranks ended "
              f"{', '.join(ends)} ({time.monotonic() - t0:.1f} s)", flush=True)
    print(f"{args.runs - failed} of {args.runs} runs exited cleanly", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
