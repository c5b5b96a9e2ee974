"""Volume meter: bytes this rank sends, per collective kind, counted at the one choke point
every collective passes through (:class:`MeteredComm`).

[Note: ring volume]
For ring algorithms a rank sends ``B * (N - 1) / N`` bytes for a reduce-scatter or an
all-gather of a full buffer of ``B`` bytes, and ``2 * B * (N - 1) / N`` for an all-reduce
(a reduce-scatter followed by an all-gather). ``B`` is the full (unsharded) buffer: the
reduce-scatter's input, the all-gather's output, the all-reduce's tensor. Rank-aligned buffers
divide by ``N``, so the counts are exact integers for them; tiny all-reduces round down.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from .base import Comm, Handle

KINDS = ("reduce_scatter", "all_gather", "all_reduce")


class VolumeMeter:
    """Counts bytes sent per collective kind; a step's counts become "last" on
    :meth:`close_step`.

    The optimizer closes a step at the end of ``step()``, so the last step's counts include
    the reductions that stage 2 launched during backward.
    """

    def __init__(self) -> None:
        self._current: Dict[str, int] = dict.fromkeys(KINDS, 0)
        self._last: Dict[str, int] = dict.fromkeys(KINDS, 0)

    def record(self, kind: str, buffer_bytes: int, world_size: int) -> None:
        """Count one collective over a full buffer of ``buffer_bytes`` (see [Note: ring volume])."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        factor = 2 if kind == "all_reduce" else 1
        self._current[kind] += factor * buffer_bytes * (world_size - 1) // world_size

    def close_step(self) -> None:
        """Make the counts so far the last step's and start counting afresh."""
        self._last, self._current = self._current, dict.fromkeys(KINDS, 0)

    def current_step(self) -> Dict[str, int]:
        """Counts since the last :meth:`close_step` (e.g. what backward has sent so far)."""
        out = dict(self._current)
        out["total"] = sum(self._current.values())
        return out

    def last_step(self) -> Dict[str, int]:
        """``{"reduce_scatter", "all_gather", "all_reduce", "total"}`` bytes of the last
        closed step."""
        out = dict(self._last)
        out["total"] = sum(self._last.values())
        return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class MeteredComm:
    """A :class:`Comm` that counts every collective into ``meter`` before delegating it."""

    def __init__(self, inner: Comm, meter: VolumeMeter) -> None:
        self.inner = inner
        self.meter = meter
        self.rank = inner.rank
        self.world_size = inner.world_size

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *,
                       average: bool = False, tag: Optional[str] = None) -> Handle:
        self.meter.record("reduce_scatter", _nbytes(input), self.world_size)
        return self.inner.reduce_scatter(output, input, average=average, tag=tag)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *,
                   tag: Optional[str] = None) -> Handle:
        self.meter.record("all_gather", _nbytes(output), self.world_size)
        return self.inner.all_gather(output, input, tag=tag)

    def all_reduce(self, tensor: torch.Tensor, *, op: str = "sum",
                   tag: Optional[str] = None) -> Handle:
        self.meter.record("all_reduce", _nbytes(tensor), self.world_size)
        return self.inner.all_reduce(tensor, op=op, tag=tag)
