"""Reading a checkpoint's tensors: open files on demand, verified ranges into any target."""
from __future__ import annotations

import collections
import math
from typing import Any, Dict, Iterator, List, Optional

import torch

from . import manifest
from ._tensorfile import _STAGE_BYTES, TensorFileReader, _as_bytes, dtype_from_name

MAX_OPEN_FILES = 16  # each holds a 4 MiB verified-read buffer


class CheckpointFiles:
    """The files of one checkpoint folder, opened when first read (at most
    ``MAX_OPEN_FILES`` at once, least recently used closed first)."""

    def __init__(self, folder: str, m: Dict[str, Any]) -> None:
        self.folder = folder
        self.m = m
        self._open: "collections.OrderedDict[str, TensorFileReader]" = collections.OrderedDict()

    def reader(self, name: str) -> TensorFileReader:
        r = self._open.pop(name, None)
        if r is None:
            if name not in self.m["files"]:
                raise manifest.CorruptCheckpointError(
                    f"{self.folder}: the manifest refers to file {name!r} but does not list it")
            path = manifest.resolve(self.folder, name)
            r = TensorFileReader(path, self.m["files"][name], path)
            try:
                r.header()  # a file that is not a tensor file fails here, whatever it holds
            except BaseException:
                r.close()
                raise
            if len(self._open) >= MAX_OPEN_FILES:
                self._open.popitem(last=False)[1].close()
        self._open[name] = r
        return r

    def close(self) -> None:
        while self._open:
            self._open.popitem()[1].close()

    def __enter__(self) -> "CheckpointFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read_into(self, file: str, offset: int, saved_dtype: torch.dtype,
                  target: torch.Tensor) -> None:
        """Fill ``target`` (any device, dtype, 1-D) with ``target.numel()`` elements of
        ``saved_dtype`` stored at byte ``offset`` of ``file``, cast on the way."""
        reader = self.reader(file)
        flat = target.view(-1)
        if flat.device.type == "cpu" and flat.dtype == saved_dtype and flat.is_contiguous():
            reader.read_into(offset, _as_bytes(flat))
            return
        esize = torch.empty((), dtype=saved_dtype).element_size()
        step = max(1, _STAGE_BYTES // esize)
        stage = torch.empty(min(step, flat.numel()), dtype=saved_dtype)
        for lo in range(0, flat.numel(), step):
            n = min(step, flat.numel() - lo)
            part = stage[:n]
            reader.read_into(offset + lo * esize, _as_bytes(part))
            flat[lo:lo + n].copy_(part)

    def chunks(self, file: str, offset: int, saved_dtype: torch.dtype,
               numel: int) -> Iterator[torch.Tensor]:
        """The ``numel`` elements at ``offset``, as successive CPU tensors of at most
        8 MiB (one staging buffer, reused: consume each before the next)."""
        reader = self.reader(file)
        esize = torch.empty((), dtype=saved_dtype).element_size()
        step = max(1, _STAGE_BYTES // esize)
        stage = torch.empty(min(step, max(numel, 1)), dtype=saved_dtype)
        for lo in range(0, numel, step):
            n = min(step, numel - lo)
            reader.read_into(offset + lo * esize, _as_bytes(stage[:n]))
            yield stage[:n]

    def tensor(self, entry: Dict[str, Any], where: str,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A stored whole tensor (``{"file", "dtype", "shape", "offsets"}``), new or into
        ``out`` (same numel; cast and moved as needed)."""
        dtype = dtype_from_name(entry["dtype"], where)
        shape = tuple(entry["shape"])
        numel = math.prod(shape)
        begin, end = entry["offsets"]
        if end - begin != numel * torch.empty((), dtype=dtype).element_size():
            raise manifest.CorruptCheckpointError(f"{where}: byte range {begin}..{end} does not "
                                                  f"hold {shape} of {dtype}")
        if out is not None and out.numel() != numel:
            raise manifest.CorruptCheckpointError(f"{where}: stored shape {shape} does not "
                                                  f"match {tuple(out.shape)}")
        if out is None or not out.is_contiguous():
            flat = torch.empty(numel, dtype=dtype)
            self.read_into(entry["file"], begin, dtype, flat)
            if out is None:
                return flat.view(shape)
            out.copy_(flat.view(out.shape))
            return out
        self.read_into(entry["file"], begin, dtype, out.view(-1))
        return out

    def param_pieces(self, name: str) -> List[Dict[str, Any]]:
        return self.m["params"][name]["pieces"]

    def read_param(self, name: str, field: str, start: int, end: int,
                   target: torch.Tensor) -> None:
        """Elements ``[start, end)`` of field ``field`` of parameter ``name`` into ``target``
        (1-D, ``end - start`` elements), from whichever pieces hold them."""
        saved_dtype = dtype_from_name(self.m["params"][name]["dtype"], f"params[{name!r}]")
        esize = torch.empty((), dtype=saved_dtype).element_size()
        for piece in self.param_pieces(name):
            lo, hi = max(start, piece["start"]), min(end, piece["end"])
            if lo >= hi:
                continue
            begin, stop = piece[field]
            if stop - begin != (piece["end"] - piece["start"]) * esize:
                raise manifest.CorruptCheckpointError(
                    f"params[{name!r}]: the {field} byte range of a piece does not match its "
                    f"element range")
            self.read_into(piece["file"], begin + (lo - piece["start"]) * esize, saved_dtype,
                           target[lo - start:hi - start])

