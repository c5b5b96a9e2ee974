"""Volume meter: bytes this rank sends, per collective kind, counted at the one choke point
every collective passes through (:class:`MeteredComm`).

[Note: ring volume]
For ring algorithms a rank sends ``B * (N - 1) / N`` bytes for a reduce-scatter or an
all-gather of a full buffer of ``B`` bytes, and ``2 * B * (N - 1) / N`` for an all-reduce
(a reduce-scatter followed by an all-gather). ``B`` is the full (unsharded) buffer: the
reduce-scatter's input, the all-gather's output, the all-reduce's tensor. Rank-aligned buffers
divide by ``N``, so the counts are exact integers for them; tiny all-reduces round down.
An all-to-all of ``B`` bytes in N equal chunks sends ``B * (N - 1) / N`` too (each rank keeps
its own chunk). The meter has no all-to-all kind: the package's only all-to-alls are a
reduce-scatter's exchange (gloo's exact reduce-scatter inside torch_comm, the quantized one of
``quantized.py``, which issues two: int8/int4 codes and fp32 scales), so they count as
``"reduce_scatter"``, the collective the optimizer asked for, at the bytes really sent: with
``quantize_grads`` the reduce-scatter kind is the codes plus the scales. Likewise the
quantized all-gather issues two all-gathers (int8 codes and scales) and counts under
``"all_gather"`` at the bytes it sends.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from .base import Comm, Handle

KINDS = ("reduce_scatter", "all_gather", "all_reduce")
SCOPES = ("within_group", "across_groups")


class VolumeMeter:
    """Counts bytes sent per collective kind; a step's counts become "last" on
    :meth:`close_step`.

    The optimizer closes a step at the end of ``step()``, so the last step's counts include
    the reductions that stage 2 launched during backward.
    """

    def __init__(self) -> None:
        self._current: Dict[str, int] = dict.fromkeys(KINDS, 0)
        self._last: Dict[str, int] = dict.fromkeys(KINDS, 0)
        self._current_scopes: Dict[str, int] = dict.fromkeys(SCOPES, 0)
        self._last_scopes: Dict[str, int] = dict.fromkeys(SCOPES, 0)

    def record(self, kind: str, buffer_bytes: int, world_size: int,
               scope: str = "within_group") -> None:
        """Count one collective over a full buffer of ``buffer_bytes`` (see [Note: ring
        volume]) toward ``scope`` (see [Note: traffic scopes])."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
        factor = 2 if kind == "all_reduce" else 1
        sent = factor * buffer_bytes * (world_size - 1) // world_size
        self._current[kind] += sent
        self._current_scopes[scope] += sent

    def close_step(self) -> None:
        """Make the counts so far the last step's and start counting afresh."""
        self._last, self._current = self._current, dict.fromkeys(KINDS, 0)
        self._last_scopes, self._current_scopes = (self._current_scopes,
                                                   dict.fromkeys(SCOPES, 0))

    def current_step_scopes(self) -> Dict[str, int]:
        """``{"within_group", "across_groups"}`` since the last :meth:`close_step`."""
        return dict(self._current_scopes)

    def last_step_scopes(self) -> Dict[str, int]:
        """``{"within_group", "across_groups"}`` bytes of the last closed step (they add up
        to :meth:`last_step`'s total)."""
        return dict(self._last_scopes)

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

    def __init__(self, inner: Comm, meter: VolumeMeter, scope: str = "within_group") -> None:
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
        self.inner = inner
        self.meter = meter
        self.scope = scope
        self.rank = inner.rank
        self.world_size = inner.world_size

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *,
                       average: bool = False, tag: Optional[str] = None) -> Handle:
        self.meter.record("reduce_scatter", _nbytes(input), self.world_size, self.scope)
        return self.inner.reduce_scatter(output, input, average=average, tag=tag)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *,
                   tag: Optional[str] = None) -> Handle:
        self.meter.record("all_gather", _nbytes(output), self.world_size, self.scope)
        return self.inner.all_gather(output, input, tag=tag)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *,
                   tag: Optional[str] = None) -> Handle:
        # a reduce-scatter's exchange (see [Note: ring volume])
        self.meter.record("reduce_scatter", _nbytes(input), self.world_size, self.scope)
        return self.inner.all_to_all(output, input, tag=tag)

    def all_reduce(self, tensor: torch.Tensor, *, op: str = "sum",
                   tag: Optional[str] = None) -> Handle:
        self.meter.record("all_reduce", _nbytes(tensor), self.world_size, self.scope)
        return self.inner.all_reduce(tensor, op=op, tag=tag)
