"""One rank of the ZeRO step benchmark: build every method, warm up, time steps round-robin.

Round-robin (step i of every method, then step i + 1 of every method, the order rotated by one
each step and reversed every other step) keeps a change in the machine's background load from
landing on one method only, and no method always runs right after the same other one (whatever
a row leaves running in the background, e.g. I/O, lands on the next row): this CPU is shared.
Each timed step is ``barrier; t0; forward+backward; optimizer step; zero_grad; barrier; t1``,
so every rank's time includes waiting for the slowest one. Reading stats and memory after the
optimizer step is left out of the time.
"""
from __future__ import annotations

import time
import traceback

import torch
import torch.distributed as dist

from _comm_meter import CommMeter


def _batch(step: int, rank: int, seed: int, batch_size: int, block_size: int,
           vocab_size: int) -> tuple:
    """Random tokens, the same for every method: one micro-batch per (rank, step)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step)
    x = torch.randint(0, vocab_size, (batch_size, block_size), generator=g)
    y = torch.randint(0, vocab_size, (batch_size, block_size), generator=g)
    return x, y


def _run(rank: int, world_size: int, opts: dict, meter: CommMeter) -> dict:
    # Imported only now, with the meter installed: a module that binds a collective at import
    # time (``from torch.distributed import ...``) then binds the wrapped one.
    from _zero_step_methods import Context, MethodUnavailable, all_ranks_ok, build
    from _zero_step_trees import BEFORE, InTree, Trees

    # --baseline-tree: a second zkernels beside this one ([Note: before and after in the same
    # rounds] in _zero_step_trees.py)
    trees = Trees()
    results = {"_zkernels": {"": trees.add("", opts["zk_root"])}}
    if opts.get("baseline_root"):
        results["_zkernels"][BEFORE] = trees.add(BEFORE, opts["baseline_root"])
    trees.use("")
    from zkernels.demo.model import GPTConfig

    cfg = GPTConfig(**opts["model"])
    bucket_log: list = []
    ctx = Context(lr=opts["lr"], world_size=world_size, batch_size=opts["batch_size"],
                  on_bucket=bucket_log.append,  # --dtype bfloat16: the bf16 rows
                  param_dtype=None if opts["dtype"] == "float32" else getattr(torch, opts["dtype"]),
                  shard_size=opts.get("shard_size"), offload_dir=opts.get("offload_dir"),
                  nvme_budget=opts["nvme_budget"], optimizer=opts.get("optimizer", "adamw"))
    methods = {}
    for name in opts["methods"]:
        row, _, label = name.partition("@")
        label = "@" + label if label else ""
        error = None
        try:
            trees.use(label)
            methods[name] = build(row, cfg, opts["seed"], ctx)
            if len(trees.mods) > 1:  # both trees' rows pay the same module switch
                methods[name] = InTree(trees, label, methods[name])
        except MethodUnavailable as exc:
            error = str(exc)
        except Exception:  # noqa: BLE001 - reported in the table, the run goes on
            error = "failed to build:\n" + traceback.format_exc()
        trees.use("")
        if not all_ranks_ok(error is None):
            methods.pop(name, None)
            results[name] = {"error": error or "failed to build on another rank"}
        else:
            results[name] = {"times_s": [], "meter": [], "hook_bucket_bytes": [],
                             "zk_stats": [], "losses": []}

    num_steps = opts["warmup"] + opts["steps"]
    for step in range(num_steps):
        x, y = _batch(step, rank, opts["seed"], opts["batch_size"], cfg.block_size,
                      cfg.vocab_size)
        timed = step >= opts["warmup"]
        names = list(methods)
        shift = step % len(names) if names else 0
        order = names[shift:] + names[:shift]
        for name in (order if step % 2 == 0 else order[::-1]):
            m, res = methods[name], results[name]
            meter.reset()
            bucket_log.clear()
            dist.barrier()
            t0 = time.perf_counter()
            meter.enabled = True
            loss = m.forward_backward(x, y)
            m.update()
            meter.enabled = False
            t_paused = time.perf_counter()
            stats = m.zk_stats()
            if step == num_steps - 1:
                res["memory"] = m.memory()
            t_resumed = time.perf_counter()
            meter.enabled = True
            m.zero_grad()
            meter.enabled = False
            dist.barrier()
            t1 = time.perf_counter()
            if timed:
                res["times_s"].append((t1 - t0) - (t_resumed - t_paused))
                res["meter"].append(meter.snapshot())
                res["hook_bucket_bytes"].append(sum(bucket_log))
                res["zk_stats"].append(stats)
            res["losses"].append(float(loss))
    return results


def run(rank: int, world_size: int, opts: dict) -> dict:
    """One rank's results (``zero_step.launch`` spawns it), the meter counting its bytes."""
    meter = CommMeter(shard_size=opts.get("shard_size"))
    with meter.installed():
        return _run(rank, world_size, opts, meter)
