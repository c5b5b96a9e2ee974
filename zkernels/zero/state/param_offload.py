"""Stage 3 ``offload_params=True``: the compute-dtype parameter shards live in host RAM between
uses and come to the device ahead of their unit's all-gather.

[Note: parameter offload]
At stage 3 a rank holds its parameter shard (pΨ/N) permanently; with ``offload_params`` it
keeps that shard in host RAM instead (beside the offloaded state of the update engine,
``state/engine.py``, whose copier it shares), in a buffer of the injected
:class:`HostStorage` (pinned when a GPU is present, see ``OffloadConfig.pin_memory``), which
keeps each unit's shard as a :class:`HostShard` ([Note: shard storage] in ``storage.py``):

- ``ensure_gathered`` (the unit's forward or backward, or the schedule's prefetch of the unit
  predicted next: [Note: stage-3 gather schedule]) allocates the full device buffer, copies the
  host shard into this rank's slice of it on the copier's stream (see [Note: offload copies])
  and all-gathers in place once the copy is done ([Note: gathers after their copy]). On a GPU
  neither step blocks the host or the compute stream: the copy and the gather of unit k+1 are
  issued during unit k's compute and run beside it. On a CPU-only machine the "device"
  buffer is a separate allocation and the copy runs on the copy thread; the gather waits for
  it (a memcpy of one shard).
- ``free`` releases the full buffer: between uses the device holds no parameter bytes of the
  unit (``stats()`` measures it: ``memory_location_bytes`` puts the shards under host).
- The update writes the new compute-dtype parameters straight into the host shard (the fused
  CPU AdamW's ``out=``): no staging buffer and no host-to-device copy in ``step()``; in pure
  fp32 the host master *is* the shard (CPU offload) and nothing is written twice. The next
  gather reads the new values. Before the update writes a shard, the store waits for any
  copy still reading it.

[Note: gathers after their copy]
On a GPU the all-gather of a unit whose shard was just copied in is issued with the copier's
stream as the current stream: ProcessGroupNCCL's stream then waits for that stream (the copy),
not for the compute stream, and the compute stream waits for the gather only where the unit
is used (the handle's ``wait()``, called on the compute stream). Making the compute stream
wait for the copy instead would hold back the kernels of the unit computing now behind the
copy of the unit prefetched for next. The full buffer is allocated on the compute stream
before either is issued and freed on it after it waited, so the caching allocator's
per-stream reuse stays ordered. (Written for CUDA from these rules; in this repository's CI
only the CPU path runs, where the gather waits for the copy thread.)

Traffic: every gather brings its shard in (pΨ/N per gather: twice per step with
``reshard_after_forward``, once without) instead of sending pΨ/N up once after the update;
``stats()["offload"]`` reports these bytes and copy time as ``param_host_to_device_*``, the
host time the gathers waited for them (``param_host_to_device_exposed_s``: on a GPU the host
never waits, on a CPU it is the copy itself plus the hand-off to the copy thread) and the
copy time not waited for (``param_host_to_device_hidden_s``).

Bit-identity: the parameters' values are the same bits wherever the shard lives (the AdamW
writes the same rounded output; a copy changes nothing), so a run with ``offload_params`` is
bit-identical to the same offload without it.
"""
from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterator, List

import torch

from ..parameters.storage import DeviceShard, DeviceStorage
from .transfer import Copier, Fence


class HostShard(DeviceShard):
    """A unit's shard in host RAM (see [Note: parameter offload]): ``values`` is the
    storage's host buffer, which the update writes in place.

    Args:
        values: [shard_numel] compute dtype, host RAM.
        lo, hi: this rank's slice of the full buffer.
        device: the compute device (where the full buffer lives while gathered).
        storage: the :class:`HostStorage` that copies and counts.
    """

    def __init__(self, values: torch.Tensor, lo: int, hi: int, device: torch.device,
                 storage: "HostStorage") -> None:
        self.values, self.device = values, device
        self._lo, self._hi, self._storage = lo, hi, storage

    def holds(self, where: str) -> bool:
        return where == "host"

    def issue_gather(self, full, comm, tag):
        dst = full[self._lo:self._hi]
        fence = self._storage.bring_in(dst, self.values)
        with self._storage.after(fence):
            return comm.all_gather(full, dst, tag=tag)

    def held(self) -> List[torch.Tensor]:
        """No device bytes (the shard is host memory: the storage reports it)."""
        return []

    def settle(self) -> None:
        self._storage.settle()


class HostStorage(DeviceStorage):
    """Owner of the host parameter shards of one optimizer (see [Note: parameter offload]);
    the state side's host kinds are allocated here too (:meth:`empty`).

    Args:
        copier: the offload strategy's :class:`~zkernels.zero.state.transfer.Copier` (its stream or
            thread carries the copies; its ``host_empty`` pins).
    """

    def __init__(self, copier: Copier) -> None:
        self.copier = copier
        self.shards: List[HostShard] = []
        self._bytes = 0
        self._busy_s = 0.0
        self._exposed_s = 0.0
        self._done: List[Fence] = []
        copier.on_close.append(self.settle)

    def keep(self, values: torch.Tensor, lo: int, hi: int) -> HostShard:
        """Move a unit's shard ``values`` (built on the device; elements ``[lo, hi)`` of its
        full buffer) into a new host buffer."""
        host = self.copier.host_empty(values.numel(), values.dtype)
        host.copy_(values)
        shard = HostShard(host, lo, hi, values.device, self)
        self.shards.append(shard)
        return shard

    def empty(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``n`` zeros of ``dtype`` in host RAM (a state kind kept on the host)."""
        return self.copier.host_empty(n, dtype).zero_()

    def bring_in(self, dst: torch.Tensor, host: torch.Tensor) -> Fence:
        """Issue the copy of ``host`` into the device slice ``dst``."""
        self._bytes += host.numel() * host.element_size()
        fence = self.copier.copy_untracked(dst, host)
        self._done.append(fence)
        if len(self._done) > 2 * len(self.shards) + 2:
            self._retire(len(self.shards))   # eval loops without step(): stay bounded
        return fence

    @contextlib.contextmanager
    def after(self, fence: Fence) -> Iterator[None]:
        """Collectives issued inside run after the copy of ``fence`` (see
        [Note: gathers after their copy])."""
        stream = self.copier.stream
        if stream is not None:
            with torch.cuda.stream(stream):
                yield
            return
        t0 = time.perf_counter()
        fence.wait()
        self._exposed_s += time.perf_counter() - t0
        yield

    def _retire(self, count: int) -> None:
        for f in self._done[:count]:
            f.synchronize()
            self._busy_s += f.busy_s()
        del self._done[:count]

    def settle(self) -> None:
        """Every copy issued is done (the host shards may be written)."""
        self._retire(len(self._done))

    def take_counters(self) -> Dict[str, float]:
        """Settle; return and reset the parameter copy figures since the last call."""
        self.settle()
        out = {"param_host_to_device_bytes": self._bytes,
               "param_host_to_device_s": self._busy_s,
               "param_host_to_device_exposed_s": self._exposed_s,
               "param_host_to_device_hidden_s": max(0.0, self._busy_s - self._exposed_s)}
        self._bytes, self._busy_s, self._exposed_s = 0, 0.0, 0.0
        return out

    def held_host(self) -> List[torch.Tensor]:
        """The host shards (for ``stats()``)."""
        return [p.values for p in self.shards]

