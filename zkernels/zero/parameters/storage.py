"""Where a unit's shard bytes live: one injected storage object, asked, never tested by type.

[Note: shard storage]
Where a rank's persistent compute shards live is one storage object per optimizer, chosen
once from ``offload=`` / ``offload_params`` by ``state/placement.py`` and injected into the
parameter side's builders (``build.py``), which wrap each unit's shard in the one it
``keep``s: :class:`DeviceStorage` (the device; stages 1-2's replicated shards are device
views too), ``HostStorage`` (host RAM: [Note: parameter offload]) or ``DiskStorage`` (files:
[Note: parameters on NVMe]). The last two live on the state side (``state/param_offload.py``,
``state/param_nvme.py``) beside the copier and swap files they share with the offloaded
state, so parameters/ imports nothing of state/; the state's place ([Note: state places] in
``state/places.py``) allocates its in-memory kinds from the same objects (``empty``), and with
``offload_params`` the host master and the parameter shards share one ``HostStorage``.

``units.ShardedParams`` composes its shard instead of being subclassed per place: it owns the
full buffer and its states, the shard ``issue_gather``s into it. The update engine asks the
shard what it once read from flags: ``holds(where)`` (the bytes are in that memory: the
update writes them in place and, in pure fp32, the master is the shard), ``in_file`` (each
updated sub-group goes out through ``write_range``) and ``settle`` (before the update writes
them); ``read_values`` / ``load_values`` serve loads and saves wherever the bytes are.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from ...comm.base import Comm, Handle


class DeviceShard:
    """A unit's persistent compute shard on the compute device; the host and disk shards
    (``state/param_offload.py``, ``state/param_nvme.py``) override where their bytes live.

    Attributes:
        values: [shard_numel] compute dtype (a meta tensor where the bytes are in a file).
        device: the compute device (where the full buffer lives while gathered).
        in_file: the bytes are in a file (values through read/load_values, write_range).
    """

    in_file = False

    def __init__(self, values: torch.Tensor) -> None:
        self.values, self.device = values, values.device

    def holds(self, where: str) -> bool:
        """The bytes are addressable memory at ``where`` ("device" or "host")."""
        return where == "device"

    def issue_gather(self, full: torch.Tensor, comm: Comm, tag: Optional[str]) -> Handle:
        """Start the all-gather of every rank's shard into the allocated ``full`` (bringing
        this rank's to the device first where it lives elsewhere)."""
        return comm.all_gather(full, self.values, tag=tag)

    def held(self) -> List[torch.Tensor]:
        """The shard's device storage (for ``stats()``)."""
        return [self.values]

    def settle(self) -> None:
        """No copy still reads the bytes (the update may write them)."""

    def read_values(self) -> torch.Tensor:
        """The values as a tensor in memory (the shard itself where it is in memory)."""
        return self.values

    def load_values(self, values: torch.Tensor) -> None:
        """Overwrite the shard with ``values`` (a load, not a step's traffic)."""
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

    def take_counters(self) -> Dict[str, float]:
        """The shards' transfer figures: none (nothing moves)."""
        return {}

    def held_host(self) -> List[torch.Tensor]:
        """Host bytes of the shards (none) and of buffers beside them (:meth:`buffers`)."""
        return []

    buffers = held_host

    def disk_bytes(self) -> int:
        return 0
