"""Files of NVMe offload: aligned host buffers, self-describing swap files, asynchronous I/O.

[Note: swap files and their I/O]
Each (unit, kind) of a rank's state is one file in the run's own folder
(``tempfile.mkdtemp`` under ``offload_dir``). A file starts with one 4096-byte header block
(magic ``ZKSWAP``, format version, dtype, element count, kind, unit, rank, world size, data
offset), then the data (fp32 state; bf16 moments, int8/uint8 codes and fp32 block scales of
low-bit state: [Note: low-bit state on NVMe] in ``nvme_files.py``), padded to a multiple of
4096 bytes. Every read checks the bytes
it got: a truncated file is an error naming the file, never a step over garbage; opening an
existing file (resume) checks the header against what the optimizer expects, so a file of
another run, rank, unit or size is refused.

I/O is a thread pool over ``os.preadv`` / ``os.pwritev`` (the GIL is released inside, so
``io_threads`` requests are in flight at once): no extra dependency (DeepSpeed's ``aio`` op
needs libaio and a compiler at run time; io_uring needs a binding we would have to ship), and
on a modern NVMe a few threads of 1-64 MiB requests reach the device's bandwidth. Files are
opened with ``O_DIRECT`` where the filesystem accepts it (probed once per folder: tmpfs and
some overlay filesystems refuse it), so the state streams without filling the page cache,
which would otherwise grow host RAM by the size of the state and defeat the budget; buffers,
offsets and lengths are 4096-aligned for it. Where it is refused, buffered I/O runs instead
and the reason is logged once at WARNING (``direct_io=True`` makes it an error).
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import struct
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional, Tuple

import torch

from ..planning.offload_config import IO_ALIGN, round_up

log = logging.getLogger("zkernels.offload")

MAGIC = b"ZKSWAP\x00\x01"
VERSION = 1
HEADER_BYTES = IO_ALIGN
_HEADER = struct.Struct("<8sIIQ16sIIIQ")  # magic, version, dtype, numel, kind, unit, rank,
#                                           world size, data offset
# Element dtypes a swap file may hold (the state is fp32; stage 3's parameter shards on NVMe
# are in their compute dtype, and a frozen shard in its own: param_nvme.py).
_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4,
                torch.int64: 5, torch.int32: 6, torch.int16: 7, torch.int8: 8, torch.uint8: 9,
                torch.bool: 10}


class OffloadIOError(RuntimeError):
    """A swap file could not be created, written or read as expected (the message names the
    file and the cause)."""


def aligned_empty(nbytes: int, pin=None) -> torch.Tensor:
    """[nbytes] uint8 host buffer whose address is ``IO_ALIGN``-aligned (O_DIRECT's rule);
    the allocation is ``IO_ALIGN`` bytes larger, the view starts at the first aligned byte.

    Args:
        pin: None, False (pageable) or a callable that page-locks a tensor in place (the
            copier's ``pin``: exact sizes, see [Note: exact pinned sizes] in transfer.py).
    """
    base = torch.empty(nbytes + IO_ALIGN, dtype=torch.uint8)
    if callable(pin):
        pin(base)
    off = (-base.data_ptr()) % IO_ALIGN
    return base[off:off + nbytes]


def _memoryview(t: torch.Tensor, nbytes: int) -> memoryview:
    """A writable view of ``nbytes`` at ``t``'s address (the caller keeps ``t`` alive)."""
    if nbytes > t.numel() * t.element_size() or not t.is_contiguous():
        raise ValueError("I/O buffer too small or not contiguous")
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


def check_writable(offload_dir) -> None:
    """Make sure files can be created under ``offload_dir`` before any work: a real write (a
    probe folder with one file in it, as :func:`make_run_folder` and the swap files will do,
    removed at once), since a folder can exist and refuse files (``/proc``, ``/sys``, a
    read-only mount; as root, permission bits say nothing). A missing ``offload_dir`` is
    probed in its parent, where :func:`make_run_folder` will create it.

    Raises:
        OffloadIOError: naming ``offload_dir`` and the OS error.
    """
    path = os.fspath(offload_dir)
    where = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    try:
        probe = tempfile.mkdtemp(prefix=".zkernels-write-probe-", dir=where)
        try:
            with open(os.path.join(probe, "probe"), "wb") as f:
                f.write(b"\0" * IO_ALIGN)
        finally:
            try:
                os.remove(os.path.join(probe, "probe"))
            except FileNotFoundError:
                pass
            os.rmdir(probe)
    except OSError as exc:
        raise OffloadIOError(f"offload_dir={path!r} is not writable: cannot create files "
                             f"there ({exc})") from exc


def make_run_folder(offload_dir, rank: int) -> str:
    """A new folder of this run's rank under ``offload_dir``.

    Raises:
        OffloadIOError: ``offload_dir`` is not writable (the OS error included).
    """
    try:
        os.makedirs(offload_dir, exist_ok=True)
        return tempfile.mkdtemp(prefix=f"zkernels-offload-rank{rank}-", dir=offload_dir)
    except OSError as exc:
        raise OffloadIOError(f"offload_dir={os.fspath(offload_dir)!r} is not writable: cannot "
                             f"create this run's folder there ({exc})") from exc


def probe_direct_io(folder: str) -> Tuple[bool, str]:
    """Whether ``folder``'s filesystem accepts O_DIRECT reads and writes of aligned blocks.

    Returns:
        ``(ok, reason)``: the reason says why not (or "ok").
    """
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        return False, "this OS has no O_DIRECT"
    path = os.path.join(folder, ".direct-io-probe")
    buf = aligned_empty(IO_ALIGN).zero_()
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | flag, 0o600)
    except OSError as exc:
        return False, f"the filesystem refuses O_DIRECT ({exc.strerror})"
    try:
        os.pwritev(fd, [_memoryview(buf, IO_ALIGN)], 0)
        os.preadv(fd, [_memoryview(buf, IO_ALIGN)], 0)
    except OSError as exc:
        return False, f"O_DIRECT I/O failed ({exc.strerror})"
    finally:
        os.close(fd)
        os.unlink(path)
    return True, "ok"


class SwapFile:
    """One swap file: header + data, fp32 unless ``dtype`` says otherwise (see [Note: swap
    files and their I/O]).

    Use :meth:`create` or :meth:`open_existing`. Attributes: ``path``, ``fd``, ``numel``,
    ``dtype``, ``data_bytes`` (padded), ``kind``, ``unit``, ``rank``, ``world_size``.
    """

    def __init__(self, path: str, fd: int, numel: int, kind: str, unit: int, rank: int,
                 world_size: int, dtype: torch.dtype = torch.float32) -> None:
        if dtype not in _DTYPE_CODES:
            raise ValueError(f"a swap file holds one of {sorted(map(str, _DTYPE_CODES))}, "
                             f"got dtype {dtype}")
        self.path, self.fd, self.numel, self.dtype = path, fd, numel, dtype
        self.kind, self.unit, self.rank, self.world_size = kind, unit, rank, world_size
        self.data_bytes = round_up(numel * dtype.itemsize)

    @property
    def file_bytes(self) -> int:
        return HEADER_BYTES + self.data_bytes

    def _header(self) -> bytes:
        h = _HEADER.pack(MAGIC, VERSION, _DTYPE_CODES[self.dtype], self.numel,
                         self.kind.encode()[:16], self.unit, self.rank, self.world_size,
                         HEADER_BYTES)
        return h + b"\0" * (HEADER_BYTES - len(h))

    @classmethod
    def create(cls, path: str, numel: int, kind: str, unit: int, rank: int, world_size: int,
               direct: bool, dtype: torch.dtype = torch.float32) -> "SwapFile":
        """Create the file with its header and full length (the data written by the caller).

        Raises:
            OffloadIOError: the file cannot be created or its header written (e.g. ENOSPC).
        """
        f = cls(path, -1, numel, kind, unit, rank, world_size, dtype)
        try:
            with open(path, "xb") as out:
                out.write(f._header())
                out.truncate(f.file_bytes)   # (full length now: a file written in exact
                out.flush()                  # byte ranges, a scale file's, is too)
                os.fsync(out.fileno())
        except OSError as exc:
            raise OffloadIOError(_explain(exc, path, "create")) from exc
        f.fd = _open(path, direct)
        return f

    @classmethod
    def open_existing(cls, path: str, numel: int, kind: str, unit: int, rank: int,
                      world_size: int, direct: bool,
                      dtype: torch.dtype = torch.float32) -> "SwapFile":
        """Open a file of an earlier run, checking its header and size.

        Raises:
            OffloadIOError: missing, foreign (bad magic or version), or for another kind,
                unit, rank, world size or element count, or truncated.
        """
        try:
            with open(path, "rb") as inp:
                raw = inp.read(_HEADER.size)
        except OSError as exc:
            raise OffloadIOError(_explain(exc, path, "open")) from exc
        if len(raw) < _HEADER.size or raw[:8] != MAGIC:
            raise OffloadIOError(f"{path} is not a zkernels swap file (bad magic)")
        magic, ver, dt, n, k, u, r, ws, off = _HEADER.unpack(raw)
        if ver != VERSION:
            raise OffloadIOError(f"{path}: swap file format version {ver}, this zkernels "
                                 f"reads version {VERSION}")
        got = (k.rstrip(b"\0").decode(errors="replace"), u, r, ws, n, dt, off)
        want = (kind.encode()[:16].decode(errors="replace"), unit, rank, world_size, numel,
                _DTYPE_CODES[dtype], HEADER_BYTES)   # (the header keeps 16 bytes of a kind)
        if got != want:
            raise OffloadIOError(f"{path} holds (kind, unit, rank, world size, numel, dtype, "
                                 f"offset) = {got}, expected {want}: a file of another run "
                                 f"or layout")
        f = cls(path, -1, numel, kind, unit, rank, world_size, dtype)
        size = os.stat(path).st_size
        if size != f.file_bytes:
            raise OffloadIOError(f"{path} is {size} bytes, expected {f.file_bytes} "
                                 f"(truncated or foreign)")
        f.fd = _open(path, direct)
        return f

    def check_size(self) -> None:
        """Raises OffloadIOError when the file is no longer its full length."""
        size = os.fstat(self.fd).st_size
        if size != self.file_bytes:
            raise OffloadIOError(f"{self.path} is {size} bytes, expected {self.file_bytes}: "
                                 f"the swap file was truncated or replaced; the optimizer "
                                 f"state on disk is lost")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _open(path: str, direct: bool) -> int:
    flags = os.O_RDWR | (os.O_DIRECT if direct else 0)
    try:
        return os.open(path, flags)
    except OSError as exc:
        raise OffloadIOError(_explain(exc, path, "open")) from exc


def _explain(exc: OSError, path: str, what: str) -> str:
    if exc.errno == errno.ENOSPC:
        return (f"no space left on the device holding {path} (while trying to {what} it): "
                f"NVMe offload needs room for the whole optimizer state of this rank under "
                f"offload_dir")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"cannot {what} {path}: the folder is not writable ({exc.strerror})"
    return f"cannot {what} {path}: {exc}"


class AsyncFileIO:
    """Reads and writes of whole aligned ranges on a thread pool (see [Note: swap files and
    their I/O]). Each request returns a Future whose result is the seconds it took.

    Args:
        num_threads: requests in flight at once.

    Attributes:
        bytes_read, bytes_written: totals since :meth:`take_counters`; ``busy_s`` there too:
            the seconds requests took, summed over the I/O threads (finished requests).
    """

    def __init__(self, num_threads: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=num_threads,
                                        thread_name_prefix="zk-offload-io")
        self.bytes_read = self.bytes_written = 0
        self.busy_s = 0.0
        self._lock = threading.Lock()

    def _timed(self, *args) -> float:
        took = _transfer(*args)
        with self._lock:   # counted before the future completes: a waiter sees it
            self.busy_s += took
        return took

    def _submit(self, *args) -> Future:
        return self._pool.submit(self._timed, *args)

    def read(self, f: SwapFile, buf: torch.Tensor, offset: int, nbytes: int,
             counted: bool = True) -> Future:
        """Read ``nbytes`` of ``f``'s data at ``offset`` into ``buf`` (aligned); ``counted``:
        part of a step's traffic (:meth:`take_counters`), not a load or a save."""
        self.bytes_read += nbytes if counted else 0
        return self._submit(os.preadv, f, buf, offset, nbytes, "read")

    def write(self, f: SwapFile, buf: torch.Tensor, offset: int, nbytes: int,
              counted: bool = True) -> Future:
        """Write ``nbytes`` of ``buf`` to ``f``'s data at ``offset`` (``counted``: as
        :meth:`read`)."""
        self.bytes_written += nbytes if counted else 0
        return self._submit(os.pwritev, f, buf, offset, nbytes, "write")

    def take_counters(self) -> dict:
        """``{"disk_read_bytes", "disk_write_bytes", "disk_io_s"}`` since the last call (then
        reset); call it once the requests finished."""
        with self._lock:
            busy, self.busy_s = self.busy_s, 0.0
        out = {"disk_read_bytes": self.bytes_read, "disk_write_bytes": self.bytes_written,
               "disk_io_s": busy}
        self.bytes_read = self.bytes_written = 0
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _transfer(call, f: SwapFile, buf: torch.Tensor, offset: int, nbytes: int,
              what: str) -> float:
    t0 = time.perf_counter()
    done = 0
    view = _memoryview(buf, nbytes)
    pos = HEADER_BYTES + offset
    if offset < 0 or offset + nbytes > f.data_bytes:
        raise OffloadIOError(f"{what} of {nbytes} bytes at {offset} is outside {f.path}'s "
                             f"{f.data_bytes} data bytes")
    while done < nbytes:
        try:
            n = call(f.fd, [view[done:]], pos + done)
        except OSError as exc:
            raise OffloadIOError(_explain(exc, f.path, what)) from exc
        if n <= 0:
            raise OffloadIOError(f"{f.path}: {what} of {nbytes} bytes at data offset {offset} "
                                 f"stopped after {done} bytes: the swap file is truncated")
        done += n
    return time.perf_counter() - t0


def remove_run_folder(folder: Optional[str]) -> None:
    """Remove a run folder and the swap files in it (nothing else is ever put there)."""
    if not folder or not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        try:
            os.unlink(os.path.join(folder, name))
        except OSError:
            pass
    try:
        os.rmdir(folder)
    except OSError as exc:
        log.warning("could not remove the offload folder %s: %s", folder, exc)
