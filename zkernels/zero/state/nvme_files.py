"""The files of ``offload="nvme"``: this run's folder, one swap file per (unit, kind), their
I/O pool, and resuming from a folder a run kept (``close(keep_files=True)``).

The step that streams them is the engine's (``engine.py``, [Note: NVMe offload step]); this
module only creates, checks, reads and writes files (``swap.py``: format and I/O).
"""
from __future__ import annotations

import json
import os
import weakref
from concurrent.futures import Future
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..planning.offload_config import IO_ALIGN, OffloadConfig
from .shard_state import ShardState
from .swap import (AsyncFileIO, OffloadIOError, SwapFile, aligned_empty, log, make_run_folder,
                   probe_direct_io, remove_run_folder, round_up)

MANIFEST = "manifest.json"


class NvmeFiles:
    """The swap files of one rank (see [Note: swap files and their I/O] in ``swap.py``).

    Args:
        config: the :class:`OffloadConfig` (``nvme_master``, ``io_threads``, ``direct_io``,
            ``resume_dir``).
        offload_dir: the folder under which this run's folder is made.
        rank, world_size: written into every file's header and the manifest.

    Attributes:
        kinds: the kinds on disk ("master" with ``nvme_master``, "exp_avg", "exp_avg_sq").
        folder: this run's folder. resumed: it is a kept folder being resumed.
        direct_io: whether O_DIRECT is used (``direct_io_reason`` says why not).
        io: the :class:`~zkernels.zero.state.swap.AsyncFileIO` pool.
    """

    def __init__(self, config: OffloadConfig, offload_dir, rank: int,
                 world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.kinds: Tuple[str, ...] = (("master",) if config.nvme_master else ()) + \
            ("exp_avg", "exp_avg_sq")
        resume = config.resume_dir
        self.resumed = resume is not None
        self.folder = os.fspath(resume) if self.resumed else make_run_folder(offload_dir, rank)
        self._rules: Dict[str, dict] = {}   # (resuming: each rule unit's kept RAM state)
        self._steps = self._read_manifest() if self.resumed else None
        ok, reason = probe_direct_io(self.folder)
        if config.direct_io and not ok:
            if not self.resumed:
                remove_run_folder(self.folder)
            raise OffloadIOError(f"OffloadConfig.direct_io=True but {self.folder}: {reason}")
        self.direct_io = ok and config.direct_io is not False
        self.direct_io_reason = "disabled by OffloadConfig.direct_io=False" \
            if config.direct_io is False else reason
        if not self.direct_io and config.direct_io is None:
            log.warning("NVMe offload in %s uses buffered I/O: %s (the page cache may then "
                        "hold file pages beyond the host budget)", self.folder, reason)
        self.io = AsyncFileIO(config.io_threads)
        self._files: List[Dict[str, SwapFile]] = []
        self.kept: Optional[str] = None
        # A kept folder being resumed is this run's only once every file checked out
        # (adopt): until then a failure leaves it as it was.
        self._keep = [self.resumed]
        self._finalizer = weakref.finalize(self, _release, self.io, self._files, self.folder,
                                           self._keep)

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    def _read_manifest(self) -> List[int]:
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
        self._rules = dict(man.get("rules", {}))
        return [int(s) for s in man["steps"]]

    def kept_step(self, index: int) -> int:
        """Resuming: unit ``index``'s step count kept in the manifest."""
        return self._steps[index]

    def rule_info(self, index: int, optimizer: str) -> dict:
        """Resuming: unit ``index``'s rule state kept in the manifest (``SwappedRule.kept``:
        [Note: rule state on NVMe] in ``rule_swap.py``).

        Raises:
            OffloadIOError: the kept run had no rule at that unit, or another optimizer.
        """
        info = self._rules.get(str(index))
        if info is None or info.get("optimizer") != optimizer:
            raise OffloadIOError(f"OffloadConfig.resume_dir={self.folder!r}: unit {index} was "
                                 f"kept by {info.get('optimizer') if info else 'the fused AdamW'}"
                                 f", this optimizer runs {optimizer} there")
        return info

    def open(self, rec: ShardState) -> int:
        """Create ``rec``'s files (or, resuming, open and check the kept ones) into
        ``rec.files``; returns the step count kept for the unit (0 for new files)."""
        n, index = rec.numel, rec.unit_index
        if not self.resumed:
            need = len(self.kinds) * (round_up(n * 4) + IO_ALIGN)
            st = os.statvfs(self.folder)
            if st.f_bavail * st.f_frsize < need:
                raise OffloadIOError(f"no space left under offload_dir: this rank's next unit "
                                     f"needs {need} bytes of swap files in {self.folder}, "
                                     f"{st.f_bavail * st.f_frsize} are free")
        make = SwapFile.open_existing if self.resumed else SwapFile.create
        for k in self.kinds:
            path = os.path.join(self.folder, f"unit{index:05d}.{k}.swap")
            rec.files[k] = make(path, n, k, index, self.rank, self.world_size, self.direct_io)
        self._files.append(rec.files)
        return self._steps[index] if self.resumed else 0

    def create_file(self, index: int, kind: str, numel: int) -> SwapFile:
        """A new fp32 swap file of unit ``index`` beside the AdamW kinds (a rule's state key:
        ``rule_swap.py``), counted by :meth:`disk_bytes` and :meth:`check_sizes` and removed
        with the folder (its data written by the caller).

        Raises:
            OffloadIOError: no space for it, or it cannot be created.
        """
        need = round_up(numel * 4) + IO_ALIGN
        st = os.statvfs(self.folder)
        if st.f_bavail * st.f_frsize < need:
            raise OffloadIOError(f"no space left under offload_dir: unit {index}'s {kind} "
                                 f"needs {need} bytes in {self.folder}, "
                                 f"{st.f_bavail * st.f_frsize} are free")
        path = os.path.join(self.folder, f"unit{index:05d}.{kind}.swap")
        f = SwapFile.create(path, numel, kind, index, self.rank, self.world_size,
                            self.direct_io)
        self._files.append({kind: f})
        return f

    def open_file(self, index: int, kind: str, numel: int) -> SwapFile:
        """Resuming: the kept file :meth:`create_file` made (checked, registered alike).

        Raises:
            OffloadIOError: missing, or of another unit, rank, kind or size.
        """
        path = os.path.join(self.folder, f"unit{index:05d}.{kind}.swap")
        # (the header keeps the kind's first 16 bytes: "rule-momentum_buffer" is longer)
        f = SwapFile.open_existing(path, numel, kind.encode()[:16].decode(errors="replace"),
                                   index, self.rank, self.world_size, self.direct_io)
        self._files.append({kind: f})
        return f

    def adopt(self, num_units: int) -> None:
        """Resuming: every unit's files checked out; the folder now belongs to this run.

        Raises:
            OffloadIOError: the kept run had another number of units.
        """
        if len(self._steps) != num_units:
            raise OffloadIOError(f"OffloadConfig.resume_dir={self.folder!r} holds "
                                 f"{len(self._steps)} units, this optimizer has {num_units}: "
                                 f"another layout")
        self._keep[0] = False

    def check_sizes(self) -> None:
        """Raises OffloadIOError when a file was truncated (before a step changes anything)."""
        for files in self._files:
            for f in files.values():
                f.check_size()

    def read(self, rec: ShardState, kind: str, buf: torch.Tensor, lo: int, hi: int,
             counted: bool = True) -> Future:
        return self.io.read(rec.files[kind], buf, lo * 4, round_up((hi - lo) * 4), counted)

    def write(self, rec: ShardState, kind: str, buf: torch.Tensor, lo: int, hi: int,
              counted: bool = True) -> Future:
        return self.io.write(rec.files[kind], buf, lo * 4, round_up((hi - lo) * 4), counted)

    def read_all(self, rec: ShardState, kind: str) -> torch.Tensor:
        """``rec``'s ``kind`` as a new CPU tensor (a load or save, not a step's traffic)."""
        f = rec.files[kind]
        buf = aligned_empty(f.data_bytes)
        self.io.read(f, buf, 0, f.data_bytes, counted=False).result()
        return buf.view(torch.float32)[:f.numel]

    def disk_bytes(self) -> Dict[str, int]:
        """Bytes of the swap files by kind, from ``fstat`` (headers included)."""
        out = {"master": 0, "optimizer_states": 0}
        for files in self._files:
            for k, f in files.items():
                if f.fd >= 0:
                    out["master" if k == "master" else "optimizer_states"] += \
                        os.fstat(f.fd).st_size
        return out

    def close(self, steps: Optional[Sequence[int]] = None,
              rules: Optional[Dict[int, dict]] = None) -> Optional[str]:
        """Finish I/O, close the files and remove the folder (idempotent); with ``steps``
        (per unit) keep it with a manifest for ``OffloadConfig(resume_dir=...)``; ``rules``:
        each rule unit's RAM state (``SwappedRule.kept``), kept in the manifest too.

        Returns:
            the kept folder, or None.
        """
        if not self._finalizer.alive:
            return self.kept
        if steps is not None:
            man = {"rank": self.rank, "world_size": self.world_size, "kinds": list(self.kinds),
                   "steps": list(steps), "rules": {str(k): v for k, v in (rules or {}).items()}}
            tmp = os.path.join(self.folder, MANIFEST + ".tmp")
            with open(tmp, "w") as f:
                json.dump(man, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(self.folder, MANIFEST))  # atomic
            self._keep[0] = True
        self._finalizer()
        self.kept = self.folder if steps is not None else None
        return self.kept


def _release(io: AsyncFileIO, files: List[Dict[str, SwapFile]], folder: str,
             keep: list) -> None:
    io.close()
    for fs in files:
        for f in fs.values():
            f.close()
    if not keep[0]:
        remove_run_folder(folder)
