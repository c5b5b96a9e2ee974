"""A progress bar on stderr: tqdm when installed, else a plain one-line bar."""
from __future__ import annotations

import sys
import time


class _PlainBar:
    def __init__(self, total: int, desc: str, enabled: bool):
        self.total, self.desc, self.enabled = total, desc, enabled
        self.n, self.t0, self.last = 0, time.perf_counter(), 0.0

    def update(self, n: int = 1, **postfix) -> None:
        self.n += n
        now = time.perf_counter()
        # Redraw at most 10 times a second: stderr may be a slow pipe.
        if self.enabled and (now - self.last > 0.1 or self.n == self.total):
            self.last = now
            done = int(30 * self.n / max(self.total, 1))
            extra = " ".join(f"{k}={v:.4f}" for k, v in postfix.items())
            sys.stderr.write(f"\r{self.desc:>14s} [{'#' * done}{'.' * (30 - done)}] "
                             f"{self.n}/{self.total} {now - self.t0:5.1f}s {extra}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


class _TqdmBar:
    def __init__(self, total: int, desc: str, enabled: bool):
        from tqdm import tqdm
        self.bar = tqdm(total=total, desc=desc, disable=not enabled, file=sys.stderr,
                        dynamic_ncols=True, leave=True)

    def update(self, n: int = 1, **postfix) -> None:
        if postfix:
            self.bar.set_postfix({k: f"{v:.4f}" for k, v in postfix.items()}, refresh=False)
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def progress(total: int, desc: str, enabled: bool = True):
    """A bar with ``update(n, **floats)`` and ``close()``; silent when not ``enabled``."""
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return _PlainBar(total, desc, enabled)
    return _TqdmBar(total, desc, enabled)
