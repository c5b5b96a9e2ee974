"""Tensor files: the safetensors layout, written by streaming and read by verified byte ranges.

[Note: checkpoint file format]
Every tensor file of a checkpoint (and the ``.safetensors`` that ``consolidate`` exports) has
the safetensors layout: an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
(``{key: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, "__metadata__":
{str: str}}``, space-padded to a multiple of 8), then the raw little-endian tensor bytes back
to back. We write and read it ourselves (about a hundred lines, no dependency), so the
``safetensors`` package is never required, yet every file opens with ``safetensors.safe_open``
and the export loads with ``safetensors.torch.load_file`` and Hugging Face tools.

Why not ``torch.save`` / ``torch.distributed.checkpoint``: both unpickle on load (DCP pickles
its ``.metadata``), and unpickling a file runs whatever code it names; a checkpoint is often
a file someone else wrote. Here the only things ever parsed are JSON and raw numbers:
``json.loads`` and ``readinto`` a byte buffer. DCP's resharding planner is also the one
piece we need and the simplest to write (a parameter's shards are element ranges).

Checksums: CRC-32 (zlib) of every ``BLOCK_BYTES`` block of every file, in the manifest.
Blocks, not whole files, because a rank loading at another world size reads only the byte
ranges it needs and must verify exactly those: it reads the blocks that cover its range
(at most one extra block at each end) and checks each. CRC-32 detects every error burst of up
to 32 bits (any flipped byte) and others with probability 1 - 2^-32; it costs one pass at
~1.6 GB/s per core here, against ~0.7 GB/s for SHA-256 (measured with zlib / hashlib on
64 MiB). It guards against corruption, not against a forger: nothing a forged file contains
is executed, it can only be wrong numbers.
"""
from __future__ import annotations

import json
import os
import struct
import sys
import zlib
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .errors import CorruptCheckpointError

BLOCK_BYTES = 1 << 20          # checksum granularity
_STAGE_BYTES = 8 << 20         # device -> host copies and output chunks
_GROUP_BLOCKS = 4              # blocks read (and verified) per reader call: 4 MiB
MAX_HEADER_BYTES = 100 << 20   # safetensors' own limit

_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
          torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
          torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_DTYPES = {v: k for k, v in _NAMES.items()}


def _check_little_endian() -> None:
    if sys.byteorder != "little":
        raise NotImplementedError("zkernels checkpoints are little-endian; this machine is "
                                  "big-endian")


def dtype_name(dtype: torch.dtype) -> str:
    """safetensors' name of ``dtype`` (e.g. ``"F32"``)."""
    if dtype not in _NAMES:
        raise TypeError(f"tensors of dtype {dtype} cannot be stored in a checkpoint (supported: "
                        f"{', '.join(str(d) for d in _NAMES)})")
    return _NAMES[dtype]


def dtype_from_name(name: str, where: str) -> torch.dtype:
    if name not in _DTYPES:
        raise CorruptCheckpointError(f"{where}: unknown dtype {name!r} (expected one of "
                                     f"{sorted(_DTYPES)})")
    return _DTYPES[name]


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """uint8 numpy view of a contiguous CPU tensor's bytes (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


class TensorFileWriter:
    """Streams tensors into a new file in the safetensors layout, in a fixed order, computing
    the per-block CRC-32 as it goes; nothing is held but one staging chunk.

    Args:
        path: the file to create (its folder must exist).
        entries: ``(key, dtype, shape)`` of every tensor, in the order they will be fed.
        metadata: ``__metadata__`` strings.
        checksum: compute the per-block CRC-32 (off for exports, which no manifest lists).
    """

    def __init__(self, path: str, entries: Sequence[Tuple[str, torch.dtype, Sequence[int]]],
                 metadata: Optional[Dict[str, str]] = None, checksum: bool = True) -> None:
        _check_little_endian()
        self.path = path
        self.checksum = checksum
        header: Dict[str, object] = {}
        self._sizes: List[Tuple[str, int]] = []
        self._dtypes: Dict[str, torch.dtype] = {}
        pos = 0
        for key, dtype, shape in entries:
            if key in header or key == "__metadata__":
                raise ValueError(f"duplicate tensor key {key!r} in {path}")
            nbytes = int(np.prod(shape, dtype=np.int64)) * element_size(dtype)
            header[key] = {"dtype": dtype_name(dtype), "shape": [int(s) for s in shape],
                           "data_offsets": [pos, pos + nbytes]}
            self._sizes.append((key, nbytes))
            self._dtypes[key] = dtype
            pos += nbytes
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.data_start = 8 + len(raw)
        self.offsets = {k: (self.data_start + v["data_offsets"][0],
                            self.data_start + v["data_offsets"][1])
                        for k, v in header.items() if k != "__metadata__"}
        self._file = open(path, "wb")
        self._crcs: List[int] = []
        self._crc = 0
        self._in_block = 0
        self._size = 0
        self._next = 0          # index into self._sizes of the tensor being fed
        self._fed = 0           # bytes of it fed so far
        self._emit(memoryview(struct.pack("<Q", len(raw)) + raw))
        self._skip_empty()

    def _emit(self, data) -> None:
        data = memoryview(data).cast("B")
        self._file.write(data)
        self._size += len(data)
        if not self.checksum:
            return
        pos = 0
        while pos < len(data):
            take = min(len(data) - pos, BLOCK_BYTES - self._in_block)
            self._crc = zlib.crc32(data[pos:pos + take], self._crc)
            self._in_block += take
            pos += take
            if self._in_block == BLOCK_BYTES:
                self._crcs.append(self._crc)
                self._crc, self._in_block = 0, 0

    def _skip_empty(self) -> None:
        while self._next < len(self._sizes) and self._sizes[self._next][1] == self._fed:
            self._next += 1
            self._fed = 0

    def feed(self, key: str, chunk: torch.Tensor) -> None:
        """Append ``chunk`` (any device; its bytes in order) to tensor ``key``, which must be
        the one being written; a tensor may be fed in several chunks."""
        if self._next >= len(self._sizes) or self._sizes[self._next][0] != key:
            expected = self._sizes[self._next][0] if self._next < len(self._sizes) else None
            raise RuntimeError(f"{self.path}: fed {key!r} but the next tensor is {expected!r}")
        if chunk.dtype != self._dtypes[key]:
            raise TypeError(f"{self.path}: {key!r} is declared {self._dtypes[key]}, fed "
                            f"{chunk.dtype}")
        flat = chunk.detach().reshape(-1)
        step = max(1, _STAGE_BYTES // max(1, flat.element_size()))
        for lo in range(0, flat.numel(), step):
            part = flat[lo:lo + step]
            if part.device.type != "cpu":
                part = part.cpu()
            data = _as_bytes(part.contiguous())
            if self._fed + data.nbytes > self._sizes[self._next][1]:
                raise RuntimeError(f"{self.path}: {key!r} was fed more bytes than its shape "
                                   f"holds")
            self._emit(data)
            self._fed += data.nbytes
        self._skip_empty()

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Write the whole tensor ``key``."""
        self.feed(key, tensor)
        if self._next < len(self._sizes) and self._sizes[self._next][0] == key:
            raise RuntimeError(f"{self.path}: {key!r} got fewer bytes than its shape holds")

    def close(self, fsync: bool = True) -> Dict[str, object]:
        """Finish the file (fsync it) and return its manifest entry ``{"size",
        "block_crc32"}``."""
        if self._next != len(self._sizes):
            raise RuntimeError(f"{self.path}: closed before {self._sizes[self._next][0]!r} "
                               f"was written")
        if self._in_block:
            self._crcs.append(self._crc)
        self._file.flush()
        if fsync:
            os.fsync(self._file.fileno())
        self._file.close()
        return {"size": self._size, "block_crc32": list(self._crcs)}

    def abort(self) -> None:
        self._file.close()


class TensorFileReader:
    """Verified byte-range reads from one checkpoint file.

    Every read goes through whole ``BLOCK_BYTES`` blocks whose CRC-32 is checked against the
    manifest before any byte of them is used. The last blocks read stay cached, so
    consecutive small reads (a layer's bias after its weight) read the file once.

    Args:
        path: the file (already resolved inside the checkpoint folder).
        entry: its manifest entry ``{"size": int, "block_crc32": [int, ...]}``.
        label: how messages name the file (e.g. ``"ckpt/shard-00001-of-00002.safetensors"``).
    """

    def __init__(self, path: str, entry: Dict[str, object], label: str) -> None:
        _check_little_endian()
        self.label = label
        self.size = int(entry["size"])
        self.crcs = list(entry["block_crc32"])
        if len(self.crcs) != -(-self.size // BLOCK_BYTES):
            raise CorruptCheckpointError(f"{label}: the manifest lists {len(self.crcs)} "
                                         f"checksum blocks for {self.size} bytes")
        try:
            self._file = open(path, "rb")
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{label} is missing: the manifest lists it "
                                         f"({self.size} bytes) but there is no such file") \
                from None
        actual = os.fstat(self._file.fileno()).st_size
        if actual != self.size:
            self._file.close()
            what = "truncated" if actual < self.size else "longer than recorded"
            raise CorruptCheckpointError(f"{label} is {what}: {actual} bytes, the manifest "
                                         f"says {self.size}")
        self._scratch = np.empty(_GROUP_BLOCKS * BLOCK_BYTES, dtype=np.uint8)
        self._lo = self._hi = 0     # blocks [_lo, _hi) are verified and held in _scratch
        self._len = 0               # their bytes

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "TensorFileReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _load_blocks(self, lo: int, hi: int) -> None:
        start = lo * BLOCK_BYTES
        length = min(hi * BLOCK_BYTES, self.size) - start
        self._lo = self._hi = 0
        self._file.seek(start)
        view = memoryview(self._scratch)[:length]
        got = self._file.readinto(view)
        if got != length:
            raise CorruptCheckpointError(f"{self.label}: short read at byte {start} "
                                         f"({got} of {length} bytes): the file changed while "
                                         f"it was read")
        for j in range(hi - lo):
            b = j * BLOCK_BYTES
            crc = zlib.crc32(view[b:b + BLOCK_BYTES])
            if crc != self.crcs[lo + j]:
                end = min(b + BLOCK_BYTES, length)
                raise CorruptCheckpointError(
                    f"{self.label}: checksum mismatch in block {lo + j} (bytes "
                    f"{start + b}..{start + end}): CRC-32 {crc:#010x}, the manifest says "
                    f"{self.crcs[lo + j]:#010x}; the file is corrupt")
        self._lo, self._hi, self._len = lo, hi, length

    def read_into(self, offset: int, out: np.ndarray) -> None:
        """Fill ``out`` (a uint8 numpy array, C-contiguous) with the verified bytes
        ``[offset, offset + out.nbytes)`` of the file: only the blocks that cover them are
        read, at most ``_GROUP_BLOCKS`` at a time; the last ones read stay cached."""
        n = out.nbytes
        if offset < 0 or offset + n > self.size:
            raise CorruptCheckpointError(f"{self.label}: the manifest points at bytes "
                                         f"{offset}..{offset + n} of a {self.size}-byte file")
        last = (offset + n - 1) // BLOCK_BYTES if n else 0
        pos = 0
        while pos < n:
            at = offset + pos
            blk = at // BLOCK_BYTES
            if not self._lo <= blk < self._hi:
                self._load_blocks(blk, min(blk + _GROUP_BLOCKS, last + 1))
            lo = at - self._lo * BLOCK_BYTES
            take = min(n - pos, self._len - lo)
            out[pos:pos + take] = self._scratch[lo:lo + take]
            pos += take

    def read_bytes(self, offset: int, nbytes: int) -> bytes:
        buf = np.empty(nbytes, dtype=np.uint8)
        self.read_into(offset, buf)
        return buf.tobytes()

    def read_tensor(self, offset: int, dtype: torch.dtype, numel: int,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``numel`` elements of ``dtype`` at byte ``offset`` into ``out`` (a contiguous CPU
        tensor of that dtype) or a new tensor."""
        if out is None:
            out = torch.empty(numel, dtype=dtype)
        self.read_into(offset, _as_bytes(out))
        return out

    def header(self) -> Dict[str, object]:
        """The file's safetensors header (verified, parsed as JSON)."""
        if self.size < 8:
            raise CorruptCheckpointError(f"{self.label}: {self.size} bytes is too short for a "
                                         f"tensor file header")
        (n,) = struct.unpack("<Q", self.read_bytes(0, 8))
        if n > MAX_HEADER_BYTES or 8 + n > self.size:
            raise CorruptCheckpointError(f"{self.label} is not a tensor file (header length "
                                         f"{n} for a {self.size}-byte file)")
        try:
            header = json.loads(self.read_bytes(8, n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptCheckpointError(f"{self.label} is not a tensor file: its header is "
                                         f"not JSON ({exc})") from None
        if not isinstance(header, dict):
            raise CorruptCheckpointError(f"{self.label}: its header is not a JSON object")
        return header
