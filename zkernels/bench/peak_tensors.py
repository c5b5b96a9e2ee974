"""Peak bytes of tensor storage allocated inside a block, on every device: the demo's "peak
while building" column.

[Note: tracked tensor bytes]
RSS (``peak_rss.py``) is what a memory limit sees, but at the demo's size (a few MiB of
parameters) the allocator's and torch's own pages drown the model's bytes. Here we count
tensors instead: ``torch.profiler`` with ``profile_memory=True`` records every allocation and
free of torch's allocators (CPU and CUDA) as ``[memory]`` events with signed byte counts; the
running sum over the block, in time order, peaks at what the block added at its worst
moment. Storage that existed before the block is not counted (a reference model kept beside
it costs nothing here). Tensors safetensors hands out while a file is open are counted (they
are freed when the file is closed), though their pages are the file's.
"""
from __future__ import annotations

import contextlib
from typing import Iterator


class TensorPeak:
    """``with TensorPeak() as tp: ...``; then ``tp.peak_bytes`` (the largest net bytes the
    block had allocated at any moment) and ``tp.net_bytes`` (what it left allocated)."""

    def __init__(self) -> None:
        self.peak_bytes = 0
        self.net_bytes = 0
        self._prof = None

    def __enter__(self) -> "TensorPeak":
        from torch.profiler import ProfilerActivity, profile
        import torch
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                         if torch.cuda.is_available() else [])
        self._prof = profile(activities=acts, profile_memory=True)
        with _quiet_stderr():
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        with _quiet_stderr():
            self._prof.__exit__(*exc)
        events = [e for e in self._prof.profiler.kineto_results.events()
                  if e.name() == "[memory]"]
        cur = peak = 0
        for e in sorted(events, key=lambda e: e.start_ns()):
            cur += e.nbytes()
            peak = max(peak, cur)
        self.peak_bytes, self.net_bytes = peak, cur
        self._prof = None


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null: Kineto writes a line to it at every profiler start and
    stop, whatever its log level (only those two calls are wrapped, not the measured block)."""
    import os
    import sys
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


@contextlib.contextmanager
def tensor_peak() -> Iterator[TensorPeak]:
    """:class:`TensorPeak` as a context manager function."""
    with TensorPeak() as tp:
        yield tp
