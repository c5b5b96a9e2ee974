"""What every benchmark section shares: timing, the metadata row, the table, the JSON file.

Timing: on CUDA, events around each call after warm-up (the Triton JIT compiles in warm-up);
on CPU, ``perf_counter`` after warm-up. Each measurement is the median over ``repeat`` calls
with the min and max, so a table never shows a single lucky run.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch


def timeit(fn: Callable[[], object], device: torch.device, repeat: int = 5,
           warmup: int = 1) -> Dict[str, float]:
    """Median / min / max milliseconds of ``fn()``.

    Args:
        fn: the call to time; on CUDA it may return before its kernels finish.
        device: where ``fn`` runs (CUDA: event timing on the current stream).
        repeat: timed calls (>= 1).
        warmup: untimed calls first.

    Returns:
        ``{"median_ms", "min_ms", "max_ms"}``.
    """
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    for _ in range(warmup):
        fn()
    times: List[float] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeat):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return dict(median_ms=statistics.median(times), min_ms=min(times), max_ms=max(times))


def timeit_interleaved(fns: Sequence[Callable[[], object]], device: torch.device,
                       repeat: int = 5, warmup: int = 1,
                       setups: Optional[Sequence[Callable[[], object]]] = None) -> List[dict]:
    """``timeit`` of several calls measured side by side: each round times every call once,
    in an order that rotates from round to round, so that a burst of load on a shared machine
    hits all of them alike instead of whichever ran its block of repeats then. Besides each
    call's median/min/max, ``paired`` is the median over the rounds of the first call's time
    over this call's in the same round (``fns[0]`` is the peer: >1 means faster than it).

    Args:
        fns: the calls; ``fns[0]`` the reference the ``paired`` ratios divide.
        device, repeat, warmup: as ``timeit`` (``warmup`` untimed rounds first).
        setups: optional untimed call before each of ``fns`` (e.g. entering a backend).

    Returns:
        one dict per call: ``median_ms``, ``min_ms``, ``max_ms``, ``paired``.
    """
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    setups = list(setups) if setups is not None else [None] * len(fns)
    cuda = device.type == "cuda"

    def once(i: int) -> float:
        if setups[i] is not None:
            setups[i]()
        if cuda:
            torch.cuda.synchronize(device)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fns[i]()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fns[i]()
        return 1e3 * (time.perf_counter() - t0)
    for _ in range(warmup):
        for i in range(len(fns)):
            once(i)
    times: List[List[float]] = [[] for _ in fns]
    for r in range(repeat):
        for k in range(len(fns)):
            i = (r + k) % len(fns)
            times[i].append(once(i))
    return [dict(median_ms=statistics.median(t), min_ms=min(t), max_ms=max(t),
                 paired=statistics.median(p / q if q > 0 else float("inf")
                                          for p, q in zip(times[0], t)))
            for t in times]


def load_average() -> Optional[float]:
    """The 1-minute load average (None where the OS does not say): how busy the machine was."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


class SectionUnavailable(RuntimeError):
    """A section cannot run here (e.g. its backend is not built): reported, then skipped."""


def gbps(num_bytes: int, ms: float) -> float:
    """Gigabytes (1e9) per second for ``num_bytes`` moved in ``ms`` milliseconds."""
    return num_bytes / (ms * 1e-3) / 1e9 if ms > 0 else float("inf")


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_revision() -> str:
    """The checkout's short commit, ``+dirty`` with uncommitted changes to tracked files."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, cwd=Path(__file__).resolve().parent)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10,
                               cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    rev = out.stdout.strip() or "unknown"
    return rev + ("+dirty" if dirty.stdout.strip() else "")


def metadata(device: torch.device) -> dict:
    """The row that says where and with what a benchmark ran."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    meta = dict(kind="meta", machine=platform.node(), cpu=cpu_model(),
                num_cpus=os.cpu_count(), threads=torch.get_num_threads(),
                torch=torch.__version__, triton=triton_version, python=platform.python_version(),
                git_revision=git_revision(), device=str(device), load_average=load_average(),
                utc_time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    if device.type == "cuda":
        meta.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    return meta


def format_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """A plain-text table of ``columns`` (missing values print as '-'; floats with 3
    significant digits)."""
    def cell(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"
        return str(v)
    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join([line(columns), line(["-" * w for w in widths])] + [line(r) for r in cells])


def write_json(path: str, rows: Sequence[dict]) -> None:
    """Write ``rows`` (the metadata row first) as a JSON list to ``path``, whose folder must
    exist (the command line checks it before running: a mistyped folder is an error, not a new
    folder somewhere)."""
    Path(path).write_text(json.dumps(list(rows), indent=1) + "\n")
