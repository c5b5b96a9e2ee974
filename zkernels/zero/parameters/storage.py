"""Where a unit's shard bytes live: one injected storage object, asked, never tested by type.

[Note: shard storage]
A rank keeps one persistent compute-dtype shard per flat unit. Where its bytes live is one
storage object per optimizer, chosen once from ``offload=`` / ``offload_params`` by
``state/placement.py`` and handed to the parameter side's builders (``build.py``), which
give each unit the per-unit shard it ``keep``s:

- :class:`DeviceStorage` / :class:`DeviceShard`: on the compute device (no
  ``offload_params``, and stages 1-2's replicated units, whose shard is a view of the full
  buffer);
- ``state/param_offload.py``'s ``HostStorage`` / ``HostShard``: in host RAM, brought to the
  device ahead of each gather ([Note: parameter offload]);
- ``state/param_nvme.py``'s ``DiskStorage`` / ``DiskShard``: in a file, through bounded host
  bounces ([Note: parameters on NVMe]).

The parameter side knows only this module's protocol: the host and disk storages live on the
state side, beside the copier and the swap files they share with the offloaded state, so
parameters/ imports nothing of state/.

The gather policy (``units.ShardedParams``) composes a shard instead of being subclassed per
place: it owns the full buffer and its states, the shard only ``issue_gather``s into it. The
update engine (``state/engine.py``) asks the shard what it used to read from flags: whether
its bytes are in the memory where the update runs (``holds``: then the update writes them in
place, and in pure fp32 the master is the shard itself), whether they are in a file
(``in_file``: the update writes each sub-group through ``write_range``), and it waits on
``settle`` before writing them; ``read_values`` / ``load_values`` serve loads and saves
wherever the bytes are. The storage object also allocates the engine's own state where it
keeps it (``empty``), so the parameter shard and the state come from the same objects.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Protocol

import torch

from ...comm.base import Comm, Handle


class Shard(Protocol):
    """One unit's persistent compute shard, wherever its bytes are.

    ``values``: [shard_numel] compute dtype; a meta tensor where the bytes are in a file.
    ``device``: the compute device (where the full buffer lives while gathered).
    ``in_file``: the bytes are in a file (values through read/load_values, write_range)."""

    values: torch.Tensor
    device: torch.device
    in_file: bool

    def holds(self, where: str) -> bool:
        """The bytes are addressable memory at ``where`` ("device" or "host")."""

    def issue_gather(self, full: torch.Tensor, comm: Comm, tag: Optional[str]) -> Handle:
        """Start the all-gather of every rank's shard into the allocated ``full`` (bringing
        this rank's to the device first where it lives elsewhere)."""

    def held(self) -> List[torch.Tensor]:
        """The shard's device storage (for ``stats()``)."""

    def settle(self) -> None:
        """No copy still reads the bytes (the update may write them)."""

    def read_values(self) -> torch.Tensor:
        """The values as a tensor in memory (the shard itself where it is in memory)."""

    def load_values(self, values: torch.Tensor) -> None:
        """Overwrite the shard with ``values`` (a load, not a step's traffic)."""


class DeviceShard:
    """A shard on the compute device (see [Note: shard storage])."""

    in_file = False

    def __init__(self, values: torch.Tensor) -> None:
        self.values, self.device = values, values.device

    def holds(self, where: str) -> bool:
        return where == "device"

    def issue_gather(self, full, comm, tag):
        return comm.all_gather(full, self.values, tag=tag)

    def held(self) -> List[torch.Tensor]:
        return [self.values]

    def settle(self) -> None:
        return None

    def read_values(self) -> torch.Tensor:
        return self.values

    def load_values(self, values: torch.Tensor) -> None:
        if values is not self.values:
            self.values.copy_(values.reshape(-1))


class DeviceStorage:
    """Bytes on the compute device: the shards stay where they were built (see [Note: shard
    storage]); the state side's device kinds are allocated here too."""

    def keep(self, values: torch.Tensor, lo: int, hi: int) -> DeviceShard:
        """The unit's shard ``values`` (built on the device), kept there."""
        return DeviceShard(values)

    @staticmethod
    def empty(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``n`` zeros of ``dtype`` on ``device`` (a state kind kept on the device)."""
        return torch.zeros(n, dtype=dtype, device=device)

    def settle(self) -> None:
        return None

    def take_counters(self) -> Dict[str, float]:
        """The shards' transfer figures: none (nothing moves)."""
        return {}

    def held_host(self) -> List[torch.Tensor]:
        return []

    def buffers(self) -> List[torch.Tensor]:
        return []

    def disk_bytes(self) -> int:
        return 0
