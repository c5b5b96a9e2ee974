"""Stage 3 ``offload_params=True`` with ``offload="nvme"``: the parameter shards live in files
and pass through a bounded host bounce on their way to each gather.

[Note: parameters on NVMe]
With CPU offload the parameter shards live in host RAM (``param_offload.py``); with NVMe
offload host RAM is a budget (the update's slot arena, [Note: NVMe offload step] in
``nvme_place.py``), so the shards go to disk too, as DeepSpeed's ``offload_param: {device:
nvme}`` does. Each unit's shard (trainable or frozen: a LoRA's base is the bulk) is one swap
file in its compute dtype ([Note: swap files and their I/O]) in a run folder of its own under
``offload_dir``; between uses neither the device nor host RAM holds a byte of it.

- ``ensure_gathered`` reads the unit's file into two aligned host bounces in turn, copying
  each chunk into this rank's slice of the full device buffer on the copier's stream or thread
  while the next chunk is read, and all-gathers after the last copy ([Note: gathers after their
  copy]). A bounce is reused only after its copy finished. The bounces are sized to the
  largest unit shard, capped by ``OffloadConfig.nvme_param_buffer_bytes`` (a larger shard
  comes in chunks): host RAM for parameters stays within that budget whatever the model
  size, as the state's stays within ``nvme_buffer_bytes``.
- The update engine writes each updated sub-group (compute dtype) straight from its slot to the
  file (:meth:`DiskShard.write_range`): nothing is sent to the device in ``step()``,
  as with parameters in host RAM. A gather first waits for any write of its file still running.
- Checkpoints and ``state_dict`` read and write a frozen shard through
  :meth:`~zkernels.zero.parameters.units.FlatParamUnit.shard_values` (a temporary host copy);
  a trainable shard is rebuilt from the master. The files hold nothing that is not derived,
  so ``close(keep_files=True)`` does not keep them: a resumed run writes them from its master.

The read is synchronous: the gather waits for it (``stats()["offload"]`` reports the bytes and
seconds as ``param_disk_read_*``). Prefetching the read of the unit predicted next, as
DeepSpeed's parameter swapper does, would hide it; on this repository's CPU machines the read
of a page-cached file is a memcpy, and that is left for a machine with a real NVMe to measure.

Bit-identity: a file holds the same bits as a host shard would, so the run is bit-identical to
the same NVMe offload with the shards in host RAM or on the device.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import Future
from typing import Dict, List, Optional

import torch

from ..planning.offload_config import NUM_PARAM_BOUNCES, param_bounce_bytes
from .swap import (AsyncFileIO, OffloadIOError, SwapFile, aligned_empty, make_run_folder,
                   probe_direct_io, remove_run_folder, round_up)
from .transfer import Copier, Fence
from .param_offload import HostShard, HostStorage


class DiskShard(HostShard):
    """A unit's shard in a file (see [Note: parameters on NVMe]). ``values`` is a meta tensor
    (shape and dtype, no storage): values go through :meth:`read_values`,
    :meth:`load_values` and :meth:`write_range`.

    Args:
        file: the unit's :class:`~zkernels.zero.state.swap.SwapFile`.
        lo, hi, device: as :class:`~zkernels.zero.state.param_offload.HostShard`.
        storage: the :class:`DiskStorage` that reads, copies and counts.
    """

    in_file = True

    def __init__(self, file: SwapFile, lo: int, hi: int, device: torch.device,
                 storage: "DiskStorage") -> None:
        self.file = file
        self._writes: List[Future] = []
        super().__init__(torch.empty(file.numel, dtype=file.dtype, device="meta"), lo, hi,
                         device, storage)

    def holds(self, where: str) -> bool:
        return False

    def issue_gather(self, full, comm, tag):
        self.wait_writes()
        dst = full[self._lo:self._hi]
        fence = self._storage.bring_in_from(self.file, dst)
        with self._storage.after(fence):
            return comm.all_gather(full, dst, tag=tag)

    def write_range(self, buf: torch.Tensor, lo: int, hi: int) -> Future:
        """Write elements ``[lo, hi)`` of the shard from the aligned host ``buf`` (its first
        ``hi - lo`` elements; ``lo`` and ``buf`` aligned for O_DIRECT, the engine's slots
        are); returns the write's future (the next gather waits for it)."""
        isz = self.file.dtype.itemsize
        fut = self._storage.io.write(self.file, buf, lo * isz, round_up((hi - lo) * isz))
        self._writes = [f for f in self._writes if not f.done()] + [fut]
        return fut

    def wait_writes(self) -> None:
        for f in self._writes:
            f.result()
        self._writes = []

    def read_values(self) -> torch.Tensor:
        """The shard's values as a new host tensor (a load or save, not a step's traffic)."""
        self.wait_writes()
        buf = aligned_empty(self.file.data_bytes)
        self._storage.io.read(self.file, buf, 0, self.file.data_bytes, counted=False).result()
        return buf.view(self.file.dtype)[:self.file.numel]

    def load_values(self, values: torch.Tensor) -> None:
        """Overwrite the shard with ``values`` (cast to its dtype; a load, not a step's)."""
        self.wait_writes()
        self._storage.settle()
        buf = aligned_empty(self.file.data_bytes).zero_()
        buf.view(self.file.dtype)[:self.file.numel].copy_(values.reshape(-1))
        self._storage.io.write(self.file, buf, 0, self.file.data_bytes, counted=False).result()


class DiskStorage(HostStorage):
    """Owner of the parameter files of one optimizer (see [Note: parameters on NVMe]).

    Args:
        copier: the update engine's :class:`~zkernels.zero.state.transfer.Copier`.
        offload_dir: the folder under which the files' run folder is made.
        rank, world_size: written into every file's header.
        io_threads: threads of the file I/O pool.
        direct_io: as ``OffloadConfig.direct_io`` (None: O_DIRECT where the filesystem
            takes it).
        buffer_bytes: the bounces' host budget (``OffloadConfig.nvme_param_buffer_bytes``).
    """

    def __init__(self, copier: Copier, offload_dir, rank: int, world_size: int,
                 io_threads: int, direct_io: Optional[bool], buffer_bytes: int) -> None:
        self.folder = make_run_folder(offload_dir, rank)
        ok, reason = probe_direct_io(self.folder)
        if direct_io and not ok:
            remove_run_folder(self.folder)
            raise OffloadIOError(f"OffloadConfig.direct_io=True but {self.folder}: {reason}")
        super().__init__(copier)
        self.direct_io = ok and direct_io is not False
        self.rank, self.world_size = rank, world_size
        self.io = AsyncFileIO(io_threads)
        self.buffer_bytes = buffer_bytes
        self._bounces: List[torch.Tensor] = []
        self._bounce_fences: List[Optional[Fence]] = []
        self._next_bounce = 0
        self._read_s = 0.0
        copier.on_close.append(self._release)

    def keep(self, values: torch.Tensor, lo: int, hi: int) -> DiskShard:
        """Write a unit's shard ``values`` (built on the device) into a new file of it."""
        index = len(self.shards)
        path = os.path.join(self.folder, f"param{index:05d}.swap")
        f = SwapFile.create(path, values.numel(), "param", index, self.rank,
                            self.world_size, self.direct_io, values.dtype)
        self._grow_bounces(f.data_bytes)
        shard = DiskShard(f, lo, hi, values.device, self)
        shard.load_values(values)   # (copied into the aligned write buffer)
        self.shards.append(shard)
        return shard

    def _grow_bounces(self, nbytes: int) -> None:
        """Bounces for a file of ``nbytes`` within the budget (units are built before any
        gather)."""
        size = param_bounce_bytes(self.buffer_bytes, nbytes)
        if self._bounces and self._bounces[0].numel() >= size:
            return
        self.settle()
        for b in self._bounces:
            self.copier.unpin(b)
        pin = self.copier.pin if self.copier.pinned else None
        self._bounces = [aligned_empty(size, pin).zero_() for _ in range(NUM_PARAM_BOUNCES)]
        self._bounce_fences = [None] * NUM_PARAM_BOUNCES

    def bring_in_from(self, f: SwapFile, dst: torch.Tensor) -> Fence:
        """Read ``f`` chunk by chunk into the bounces in turn (the gather waits for the reads)
        and issue each chunk's copy into the device slice ``dst``; returns the last copy's
        fence (copies run in order: on CPU one copy thread, on a GPU one stream)."""
        step = self._bounces[0].numel()
        isz = f.dtype.itemsize
        fence = None
        for ofs in range(0, f.data_bytes, step):
            i = self._next_bounce
            self._next_bounce = (i + 1) % NUM_PARAM_BOUNCES
            if self._bounce_fences[i] is not None:
                self._bounce_fences[i].synchronize()   # its last copy has read it
            buf, nbytes = self._bounces[i], min(step, f.data_bytes - ofs)
            t0 = time.perf_counter()
            self.io.read(f, buf, ofs, nbytes).result()
            self._read_s += time.perf_counter() - t0
            lo, hi = ofs // isz, min(f.numel, (ofs + nbytes) // isz)
            fence = self.bring_in(dst[lo:hi], buf.view(f.dtype)[:hi - lo])
            self._bounce_fences[i] = fence
        return fence

    def take_counters(self) -> Dict[str, float]:
        """As :meth:`HostStorage.take_counters`, plus the files' bytes read for gathers
        (``param_disk_read_*``: the gathers waited for the reads) and written by the update
        (``param_disk_write_bytes``), and the host bytes of the bounces
        (``param_bounce_bytes``)."""
        io = self.io.take_counters()
        out = {**super().take_counters(), "param_disk_read_bytes": io["disk_read_bytes"],
               "param_disk_read_s": self._read_s,
               "param_disk_write_bytes": io["disk_write_bytes"],
               "param_bounce_bytes": sum(b.untyped_storage().nbytes() for b in self._bounces)}
        self._read_s = 0.0
        return out

    def held_host(self) -> List[torch.Tensor]:
        """No parameter shard is in host RAM (the bounces are buffers: :meth:`buffers`)."""
        return []

    def buffers(self) -> List[torch.Tensor]:
        """The host bounce buffers (for ``stats()``)."""
        return list(self._bounces)

    def disk_bytes(self) -> int:
        """Bytes of the parameter files, from ``fstat`` (headers included)."""
        return sum(os.fstat(p.file.fd).st_size for p in self.shards if p.file.fd >= 0)

    def _release(self) -> None:
        """At ``close()``: finish I/O, close the files, remove the folder (idempotent)."""
        if not self.folder:
            return
        self.settle()
        for p in self.shards:
            p.wait_writes()
        self.io.close()
        for p in self.shards:
            p.file.close()
        for b in self._bounces:
            self.copier.unpin(b)
        remove_run_folder(self.folder)
        self.folder = ""
