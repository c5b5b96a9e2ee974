"""The single-rank backend: used when no process group is initialized (world size 1).

Every collective over one rank is a copy (or nothing), done at once; handles are complete.
"""
from __future__ import annotations

from typing import Optional

import torch

from .base import Handle


class _Done:
    def wait(self) -> None:
        return None


class LocalComm:
    """:class:`zkernels.comm.base.Comm` for a world of one rank, no torch.distributed needed."""

    rank = 0
    world_size = 1

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *,
                       average: bool = False, tag: Optional[str] = None) -> Handle:
        _check_sizes("reduce_scatter", output, input)
        return _copy(output, input)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *,
                   tag: Optional[str] = None) -> Handle:
        _check_sizes("all_gather", input, output)
        return _copy(output, input)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *,
                   tag: Optional[str] = None) -> Handle:
        _check_sizes("all_to_all", output, input)
        return _copy(output, input)

    def all_reduce(self, tensor: torch.Tensor, *, op: str = "sum",
                   tag: Optional[str] = None) -> Handle:
        if op not in ("sum", "max"):
            raise ValueError(f"op must be 'sum' or 'max', got {op!r}")
        return _Done()


def _check_sizes(name: str, shard: torch.Tensor, full: torch.Tensor) -> None:
    if shard.numel() != full.numel():
        raise ValueError(f"{name}: shard has {shard.numel()} elements but the full buffer "
                         f"{full.numel()} (world size 1)")


def _copy(output: torch.Tensor, input: torch.Tensor) -> Handle:
    """One rank's collective: ``output`` is ``input`` (copied unless they are one buffer)."""
    if output.data_ptr() != input.data_ptr():
        output.copy_(input)
    return _Done()
