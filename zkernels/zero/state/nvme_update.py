"""``offload="nvme"``: AdamW moments (and by default the fp32 master) in files, streamed
through a fixed host budget.

[Note: NVMe offload step]
Host RAM holds ``NUM_NVME_BUFFERS`` (3) slots, all carved out of one aligned arena of at most
``OffloadConfig.nvme_buffer_bytes``: each slot holds one sub-group's moments (and master),
its gradient slice and its compute-dtype output. The step walks every unit's shard in
sub-groups, slot after slot, so that at any time sub-group k+1 is being read from disk,
k updated by the CPU AdamW and k-1 written back (a slot is reused only after its writes and
its device copy finished); the read of the next unit's first sub-group starts during the
current unit's last. The gradient shard stays where stage 2 keeps it (the device); each
sub-group's slice comes to the slot by the copier (see [Note: offload copies]), and the
updated compute params go back the same way, as with CPU offload. Host RAM is therefore the
budget whatever the model size; disk holds 8Ψ/N (moments) or 12Ψ/N (with the master) per rank.

Before the first sub-group of a step every file's size is checked, so a truncated file fails
the step before any state changes; each read checks its byte count too.

With ``offload_params=True`` (stage 3) the parameter shards live in host RAM (pΨ/N, outside
the slot budget: [Note: parameter offload]); each sub-group's AdamW then writes its
compute-dtype output straight into the host shard (the slot's output staging goes unused) and
nothing goes to the device in ``step()``. Parameters on disk are not implemented. Files live in the
run's own folder and go on :meth:`NvmeUpdate.close` (also at garbage collection), unless
``close(keep_files=True)`` keeps them, with a manifest, for ``OffloadConfig(resume_dir=...)``.
"""
from __future__ import annotations

import json
import os
import time
import weakref
from typing import Dict, List, Optional, Tuple

import torch

from ...ops import OpSet
from .host_update import host_scalar
from ..planning.offload_config import IO_ALIGN, NUM_NVME_BUFFERS, OffloadConfig
from ..parameters.param_offload import HostParamStore
from .shard_state import ShardState
from .swap import (AsyncFileIO, OffloadIOError, SwapFile, aligned_empty, log, make_run_folder,
                   probe_direct_io, remove_run_folder, round_up)
from .transfer import Copier
from ..parameters.units import FlatParamUnit, ShardedParams
from .update import GradScale

ALIGN_NUMEL = IO_ALIGN // 4   # fp32 elements per aligned block
MANIFEST = "manifest.json"


def sub_group_numel_for(budget_bytes: int, num_kinds: int, compute_bytes: int) -> int:
    """Elements per sub-group so that the slots fit ``budget_bytes``: each element of a slot
    holds ``num_kinds`` fp32 states, one fp32 gradient and one compute-dtype output; the
    arena's alignment slack (one block) is part of the budget.

    Raises:
        ValueError: the budget cannot hold one aligned block per slot.
    """
    per_elem = NUM_NVME_BUFFERS * (4 * num_kinds + 4 + compute_bytes)
    numel = (budget_bytes - 2 * IO_ALIGN) // per_elem // ALIGN_NUMEL * ALIGN_NUMEL
    if numel < ALIGN_NUMEL:
        need = ALIGN_NUMEL * per_elem + 2 * IO_ALIGN
        raise ValueError(f"OffloadConfig.nvme_buffer_bytes={budget_bytes} is too small: "
                         f"{NUM_NVME_BUFFERS} slots of one {IO_ALIGN}-byte block need at "
                         f"least {need} bytes")
    return numel


class _Slot:
    """One sub-group's host buffers and what still uses them."""

    def __init__(self, states: Dict[str, torch.Tensor], grad: torch.Tensor,
                 out: Optional[torch.Tensor]) -> None:
        self.states, self.grad, self.out = states, grad, out
        self.busy: list = []   # futures / fences to finish before the slot is reused

    def settle(self) -> float:
        t0 = time.perf_counter()
        for b in self.busy:
            b.result() if hasattr(b, "result") else b.synchronize()
        self.busy = []
        return time.perf_counter() - t0


class NvmeUpdate:
    """Update strategy of ``offload="nvme"`` (see [Note: NVMe offload step]).

    Args:
        ops: the device OpSet (the gradient shards stay on the device).
        host_ops: a CPU OpSet (the native AdamW where built).
        device: the compute device.
        config: the :class:`OffloadConfig`.
        offload_dir: the folder under which this run's folder is made.
        rank, world_size: this rank and the group size (written into the file headers).
        offload_params: stage 3: keep the parameter shards in host RAM (see
            [Note: parameter offload]).

    Attributes:
        placement: "nvme". folder: this run's folder. direct_io: whether O_DIRECT is used
        (``direct_io_reason`` says why not). sub_group_numel: elements per slot.
        states: ShardStates whose ``exp_avg``/``exp_avg_sq`` (and ``master`` when on disk)
        are meta tensors: read them with :meth:`state_tensors`.
    """

    placement = "nvme"
    grad_sink = None

    def __init__(self, ops: OpSet, host_ops: OpSet, device: torch.device,
                 config: OffloadConfig, offload_dir, rank: int, world_size: int,
                 offload_params: bool = False) -> None:
        self.grad_ops, self.host_ops, self.config = ops, host_ops, config
        self.rank, self.world_size = rank, world_size
        self.kinds: Tuple[str, ...] = (("master",) if config.nvme_master else ()) + \
            ("exp_avg", "exp_avg_sq")
        self.copier = Copier(device, config.pin_memory)
        self.param_store = HostParamStore(self.copier) if offload_params else None
        resume = config.resume_dir
        self.folder = os.fspath(resume) if resume is not None else \
            make_run_folder(offload_dir, rank)
        self._manifest = self._read_manifest() if resume is not None else None
        self.resumed = resume is not None
        ok, reason = probe_direct_io(self.folder)
        if config.direct_io and not ok:
            if resume is None:
                remove_run_folder(self.folder)
            raise OffloadIOError(f"OffloadConfig.direct_io=True but {self.folder}: {reason}")
        self.direct_io = ok and config.direct_io is not False
        self.direct_io_reason = "disabled by OffloadConfig.direct_io=False" \
            if config.direct_io is False else reason
        if not self.direct_io and config.direct_io is None:
            log.warning("NVMe offload in %s uses buffered I/O: %s (the page cache may then "
                        "hold file pages beyond the host budget)", self.folder, reason)
        self.io = AsyncFileIO(config.io_threads)
        self.states: List[ShardState] = []
        self.files: List[Dict[str, SwapFile]] = []
        self._host_master: List[Optional[torch.Tensor]] = []
        self._arena: Optional[torch.Tensor] = None
        self._slots: List[_Slot] = []
        self.sub_group_numel = 0
        self._next_slot = 0
        self._prefetched: Optional[Tuple[int, int, _Slot]] = None
        self._in_step = False
        self._keep = False
        self._timers = {"update_s": 0.0, "io_exposed_s": 0.0}
        self.last_step: Dict[str, float] = {}
        # A kept folder being resumed is the new run's only once every file checked out
        # (adopt): until then a failure leaves it as it was.
        self._keep_flag = [self.resumed]
        self._finalizer = weakref.finalize(self, _release, self.io, self.copier, self.files,
                                           self.folder, self._keep_flag)

    # -- construction -------------------------------------------------------------------

    def adopt(self, num_units: int) -> None:
        """Resuming: every unit's files checked out; the folder now belongs to this run.

        Raises:
            OffloadIOError: the kept run had another number of units.
        """
        kept = len(self._manifest["steps"])
        if kept != num_units:
            raise OffloadIOError(f"OffloadConfig.resume_dir={self.folder!r} holds {kept} "
                                 f"units, this optimizer has {num_units}: another layout")
        self._keep_flag[0] = False

    def _read_manifest(self) -> dict:
        path = os.path.join(self.folder, MANIFEST)
        try:
            with open(path) as f:
                man = json.load(f)
        except (OSError, ValueError) as exc:
            raise OffloadIOError(f"OffloadConfig.resume_dir={self.folder!r}: no readable "
                                 f"{MANIFEST} ({exc}); only a folder kept by "
                                 f"close(keep_files=True) can be resumed") from exc
        want = {"rank": self.rank, "world_size": self.world_size, "kinds": list(self.kinds)}
        got = {k: man.get(k) for k in want}
        if got != want:
            raise OffloadIOError(f"OffloadConfig.resume_dir={self.folder!r} was kept by "
                                 f"{got}, this optimizer is {want}")
        return man

    def _allocate(self, compute_dtype: torch.dtype) -> None:
        fp32_out = compute_dtype == torch.float32
        cb = 0 if fp32_out else torch.empty((), dtype=compute_dtype).element_size()
        # In pure fp32 there is no output staging: the device copy reads the master (its
        # slot, or the host master) directly.
        kinds_in_slot = len(self.kinds)
        sub = sub_group_numel_for(self.config.nvme_buffer_bytes, kinds_in_slot, cb)
        self.sub_group_numel = sub
        per_slot = sub * (4 * kinds_in_slot + 4 + cb)
        self._arena = aligned_empty(NUM_NVME_BUFFERS * per_slot,
                                    self.copier.pin if self.copier.pinned else None)
        for s in range(NUM_NVME_BUFFERS):
            base = s * per_slot
            views = {}
            for i, k in enumerate(self.kinds):
                views[k] = self._arena[base + i * 4 * sub:base + (i + 1) * 4 * sub] \
                    .view(torch.float32)
            gofs = base + len(self.kinds) * 4 * sub
            grad = self._arena[gofs:gofs + 4 * sub].view(torch.float32)
            out = None if fp32_out else \
                self._arena[gofs + 4 * sub:gofs + 4 * sub + cb * sub].view(compute_dtype)
            self._slots.append(_Slot(views, grad, out))

    def _check_space(self, nbytes: int) -> None:
        st = os.statvfs(self.folder)
        free = st.f_bavail * st.f_frsize
        if free < nbytes:
            raise OffloadIOError(f"no space left under offload_dir: this rank's next unit "
                                 f"needs {nbytes} bytes of swap files in {self.folder}, "
                                 f"{free} are free")

    def init_state(self, unit: FlatParamUnit, initial_master: torch.Tensor) -> ShardState:
        """Create (or, resuming, open and check) the unit's files; write the initial master
        and zero moments through the slots."""
        if unit.index != len(self.states):
            raise ValueError(f"init_state: unit {unit.index} out of order (expected "
                             f"{len(self.states)})")
        if self._arena is None:
            self._allocate(unit.compute_dtype)
        n = unit.layout.shard_numel
        files = {}
        self.files.append(files)
        resume = self._manifest is not None
        if not resume:
            self._check_space(len(self.kinds) * (round_up(n * 4) + IO_ALIGN))
        for k in self.kinds:
            path = os.path.join(self.folder, f"unit{unit.index:05d}.{k}.swap")
            make = SwapFile.open_existing if resume else SwapFile.create
            files[k] = make(path, n, k, unit.index, self.rank, self.world_size,
                            self.direct_io)
        host_master = None
        if not self.config.nvme_master:
            host_master = self.copier.host_empty(n, torch.float32)
            if resume:
                raise OffloadIOError("resume_dir needs nvme_master=True (the master was in "
                                     "host RAM and did not survive)")
            host_master.copy_(initial_master)
        self._host_master.append(host_master)
        step = 0
        if resume:
            step = int(self._manifest["steps"][unit.index])
            self._rebuild_compute(unit)
        else:
            self._fill(unit, initial_master)
        meta = torch.empty(n, dtype=torch.float32, device="meta")
        state = ShardState(unit.index, unit.names, unit.layout, unit.rank,
                           host_master if host_master is not None else meta, meta, meta, step)
        self.states.append(state)
        return state

    def _pieces(self, n: int):
        sub = self.sub_group_numel
        return [(lo, min(n, lo + sub)) for lo in range(0, n, sub)]

    def _fill(self, unit: FlatParamUnit, master: Optional[torch.Tensor],
              exp_avg: Optional[torch.Tensor] = None,
              exp_avg_sq: Optional[torch.Tensor] = None) -> None:
        """Write the unit's files from tensors (None: zeros), synchronously."""
        slot = self._slots[0]
        files = self.files[unit.index]
        src = {"master": master, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        for lo, hi in self._pieces(unit.layout.shard_numel):
            nbytes = round_up((hi - lo) * 4)
            futs = []
            for k in self.kinds:
                buf = slot.states[k]
                buf[hi - lo:].zero_()
                if src[k] is None:
                    buf[:hi - lo].zero_()
                else:
                    self.copier.to_host(buf[:hi - lo], src[k][lo:hi]).synchronize()
                futs.append(self.io.write(files[k], buf, lo * 4, nbytes))
            for f in futs:
                f.result()

    def _rebuild_compute(self, unit: FlatParamUnit) -> None:
        self._write_compute(unit, self._read_kind(unit.index, "master"))

    def _write_compute(self, unit: FlatParamUnit, master: torch.Tensor) -> None:
        """The unit's compute shard from an fp32 host master (device copy, or in place on the
        host with ``offload_params``)."""
        src = master if unit.compute_dtype == torch.float32 else \
            self.host_ops.cast(master.contiguous(), unit.compute_dtype)
        if unit.gather.shard_on_host:
            self.param_store.settle()
            unit.compute_shard.copy_(src)
            return
        self.copier.to_device(unit.compute_shard, src).synchronize()

    # -- the step -----------------------------------------------------------------------

    def _begin_step(self) -> None:
        for files in self.files:
            for f in files.values():
                f.check_size()
        self._in_step = True

    def _take_slot(self) -> _Slot:
        slot = self._slots[self._next_slot]
        self._next_slot = (self._next_slot + 1) % NUM_NVME_BUFFERS
        self._timers["io_exposed_s"] += slot.settle()
        return slot

    def _read_into(self, slot: _Slot, unit_index: int, lo: int, hi: int) -> None:
        files = self.files[unit_index]
        nbytes = round_up((hi - lo) * 4)
        slot.busy = [self.io.read(files[k], slot.states[k], lo * 4, nbytes)
                     for k in self.kinds]

    def update(self, unit: FlatParamUnit, grad: torch.Tensor, group: dict,
               grad_scale: GradScale) -> None:
        """Stream the unit's state through the slots (see [Note: NVMe offload step]).

        Args:
            grad: [shard_numel] fp32 gradient shard on the device.
        """
        t0 = time.perf_counter()
        if not self._finalizer.alive:
            raise RuntimeError("this ZeroOptimizer was closed (close()): its offloaded state "
                               "is gone, build a new optimizer to train on")
        if not self._in_step:
            self._begin_step()
        st = self.states[unit.index]
        st.step += 1
        beta1, beta2 = group["betas"]
        scale = host_scalar(grad_scale)
        mixed = unit.compute_dtype != torch.float32
        on_host = unit.gather.shard_on_host
        if on_host:
            self.param_store.settle()   # no copy still reads the shard we write
        pieces = self._pieces(unit.layout.shard_numel)
        files = self.files[unit.index]
        host_master = self._host_master[unit.index]
        if self._prefetched is not None and self._prefetched[:2] == (unit.index, 0):
            slot = self._prefetched[2]
        else:
            slot = self._take_slot()
            self._read_into(slot, unit.index, *pieces[0])
        self._prefetched = None
        slot.busy.append(self.copier.to_host(slot.grad[:pieces[0][1]], grad[:pieces[0][1]]))
        last = None
        for j, (lo, hi) in enumerate(pieces):
            nxt = None
            if j + 1 < len(pieces):
                nxt = self._take_slot()
                self._read_into(nxt, unit.index, *pieces[j + 1])
                a, b = pieces[j + 1]
                nxt.busy.append(self.copier.to_host(nxt.grad[:b - a], grad[a:b]))
            elif unit.index + 1 < len(self.states):
                nxt = self._take_slot()
                self._read_into(nxt, unit.index + 1, *self._pieces(
                    self.states[unit.index + 1].layout.shard_numel)[0])
                self._prefetched = (unit.index + 1, 0, nxt)
            self._timers["io_exposed_s"] += slot.settle()
            k = hi - lo
            master = slot.states["master"][:k] if host_master is None else host_master[lo:hi]
            out = None if not mixed else unit.compute_shard[lo:hi] if on_host else slot.out[:k]
            self.host_ops.adamw_step(
                master, slot.grad[:k], slot.states["exp_avg"][:k], slot.states["exp_avg_sq"][:k],
                lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
                eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                step=st.step, grad_scale=scale, out=out)
            nbytes = round_up(k * 4)
            slot.busy = [self.io.write(files[kd], slot.states[kd], lo * 4, nbytes)
                         for kd in self.kinds]
            if on_host:
                if not mixed:
                    unit.compute_shard[lo:hi].copy_(master)
            else:
                last = self.copier.to_device(unit.compute_shard[lo:hi],
                                             out if mixed else master)
                slot.busy.append(last)
            if nxt is not None and self._prefetched is None:
                slot = nxt
        if last is not None:
            last.wait()  # the gather (publish) reads the compute shard after the copy
        self._timers["update_s"] += time.perf_counter() - t0

    def finish_step(self) -> None:
        """Every write and copy of the step finished; figures into :attr:`last_step`."""
        t0 = time.perf_counter()
        for s in self._slots:
            s.settle()
        c = self.copier.take_counters()
        io = self.io.take_counters()
        params = self.param_store.take_counters() if self.param_store is not None else {}
        tail = time.perf_counter() - t0
        self._in_step = False
        exposed = self._timers["io_exposed_s"] + tail
        self.last_step = {
            "update_s": self._timers["update_s"] + tail,
            "io_exposed_s": exposed,
            # I/O thread seconds the step did not wait for (ran beside the CPU AdamW)
            "disk_io_hidden_s": max(0.0, io["disk_io_s"] - exposed),
            "host_to_device_bytes": c["to_device_bytes"],
            "device_to_host_bytes": c["to_host_bytes"],
            "host_to_device_s": c["to_device_busy_s"],
            "device_to_host_s": c["to_host_busy_s"], **io,
            "sub_group_numel": self.sub_group_numel, "direct_io": self.direct_io, **params,
        }
        self._timers = {"update_s": 0.0, "io_exposed_s": 0.0}

    # -- state in and out ---------------------------------------------------------------

    def _read_kind(self, unit_index: int, kind: str) -> torch.Tensor:
        if kind == "master" and self._host_master[unit_index] is not None:
            return self._host_master[unit_index].clone()
        f = self.files[unit_index][kind]
        buf = aligned_empty(f.data_bytes)
        self.io.read(f, buf, 0, f.data_bytes).result()
        self.io.bytes_read -= f.data_bytes  # not a step's traffic
        return buf.view(torch.float32)[:f.numel]

    def state_tensors(self, unit_index: int):
        """``(master, exp_avg, exp_avg_sq)`` read from disk into new CPU tensors."""
        self._settle_all()
        return tuple(self._read_kind(unit_index, k)
                     for k in ("master", "exp_avg", "exp_avg_sq"))

    def load_state(self, unit: FlatParamUnit, step: int, master: torch.Tensor,
                   exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Write the unit's files (and host master) and rebuild its compute shard."""
        self._settle_all()
        st = self.states[unit.index]
        st.step = int(step)
        hm = self._host_master[unit.index]
        if hm is not None:
            hm.copy_(master)
        self._fill(unit, master if hm is None else None, exp_avg, exp_avg_sq)
        self.io.take_counters()
        self._write_compute(unit, master.to("cpu", torch.float32))
        self.copier.take_counters()

    def _settle_all(self) -> None:
        for s in self._slots:
            s.settle()
        self._prefetched = None

    # -- accounting and lifetime --------------------------------------------------------

    def held(self) -> Dict[str, List[torch.Tensor]]:
        return {"master": [], "optimizer_states": []}

    def held_host(self) -> Dict[str, List[torch.Tensor]]:
        """Host tensors: the slot arena (buffers) and, with ``nvme_master=False``, the
        master."""
        return {"params": self.param_store.held_host() if self.param_store is not None else [],
                "master": [m for m in self._host_master if m is not None],
                "buffers": [self._arena] if self._arena is not None else []}

    def disk_bytes(self) -> Dict[str, int]:
        """Bytes of the swap files by kind, from ``fstat`` (headers included)."""
        out = {"master": 0, "optimizer_states": 0}
        for files in self.files:
            for k, f in files.items():
                if f.fd >= 0:
                    out["master" if k == "master" else "optimizer_states"] += \
                        os.fstat(f.fd).st_size
        return out

    def sharded_params(self, params, layout, rank: int, compute_shard: torch.Tensor):
        """Stage 3's gather policy: the shard in host RAM with ``offload_params`` (see
        [Note: parameter offload]), else on the device."""
        if self.param_store is None:
            return ShardedParams(params, layout, compute_shard)
        return self.param_store.sharded_params(params, layout, rank, compute_shard)

    def close(self, keep_files: bool = False) -> Optional[str]:
        """Finish I/O, close the files and remove the run folder (idempotent).

        Args:
            keep_files: keep the folder with a manifest (steps, rank, kinds) so that a new
                optimizer with ``OffloadConfig(resume_dir=folder)`` continues from it.

        Returns:
            the kept folder, or None.
        """
        if not self._finalizer.alive:
            return self.folder if self._keep else None
        if keep_files and not self.config.nvme_master:
            raise ValueError("close(keep_files=True) needs OffloadConfig(nvme_master=True): "
                             "the master is in host RAM and would not survive")
        self._settle_all()
        if keep_files:
            man = {"rank": self.rank, "world_size": self.world_size, "kinds": list(self.kinds),
                   "steps": [s.step for s in self.states]}
            tmp = os.path.join(self.folder, MANIFEST + ".tmp")
            with open(tmp, "w") as f:
                json.dump(man, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(self.folder, MANIFEST))  # atomic
            self._keep = True
        self._finalizer.detach()
        _release(self.io, self.copier, self.files, self.folder,
                 [keep_files or self._keep_flag[0]])
        return self.folder if keep_files else None


def _release(io: AsyncFileIO, copier: Copier, files: List[Dict[str, SwapFile]], folder: str,
             keep: list) -> None:
    io.close()
    copier.close()
    for fs in files:
        for f in fs.values():
            f.close()
    if not keep[0]:
        remove_run_folder(folder)
