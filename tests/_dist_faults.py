"""Run a function on N gloo ranks where some ranks are expected to die or fail.

``run_ranks_outcomes(fn, world_size, *args)`` is ``tests._dist.run_ranks`` for fault
tests: it never fails on a rank's error, it waits for every process to end (bounded) and
returns each rank's outcome: ``("ok", result)``, ``("error", traceback)`` or
``("died", exitcode)`` (e.g. -9 after SIGKILL). Ranks leave with ``os._exit`` after sending
their outcome: tearing down a process group whose peer is dead can itself block, and that
teardown is not what these tests are about.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, Tuple


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, args, queue, pg_timeout_s):
    code = 0
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        try:
            dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=pg_timeout_s))
        except Exception as exc:  # noqa: BLE001
            if "EADDRINUSE" not in str(exc):
                raise
            # Another process took the free port before the store bound it: start again.
            queue.put((rank, "port_in_use", str(exc)))
            code = 1
            return
        queue.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        queue.put((rank, "error", traceback.format_exc()))
        code = 1
    finally:
        queue.close()
        queue.join_thread()
        os._exit(code)


def run_ranks_outcomes(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0,
                       pg_timeout_s: float = 60.0) -> Dict[int, Tuple[str, Any]]:
    """Outcome per rank of ``fn(rank, world_size, *args)``. Raises AssertionError only when
    some rank is still running after ``timeout`` seconds (a hang: every rank is killed).
    A rendezvous port taken by another process between choosing and binding it (other test
    runs share the machine) restarts the ranks on a new port, up to 3 times."""
    for attempt in range(3):
        outcomes = _run_once(fn, world_size, args, timeout, pg_timeout_s)
        if not any(kind == "port_in_use" for kind, _ in outcomes.values()):
            return outcomes
    raise AssertionError(f"no free rendezvous port after 3 attempts: {outcomes}")


def _run_once(fn, world_size, args, timeout, pg_timeout_s):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, queue,
                                                pg_timeout_s), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    outcomes: Dict[int, Tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            try:
                rank, kind, payload = queue.get(timeout=0.2)
                outcomes[rank] = (kind, payload)
            except queue_mod.Empty:
                pass
            if any(kind == "port_in_use" for kind, _ in outcomes.values()):
                return outcomes  # the others may be talking to a stranger: kill, retry
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        while True:  # what was sent just before the processes ended
            try:
                rank, kind, payload = queue.get(timeout=0.5)
                outcomes[rank] = (kind, payload)
            except queue_mod.Empty:
                break
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    if hung:
        raise AssertionError(f"ranks {hung} of {world_size} still running after {timeout}s "
                             f"(a hang); outcomes so far: {outcomes}")
    for r, p in enumerate(procs):
        outcomes.setdefault(r, ("died", p.exitcode))
    return outcomes
