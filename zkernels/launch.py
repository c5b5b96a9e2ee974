"""Start N ranks on this machine and report a failure once (``python -m zkernels demo``'s).

:func:`run_ranks` starts each rank as ``python zkernels/_rank.py MODULE:FUNC ARGS`` with
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` set and a rendezvous file
for :func:`init_method`, waits for all of them, and raises :class:`RanksFailed` when one
fails: the first failing rank's traceback, once, and the command that reproduces it.

[Note: one report per failure]
When one rank fails its peers fail after it (gloo: "Connection closed by peer" at their next
collective; NCCL: a timeout), and torchrun adds a summary of its own: a user got three
tracebacks of which only the first was the cause (issue 36). torchrun's ranks write to its
own stderr, so no launcher around it can tell the three apart, and its "first observed
failure" comes from error files stamped to the second. So the ranks are started here. Each
records its exception instead of printing it (``_rank.py``: type, message, traceback and the
time it left the rank's code, before the teardown that releases the peers); everything else a
rank prints reaches the terminal as it comes (the progress bar). Once a rank exits non-zero,
the others have ``grace_s`` to end by themselves, then get SIGTERM and, ``kill_after_s`` later,
SIGKILL: no peer waits on a dead rank past that. The cause is the earliest failure that is not
a lost peer (:func:`lost_peer`), else the earliest failure; a rank that died without an
exception (a signal, ``os._exit``) counts from when it was seen to exit, and the report says
its exit status (a crash's native traceback is on stderr above: ``faulthandler``). The other
ranks get one line each, without their tracebacks.

The ranks meet through a file store (``file://`` in a temporary folder) rather than a TCP
port: nothing to choose, so nothing another process can take between choosing and binding.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Mapping, Optional, Sequence

from ._rank import ERROR_FILE_ENV, failure_recorded  # noqa: F401 (for the ranks)

INIT_METHOD_ENV = "ZKERNELS_INIT_METHOD"
RANK_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_rank.py")
# What torch.distributed raises on a rank whose peer is gone before it (gloo, NCCL, the
# store): never the cause while another failure is.
LOST_PEER_TYPES = ("RuntimeError", "DistError", "DistBackendError", "DistNetworkError",
                   "DistStoreError")
LOST_PEER = re.compile(r"Connection (closed|reset) by peer|Broken pipe|Timed out|timed out|"
                       r"Socket Timeout|NCCL communicator was aborted|remote process exited|"
                       r"Watchdog caught collective operation timeout")


class RanksFailed(RuntimeError):
    """A rank failed, or the ranks did not finish in time; the message is the report."""


class RanksTimedOut(RanksFailed):
    """The ranks did not finish within the launcher's timeout (all of them stopped)."""


def init_method() -> str:
    """The rendezvous :func:`run_ranks` gave this rank (``file://...``), or ``env://`` when
    another launcher (torchrun) started it: for ``dist.init_process_group(init_method=...)``,
    with ``rank=`` and ``world_size=`` from ``RANK`` and ``WORLD_SIZE``."""
    return os.environ.get(INIT_METHOD_ENV, "env://")


def lost_peer(record: Optional[dict]) -> bool:
    """Whether a rank's recorded failure is what a rank raises when a peer died first."""
    return record is not None and record["type"] in LOST_PEER_TYPES and \
        bool(LOST_PEER.search(record["message"]))


def _exit_status(rc: int) -> str:
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"exit status {rc}"


def _last_line(record: dict) -> str:
    return f"{record['type']}: {record['message']}".strip().splitlines()[0]


def failure_report(rcs: Mapping[int, int], seen_ns: Mapping[int, int],
                   records: Mapping[int, dict], stopped: Sequence[int], reproduce: str) -> str:
    """The report of a failed run ([Note: one report per failure]): the cause's traceback
    once, a line per other rank, then the reproduce line.

    Args:
        rcs: each rank's exit status (negative: the signal).
        seen_ns: when each rank was seen to exit (``time.time_ns()``).
        records: the recorded failures, by rank (``_rank.record_failure``'s JSON).
        stopped: the ranks this launcher stopped (their status is its signal).
        reproduce: the command that runs the same again.

    Raises:
        ValueError: no rank failed.
    """
    failed = [r for r, rc in rcs.items() if rc != 0 and (r not in stopped or r in records)]
    if not failed:
        raise ValueError("failure_report: no rank failed (every exit status is 0)")
    root = min(failed, key=lambda r: (lost_peer(records.get(r)),
                                      records[r]["time_ns"] if r in records else seen_ns[r],
                                      r))
    lines = [f"rank {root} of {len(rcs)} failed first:"]
    if root in records:
        lines.append(records[root]["traceback"].rstrip())
    else:
        lines.append(f"it exited with {_exit_status(rcs[root])} without a Python exception "
                     "(whatever it printed is above)")
    for r in sorted(rcs):
        if r == root:
            continue
        if r in stopped and r not in records:
            lines.append(f"rank {r}: stopped after rank {root} failed")
        elif rcs[r] == 0:
            lines.append(f"rank {r}: finished")
        elif lost_peer(records.get(r)) or (
                r in records and root in records
                and _last_line(records[r]) == _last_line(records[root])):
            lines.append(f"rank {r}: failed after it")
        elif r in records:
            lines.append(f"rank {r}: failed too: {_last_line(records[r])}")
        else:
            lines.append(f"rank {r}: exited with {_exit_status(rcs[r])}")
    lines.append(f"reproduce: {reproduce}")
    return "\n".join(lines)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_ranks(target: str, args: Sequence[str], nproc: int, *, reproduce: str,
              timeout_s: float, env: Optional[Mapping[str, str]] = None,
              grace_s: float = 5.0, kill_after_s: float = 3.0) -> None:
    """Run ``target`` (``"module:function"``, called with ``args`` as a list) on ``nproc``
    local ranks and wait for them; return when every rank exits 0.

    Args:
        target: the rank's entry point, imported in each rank.
        args: its arguments (strings).
        nproc: how many ranks.
        reproduce: the command that runs the same again, for the report.
        timeout_s: stop every rank and fail after this many seconds.
        env: the ranks' environment (default: this process's), to which the rank variables
            are added.
        grace_s: how long the others may go on after a rank failed, before they are stopped.
        kill_after_s: how long a stopped rank has between SIGTERM and SIGKILL.

    Raises:
        ValueError: ``target`` is not ``module:function``, or ``nproc``, ``timeout_s``,
            ``grace_s`` or ``kill_after_s`` is out of range.
        RanksFailed: a rank failed (the message is :func:`failure_report`'s).
        RanksTimedOut: the ranks did not finish within ``timeout_s``.
    """
    if not re.fullmatch(r"[\w.]+:\w+", target):
        raise ValueError(f"target must be 'module:function', got {target!r}")
    if not (isinstance(nproc, int) and nproc >= 1):
        raise ValueError(f"nproc must be an int >= 1, got {nproc!r}")
    for name, value in (("timeout_s", timeout_s), ("grace_s", grace_s),
                        ("kill_after_s", kill_after_s)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    folder = tempfile.mkdtemp(prefix="zkernels-launch-")
    procs: List[subprocess.Popen] = []
    try:
        base = dict(os.environ if env is None else env)
        base.update(WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                    **{INIT_METHOD_ENV: "file://" + os.path.join(folder, "rendezvous")})
        for rank in range(nproc):
            rank_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), **{
                ERROR_FILE_ENV: os.path.join(folder, f"rank{rank}.error.json")})
            # Own session: stopping a rank stops whatever it started too.
            procs.append(subprocess.Popen([sys.executable, RANK_SCRIPT, target, *args],
                                          env=rank_env, start_new_session=True))
        rcs, seen_ns, stopped = _wait(procs, timeout_s, grace_s, kill_after_s, reproduce)
        if all(rc == 0 for rc in rcs.values()):
            return
        records = {}
        for rank in range(nproc):
            path = os.path.join(folder, f"rank{rank}.error.json")
            if os.path.exists(path):
                with open(path) as f:
                    records[rank] = json.load(f)
        raise RanksFailed(failure_report(rcs, seen_ns, records, stopped, reproduce))
    finally:
        for p in procs:     # never a stray rank, whatever happened here
            if p.poll() is None:
                _signal_group(p, signal.SIGKILL)
                p.wait()
        shutil.rmtree(folder, ignore_errors=True)


def _wait(procs, timeout_s: float, grace_s: float, kill_after_s: float, reproduce: str):
    """:func:`run_ranks`' wait: ``(exit statuses, times seen, ranks stopped)`` by rank."""
    rcs: Dict[int, int] = {}
    seen_ns: Dict[int, int] = {}
    stopped: List[int] = []
    deadline = time.monotonic() + timeout_s
    failed_at = stop_at = None
    while len(rcs) < len(procs):
        for rank, p in enumerate(procs):
            if rank not in rcs and p.poll() is not None:
                rcs[rank], seen_ns[rank] = p.returncode, time.time_ns()
                if p.returncode != 0 and failed_at is None:
                    failed_at = time.monotonic()
        now = time.monotonic()
        if now > deadline:
            for p in procs:
                _signal_group(p, signal.SIGKILL)
            raise RanksTimedOut(f"the ranks did not finish within {timeout_s:g}s (all "
                                f"stopped)\nreproduce: {reproduce}")
        if failed_at is not None and stop_at is None and now > failed_at + grace_s:
            stop_at = now
            for rank, p in enumerate(procs):
                if rank not in rcs:
                    stopped.append(rank)
                    _signal_group(p, signal.SIGTERM)
        if stop_at is not None and now > stop_at + kill_after_s:
            for rank in stopped:
                if rank not in rcs:
                    _signal_group(procs[rank], signal.SIGKILL)
        time.sleep(0.02)
    return rcs, seen_ns, stopped
