"""Run a function on N gloo ranks under pytest, with a bounded wait.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes that each init a gloo
process group (one thread each, as multi-rank CPU runs should), call ``fn(rank, world_size,
*args)`` and send back its return value or its traceback. The parent fails the test with the
rank's traceback, and kills every rank after ``timeout`` seconds instead of hanging.
``fn`` must be importable (a module-level function in a test module or helper).

Every rank ends as a training script should (see [Note: process group teardown] in
zkernels/comm/select.py): it destroys the process group, and then checks that the group's gloo
worker threads are gone (within ``TEARDOWN_GRACE_S``), so a test that leaves something holding
the group (a DDP wrapper, a pending handle, a late import binding ``group.WORLD``) fails here,
every time, instead of aborting at interpreter exit once in a few dozen runs.

``ZKERNELS_TEST_THREADS`` (default 1) sets the intra-op threads of each rank (and of the
in-process world-size-1 runs): CI runs the parity tests once more with 2, since BLAS and
ATen reductions may block differently per thread count and the verdicts must not change.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, List, Optional


def rank_threads() -> int:
    """Intra-op threads per rank in the tests (``ZKERNELS_TEST_THREADS``, default 1: the
    machine's 2 cores are shared by the ranks)."""
    raw = os.environ.get("ZKERNELS_TEST_THREADS", "1")
    try:
        threads = int(raw)
    except ValueError:
        threads = 0
    if threads < 1:
        raise ValueError(f"ZKERNELS_TEST_THREADS must be a positive integer, got {raw!r}")
    return threads


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


# How long the gloo threads may take to end after destroy_process_group() returns. The
# group's own worker threads are joined inside it, but gloo's transport loop
# (``gloo_tcp_loop``) is joined by whichever owner lets go of it last, and a connection that a
# peer closes while the group is torn down (the peer's process exiting at that moment, as in
# the dead-peer tests) can hold it a little longer: CI once saw it still alive right after
# destroy_process_group() on the rank whose peer had just exited. A group that something
# really holds keeps its threads for good, so this check still fails on it, after the grace.
TEARDOWN_GRACE_S = 5.0


def gloo_threads_after(grace_s: float) -> List[str]:
    """The gloo threads still alive once they are all gone or ``grace_s`` has passed."""
    deadline = time.monotonic() + grace_s
    alive = gloo_threads()
    while alive and time.monotonic() < deadline:
        time.sleep(0.01)
        alive = gloo_threads()
    return alive


def _worker(fn, rank, world_size, port, args, queue, pg_timeout_s, check_teardown=True):
    try:
        import gc

        import torch
        import torch.distributed as dist
        import zkernels  # noqa: F401 - before init_process_group: [Note: process group teardown]
        torch.set_num_threads(rank_threads())
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        try:
            dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=pg_timeout_s))
        except Exception as exc:  # noqa: BLE001
            if "EADDRINUSE" in str(exc):  # [Note: a port taken between choice and listen]
                queue.put((rank, None, traceback.format_exc()))
                return
            raise
        try:
            result = fn(rank, world_size, *args)
        finally:
            gc.collect()    # what fn dropped, cycles included, lets go of the group now
            dist.destroy_process_group()
        alive = gloo_threads_after(TEARDOWN_GRACE_S) if check_teardown else []
        if alive:
            raise RuntimeError(f"gloo threads {alive} outlived destroy_process_group() by "
                               f"{TEARDOWN_GRACE_S:g}s: something still holds the process group "
                               f"(see [Note: process group teardown] in zkernels/comm/select.py)")
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        queue.put((rank, False, traceback.format_exc()))


# [Note: a port taken between choice and listen]
# The store's port is one the OS just handed out and we released; until rank 0 listens on it,
# any other connection on the machine (another test's gloo pairs, on a busy CI host) may be
# given it as its ephemeral port, and rank 0's listen fails with EADDRINUSE before any test
# code ran. That is the harness's race, not a finding: run_ranks starts the ranks again on a
# fresh port (up to PORT_ATTEMPTS times); any other failure is reported as it is.
PORT_ATTEMPTS = 3


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 240.0,
              pg_timeout_s: float = 60.0, check_teardown: bool = True) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results
    by rank. Raises AssertionError with the failing rank's traceback, or on timeout.
    ``check_teardown=False`` skips the gloo-threads check, only for a reference run of
    third-party code (DeepSpeed keeps its groups in module globals) that is not under test."""
    for attempt in range(PORT_ATTEMPTS):
        outcome = _run_once(fn, world_size, args, timeout, pg_timeout_s, check_teardown)
        if outcome is not None:
            return outcome
    raise AssertionError(f"the store's port was taken {PORT_ATTEMPTS} times in a row "
                         f"(EADDRINUSE): see [Note: a port taken between choice and listen]")


def _run_once(fn, world_size, args, timeout, pg_timeout_s,
              check_teardown=True) -> Optional[List[Any]]:
    """One start of the ranks; None when the store's port was taken before they ran."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, queue,
                                                pg_timeout_s, check_teardown), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors, port_taken = {}, {}, False
    try:
        for _ in range(world_size):
            try:
                rank, ok, payload = queue.get(timeout=timeout)
            except Exception as exc:  # queue.Empty
                raise AssertionError(f"ranks did not finish within {timeout}s; "
                                     f"finished: {sorted(results) + sorted(errors)}") from exc
            if ok is None:
                port_taken = True
                break
            (results if ok else errors)[rank] = payload
            if errors:
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not (errors or port_taken) else 1)
            if p.is_alive():
                p.kill()
    if port_taken:
        return None
    if errors:
        rank = min(errors)
        raise AssertionError(f"rank {rank} of {world_size} failed:\n{errors[rank]}")
    return [results[r] for r in range(world_size)]
