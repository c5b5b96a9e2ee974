"""Where stage 2-3's reduced gradient shards go as each reduce-scatter finishes: one fp32 shard
per unit, on the device (added into in place) or in host RAM (filled by copies off the compute
stream, see [Note: CPU offload step] in ``places.py``). The gradient strategies
(``gradients/grad_reducers.py``) use it through the GradSink protocol: ``accumulate(unit_index,
reduced) -> Optional[fence]``, ``collect()``, ``reset()``.

[Note: device gradient shards allocated lazily]
At stage 3 the device shards (the gradient strategy's default sink, without CPU offload) are
allocated by the first reduce-scatter that fills them, or by :meth:`GradShards.collect`,
not when the optimizer is built: building and loading a model hold no gradient (12Ψ/N in
fp32, not 16Ψ/N), as with FSDP2 and DeepSpeed, whose gradients appear in the first backward.
From the first step on nothing changes: the shards stay allocated between steps, and
``zero_grad`` only marks them unfilled. Stage 2 keeps them eager: its replicated parameters
dominate the build anyway, and its last buckets are reduced inside ``step()``, whose memory
must not grow on the first step (``tests/zero/test_offload.py``'s NVMe RSS bound). Host
shards (CPU offload) are the update engine's, handed to its state records at construction,
and stay eager.
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
        lazy: allocate the device shards of ``units`` when first filled (stage 3: see [Note:
            device gradient shards allocated lazily]).
        copier: None (shards on the device) or the offload's
            :class:`~zkernels.zero.state.transfer.Copier` (shards in host RAM, each reduced
            shard copied there off the compute stream).

    Attributes:
        shards: the [shard_numel] fp32 shards, by unit index (a device shard is None until
            its first gradient or :meth:`collect`).
        on_device: whether they live on the compute device (for ``stats()``).
        exposed_s: host time :meth:`collect` waited for copies (not hidden behind backward).
    """

    def __init__(self, units: Sequence = (), copier: Optional[Copier] = None,
                 lazy: bool = False) -> None:
        self._copier = copier
        self.on_device = copier is None
        self.shards: List[torch.Tensor] = []
        self._filled: List[bool] = []
        self._fences: List[Optional[Fence]] = []
        self.exposed_s = 0.0
        self._later = {}   # unit index -> (numel, device) of a shard not allocated yet
        for u in units:
            if lazy:
                self._later[len(self.shards)] = (u.layout.shard_numel, u.device)
                self._append(None)
            else:
                self.add(u.layout.shard_numel, u.device)

    def add(self, numel: int, device: torch.device) -> torch.Tensor:
        """A new shard for the next unit index (returned: the record keeps it)."""
        shard = torch.zeros(numel, dtype=torch.float32, device=device) if self.on_device \
            else self._copier.host_empty(numel, torch.float32)
        self._append(shard)
        return shard

    def _append(self, shard: Optional[torch.Tensor]) -> None:
        self.shards.append(shard)
        self._filled.append(False)
        self._fences.append(None)

    def _shard(self, index: int) -> torch.Tensor:
        """Unit ``index``'s shard, allocated now if it was not yet (see [Note: device gradient
        shards allocated lazily])."""
        if self.shards[index] is None:
            numel, device = self._later.pop(index)
            self.shards[index] = torch.zeros(numel, dtype=torch.float32, device=device)
        return self.shards[index]

    def held(self) -> List[torch.Tensor]:
        """The shards allocated so far."""
        return [s for s in self.shards if s is not None]

    def accumulate(self, index: int, reduced: torch.Tensor) -> Optional[Fence]:
        """Take unit ``index``'s reduced shard (a view into a reduce buffer); on the host,
        returns the copy's fence (the reduce pool waits it before reusing the buffer)."""
        shard = self._shard(index)
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
        for i, filled in enumerate(self._filled):
            if not filled:
                self._shard(i).zero_()
        return self.shards

    def reset(self) -> None:
        """Forget accumulated shards (``zero_grad``)."""
        for i in range(len(self.shards)):
            self._sync(i)
        self._filled = [False] * len(self.shards)
