"""Peak resident memory of this process per phase, above a baseline: what the build-peak
benchmark, its slow test and the demo's "peak while building" column measure on CPU ranks.

[Note: measuring peak RSS honestly]
The kernel's high-water mark ``VmHWM`` (``/proc/self/status``) is exact: it sees every page
the process touched, however briefly, with no sampling gap. Writing ``5`` to
``/proc/self/clear_refs`` resets it to the current RSS (Linux >= 4.0), so each phase gets its
own peak: ``peak = VmHWM at the phase's end - baseline``, the baseline being the RSS taken
once after the imports and the process group (the same for every phase, so a phase that
leaves memory behind shows it in the next one's peak too). Where ``clear_refs`` cannot be
written (another kernel, a sandbox), a sampler thread reading ``VmRSS`` every
``interval_s`` takes its place; the result says which (``exact``).

RSS counts file pages mapped into the process as well as anonymous memory. Safetensors'
``safe_open`` memory-maps the file, so the pages a rank reads stay in its RSS until the file
is closed, though the kernel may drop them at any time (they are clean page cache, shared by
every rank that maps the file). We count them: the bound is on RSS, what a job's memory
limit sees. The sampler also records the peak of ``RssAnon`` and of ``RssFile`` separately
(sampled, so they may miss a short spike) so a table can show how much of a peak was the
mapped file.
"""
from __future__ import annotations

import contextlib
import re
import threading
import time
from typing import Dict, Iterator, Optional

_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def read_status() -> Dict[str, int]:
    """``VmRSS``, ``VmHWM``, ``RssAnon``, ``RssFile`` of this process, in bytes (0 where the
    kernel does not report one)."""
    with open("/proc/self/status") as f:
        text = f.read()
    out = {}
    for k in _FIELDS:
        m = re.search(rf"^{k}:\s+(\d+)\s+kB", text, re.MULTILINE)
        out[k] = int(m.group(1)) * 1024 if m else 0
    return out


def reset_peak() -> bool:
    """Reset ``VmHWM`` to the current RSS; False where ``clear_refs`` cannot be written."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMeter:
    """Per-phase peak RSS above the baseline taken at construction (see [Note: measuring peak
    RSS honestly]). ``with meter.phase("build"): ...``; then ``meter.peaks["build"]`` is a
    dict of ``peak`` (bytes above the baseline, exact where ``exact``), ``anon`` and
    ``file`` (sampled peaks of RssAnon and RssFile above their baselines) and ``exact``.

    Args:
        interval_s: the sampler's period (> 0).
    """

    def __init__(self, interval_s: float = 0.002) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.interval_s = float(interval_s)
        self.baseline = read_status()
        self.peaks: Dict[str, Dict[str, int]] = {}
        self._max: Dict[str, int] = {}
        self._stop: Optional[threading.Event] = None

    def _sample(self, stop: threading.Event) -> None:
        while not stop.is_set():
            s = read_status()
            for k in ("VmRSS", "RssAnon", "RssFile"):
                self._max[k] = max(self._max.get(k, 0), s[k])
            stop.wait(self.interval_s)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure the body's peak as phase ``name``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        exact = reset_peak()
        self._max = dict(read_status())
        stop = threading.Event()
        sampler = threading.Thread(target=self._sample, args=(stop,), daemon=True)
        sampler.start()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            stop.set()
            sampler.join()
            end = read_status()
            for k in ("VmRSS", "RssAnon", "RssFile"):
                self._max[k] = max(self._max[k], end[k])
            top = end["VmHWM"] if exact else self._max["VmRSS"]
            b = self.baseline
            self.peaks[name] = dict(peak=top - b["VmRSS"],
                                    anon=self._max["RssAnon"] - b["RssAnon"],
                                    file=self._max["RssFile"] - b["RssFile"],
                                    after=end["VmRSS"] - b["VmRSS"], exact=exact,
                                    seconds=time.perf_counter() - t0)
