"""Where stage 2-3's reduced gradient shards go as each reduce-scatter finishes: one fp32 shard
per unit, on the device (added into in place) or in host RAM (filled by copies off the compute
stream, see [Note: CPU offload step] in ``engine.py``). The gradient strategies
(``gradients/grad_reducers.py``) use it through the GradSink protocol: ``accumulate(unit_index,
reduced) -> Optional[fence]``, ``collect()``, ``reset()``.
"""
from __future__ import annotations

import time
from typing import List, Optional, Sequence

import torch

from .transfer import Copier, Fence


class GradShards:
    """One fp32 gradient shard per unit, keyed by unit index.

    Args:
        units: units to hold a device shard for now (the gradient strategy's default sink);
            the update engine instead :meth:`add` s one per state record.
        copier: None (shards on the device) or the offload's
            :class:`~zkernels.zero.state.transfer.Copier` (shards in host RAM, each reduced
            shard copied there off the compute stream).

    Attributes:
        shards: the [shard_numel] fp32 shards, by unit index.
        on_device: whether they live on the compute device (for ``stats()``).
        exposed_s: host time :meth:`collect` waited for copies (not hidden behind backward).
    """

    def __init__(self, units: Sequence = (), copier: Optional[Copier] = None) -> None:
        self._copier = copier
        self.on_device = copier is None
        self.shards: List[torch.Tensor] = []
        self._filled: List[bool] = []
        self._fences: List[Optional[Fence]] = []
        self.exposed_s = 0.0
        for u in units:
            self.add(u.layout.shard_numel, u.device)

    def add(self, numel: int, device: torch.device) -> torch.Tensor:
        """A new shard for the next unit index (returned: the record keeps it)."""
        shard = torch.zeros(numel, dtype=torch.float32, device=device) if self.on_device \
            else self._copier.host_empty(numel, torch.float32)
        self.shards.append(shard)
        self._filled.append(False)
        self._fences.append(None)
        return shard

    def accumulate(self, index: int, reduced: torch.Tensor) -> Optional[Fence]:
        """Take unit ``index``'s reduced shard (a view into a reduce buffer); on the host,
        returns the copy's fence (the reduce pool waits it before reusing the buffer)."""
        shard = self.shards[index]
        if not self._filled[index]:
            self._filled[index] = True
            if self.on_device:
                shard.copy_(reduced)
                return None
            self._fences[index] = self._copier.to_host(shard, reduced)
            return self._fences[index]
        # A second synced backward without zero_grad: add (on the host: blocking, rare).
        if self.on_device:
            shard.add_(reduced)
            return None
        self._sync(index)
        tmp = self._copier.host_empty(reduced.numel(), torch.float32)
        self._copier.to_host(tmp, reduced).synchronize()
        shard.add_(tmp)
        return None

    def _sync(self, index: int) -> None:
        f = self._fences[index]
        if f is not None:
            f.synchronize()
            self._fences[index] = None

    def collect(self) -> List[torch.Tensor]:
        """After every reduction finished: the shards (a unit without a gradient since
        :meth:`reset` holds zeros)."""
        t0 = time.perf_counter()
        for i in range(len(self.shards)):
            self._sync(i)
        self.exposed_s += time.perf_counter() - t0
        for shard, filled in zip(self.shards, self._filled):
            if not filled:
                shard.zero_()
        return self.shards

    def reset(self) -> None:
        """Forget accumulated shards (``zero_grad``)."""
        for i in range(len(self.shards)):
            self._sync(i)
        self._filled = [False] * len(self.shards)
