"""Stage 3's secondary shard (``reshard_after_forward=R``, an int: FSDP2's integer, ZeRO++'s
hpZ): after its forward a unit keeps a copy of the gathered parameters sharded over a smaller
group of R consecutive ranks, so its backward gather stays inside that group.

[Note: secondary shards]
The shard group (K ranks: N, or hybrid's K) is cut into K/R secondary groups of R consecutive
ranks (R divides K, 1 < R < K as FSDP2 asks). When a unit's forward ends, each rank copies its
1/R chunk of the gathered buffer (secondary rank s = rank mod R keeps elements [s·P/R,
(s+1)·P/R) of the padded unit, P divisible by K hence by R) into a buffer of its own, then
frees the full buffer as ``reshard_after_forward=True`` does. The backward gather is an
all-gather of those chunks over the R ranks instead of the K-rank gather of primary shards;
after the unit's gradients are all in, the secondary chunk is dropped with the unit, and the
update's ``publish`` drops any stale one.

Per rank and step, for a unit of P padded elements of p bytes: the forward all-gather sends
p·P·(K-1)/K (within the shard group), the backward one p·P·(R-1)/R (within the secondary
group, e.g. a node), instead of p·P·(K-1)/K; memory adds p·P/R per unit between its forward
and its backward (every unit at the end of forward: p·Ψ/R), nothing between steps.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ...comm.base import Comm, Handle


class SecondaryShard:
    """One flat unit's secondary chunk (see [Note: secondary shards]).

    Args:
        comm: the collectives of this rank's secondary group (R ranks).
        padded_numel: the unit's padded elements (a multiple of K, so of R: R divides K,
            ``policy.check_reshard_after_forward``).
        dtype, device: of the compute parameters.
    """

    def __init__(self, comm: Comm, padded_numel: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.comm = comm
        n = padded_numel // comm.world_size
        self._slice = slice(comm.rank * n, (comm.rank + 1) * n)
        self._buf = torch.empty(n, dtype=dtype, device=device)
        self._nbytes = self._buf.untyped_storage().nbytes()
        self._buf.untyped_storage().resize_(0)

    def keep(self, full: torch.Tensor) -> None:
        """Copy this rank's chunk of the gathered ``full`` buffer ([padded_numel]), unless
        kept already (``full`` was gathered from it: the same values)."""
        if not self.held():
            self._buf.untyped_storage().resize_(self._nbytes)
            self._buf.copy_(full[self._slice])

    def gather_into(self, full: torch.Tensor, tag: Optional[str]) -> Handle:
        """All-gather the group's chunks into ``full`` (allocated). Collective (R ranks)."""
        return self.comm.all_gather(full, self._buf, tag=tag)

    def drop(self) -> None:
        self._buf.untyped_storage().resize_(0)

    def held(self) -> List[torch.Tensor]:  # its storage says whether it is kept
        return [self._buf] if self._buf.untyped_storage().nbytes() else []


def secondary_comm(comm, reshard_to: int, device, backend: str, timeout, meter):
    """The metered comm of this rank's secondary group: R consecutive ranks of its shard
    group. Collective over the world (a ``new_group`` per secondary group, same order on every
    rank)."""
    import torch.distributed as dist
    from ...comm.meter import MeteredComm
    from ...comm.select import make_comm
    inner = getattr(comm, "shard", comm)        # hybrid: the shard group's comm
    inner = getattr(inner, "inner", inner)      # unmetered
    group = getattr(inner, "group", None)
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    # Every rank must create every group: gather each rank's shard group's world ranks.
    every: List[Optional[List[int]]] = [None] * dist.get_world_size()
    dist.all_gather_object(every, ranks)
    blocks = []
    for shard_ranks in every:
        for i in range(0, len(shard_ranks), reshard_to):
            block = list(shard_ranks[i:i + reshard_to])
            if block not in blocks:
                blocks.append(block)
    mine = None
    me = dist.get_rank()
    for block in sorted(blocks):
        pg = dist.new_group(block)
        if me in block:
            mine = pg
    return MeteredComm(make_comm(mine, device, backend, timeout), meter)


def attach_secondary_shards(units, comm, reshard_to: int, device, backend: str, timeout,
                            meter) -> None:
    """``reshard_after_forward=R``: give every unit's gather policy its secondary shard over
    R ranks (see [Note: secondary shards]). Collective over the world."""
    second = secondary_comm(comm, reshard_to, device, backend, timeout, meter)
    for u in units:
        u.gather.secondary = SecondaryShard(second, u.layout.padded_numel,
                                            u.gather.compute_shard.dtype, device)
