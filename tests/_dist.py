"""Run a function on N gloo ranks under pytest, with a bounded wait.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes that each init a gloo
process group (one thread each, as multi-rank CPU runs should), call ``fn(rank, world_size,
*args)`` and send back its return value or its traceback. The parent fails the test with the
rank's traceback, and kills every rank after ``timeout`` seconds instead of hanging.
``fn`` must be importable (a module-level function in a test module or helper).

Every rank ends as a training script should (see [Note: process group teardown] in
zkernels/comm/select.py): it destroys the process group, and then checks that the group's gloo
worker threads are gone, so a test that leaves something holding the group (a DDP wrapper, a
pending handle, a late import binding ``group.WORLD``) fails here, every time, instead of
aborting at interpreter exit once in a few dozen runs.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable, List


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gloo_threads() -> List[str]:
    """Names of this process's gloo worker and transport threads alive now (Linux; [] where
    /proc/self/task cannot be read)."""
    names = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return names
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:     # the thread ended while we looked
            continue
        if name.startswith(("pt_gloo", "gloo_")):
            names.append(name)
    return names


def _worker(fn, rank, world_size, port, args, queue, pg_timeout_s):
    try:
        import gc

        import torch
        import torch.distributed as dist
        import zkernels  # noqa: F401 - before init_process_group: [Note: process group teardown]
        torch.set_num_threads(1)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout_s))
        try:
            result = fn(rank, world_size, *args)
        finally:
            gc.collect()    # what fn dropped, cycles included, lets go of the group now
            dist.destroy_process_group()
        alive = gloo_threads()
        if alive:
            raise RuntimeError(f"gloo threads {alive} outlived destroy_process_group(): "
                               f"something still holds the process group (see [Note: process "
                               f"group teardown] in zkernels/comm/select.py)")
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        queue.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 240.0,
              pg_timeout_s: float = 60.0) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results
    by rank. Raises AssertionError with the failing rank's traceback, or on timeout."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, queue,
                                                pg_timeout_s), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    try:
        for _ in range(world_size):
            try:
                rank, ok, payload = queue.get(timeout=timeout)
            except Exception as exc:  # queue.Empty
                raise AssertionError(f"ranks did not finish within {timeout}s; "
                                     f"finished: {sorted(results) + sorted(errors)}") from exc
            (results if ok else errors)[rank] = payload
            if errors:
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        rank = min(errors)
        raise AssertionError(f"rank {rank} of {world_size} failed:\n{errors[rank]}")
    return [results[r] for r in range(world_size)]
