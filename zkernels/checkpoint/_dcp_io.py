"""Reading and writing element ranges of a ``torch.distributed.checkpoint`` (DCP) folder.

The pieces ``dcp.py`` moves are ranges ``[start, end)`` of flattened parameters; DCP stores
and reads N-d boxes (``ChunkStorageMetadata``: offsets and sizes). This module translates
between the two and drives DCP's own machinery with them: a ``LoadPlanner`` whose local plan
asks for given boxes of given keys (DCP's ``create_read_items_for_chunk_list`` finds the
saved chunks they overlap), a ``SavePlanner`` whose local plan offers given boxes (DCP's
global planning dedups, validates that the chunks tile each tensor and writes
``.metadata``), and a ``FileSystemReader`` whose ``.metadata`` is unpickled with an
allow-list (see [Note: what a DCP folder pickles]).

[Note: what a DCP folder pickles]
DCP's ``.metadata`` is a pickle of its ``Metadata`` dataclass; ``FileSystemReader`` reads
it with ``pickle.load``. Here it is read with an unpickler that resolves only the globals
torch 2.13's DCP writes there (listed by unpickling the ``.metadata`` of FSDP2 checkpoints):
DCP's metadata dataclasses and enum, ``_StorageInfo``, ``torch.Size``, torch dtypes,
``torch.serialization._get_layout`` and ``pathlib`` paths (the checkpoint id). A file naming
any other global is refused with ``UnsafeCheckpointError`` naming it. The tensor data
(``.distcp``) DCP reads itself with ``torch.load(weights_only=True)``; the non-tensor values
(param groups) are read here with ``weights_only=True`` too.
"""
from __future__ import annotations

import io
import math
import pickle
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner,
                                                  ReadItem, SavePlan, TensorWriteData,
                                                  WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ._safe_pickle import UnsafeCheckpointError

Box = Tuple[Tuple[int, ...], Tuple[int, ...], int, int]   # offsets, sizes, flat [a, b)

_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()) or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"refusing to unpickle {module}.{name} from a DCP .metadata file: only DCP's "
            f"metadata classes, torch.Size, dtypes and paths are read (see [Note: what a "
            f"DCP folder pickles])")


class SafeReader(FileSystemReader):
    """DCP's ``FileSystemReader`` with the ``.metadata`` read through the allow-list of
    [Note: what a DCP folder pickles], once (every later ``dcp.load`` reuses it)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._metadata: Optional[Metadata] = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as f:
                md = _MetadataUnpickler(f).load()
            if not isinstance(md, Metadata):
                raise UnsafeCheckpointError(f"{path}: holds a {type(md).__name__}, not DCP's "
                                            f"Metadata")
            self._metadata = md
        return self._metadata


def boxes(shape: Sequence[int], start: int, end: int) -> List[Box]:
    """Elements ``[start, end)`` of a row-major tensor of ``shape`` as the fewest N-d boxes
    that are each contiguous in that order: ``(offsets, sizes, a, b)``, the box holding
    flattened elements ``[a, b)``. At most ``2 * ndim - 1`` boxes."""
    shape = tuple(int(s) for s in shape)
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,) if shape else (), (end - start,) if shape else (), start, end)]
    inner = math.prod(shape[1:])
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(end, inner)

    def row(r: int, a: int, b: int) -> List[Box]:
        return [((r,) + o, (1,) + z, r * inner + x, r * inner + y)
                for o, z, x, y in boxes(shape[1:], a, b)]
    if r0 == r1:
        return row(r0, c0, c1)
    out: List[Box] = []
    if c0:
        out += row(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + shape[1:],
                    r0 * inner, r1 * inner))
    if c1:
        out += row(r1, 0, c1)
    return out


def covering_box(shape: Sequence[int], start: int, end: int) -> Box:
    """The one box of whole rows (along dim 0) that holds elements ``[start, end)``: one
    read per saved chunk it overlaps, at most two rows more than the range."""
    shape = tuple(int(s) for s in shape)
    if len(shape) <= 1:
        return boxes(shape, start, end)[0]
    inner = math.prod(shape[1:])
    r0, r1 = start // inner, -(-end // inner)
    return ((r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + shape[1:], r0 * inner, r1 * inner)


def _narrow(t: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for d, (o, n) in enumerate(zip(offsets, lengths)):
        t = t.narrow(d, o, n)
    return t


class _RangeLoadPlanner(LoadPlanner):
    """Reads given boxes of given tensor keys into given tensors, and given bytes keys."""

    def __init__(self, tensors: List[Tuple[str, Box, torch.Tensor]], byte_keys: List[str]):
        self.tensors = {(k, tuple(b[0])): (b, t) for k, b, t in tensors}
        self.byte_keys = byte_keys
        self.values: Dict[str, Any] = {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items: List[ReadItem] = []
        md = self.metadata.state_dict_metadata
        for (key, _), ((offsets, sizes, _, _), _) in self.tensors.items():
            chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
            items += create_read_items_for_chunk_list(key, md[key], [chunk])
        for key in self.byte_keys:
            index = MetadataIndex(key)
            items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=index,
                                  dest_offsets=torch.Size((0,)), storage_index=index,
                                  storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
        return LoadPlan(items)

    def create_global_plan(self, global_plan: List[LoadPlan]) -> List[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.values[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        index = read_item.dest_index
        _, t = self.tensors[(index.fqn, tuple(index.offset))]
        return _narrow(t, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


def read(reader: SafeReader, tensors: List[Tuple[str, Box, torch.Tensor]],
         byte_keys: Sequence[str] = ()) -> Dict[str, Any]:
    """Fill each ``(key, box, tensor)`` (``tensor`` of the box's sizes, any dtype: DCP's copy
    casts) from the checkpoint, on this rank alone (``no_dist``: no collective); returns the
    values of ``byte_keys``."""
    planner = _RangeLoadPlanner(tensors, list(byte_keys))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load({}, storage_reader=reader, planner=planner, no_dist=True)
    return planner.values


class BoxSavePlanner(DefaultSavePlanner):
    """Offers this rank's boxes (``{(key, offsets): (global shape, tensor)}``) and values
    (``{key: object}``, written as DCP's bytes items) as its local plan; DCP's global
    planning (dedup, the check that the chunks tile each tensor, ``.metadata`` with
    ``mappings`` as its planner data) runs unchanged."""

    def __init__(self, tensors: Dict[Tuple[str, Tuple[int, ...]], Tuple[Tuple[int, ...],
                                                                          torch.Tensor]],
                 values: Dict[str, Any], mappings: Dict[str, Tuple]) -> None:
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=False)
        self._tensors, self._values, self._mappings = tensors, values, mappings

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        self.state_dict, self.mappings = {}, self._mappings
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for (key, offsets), (size, t) in self._tensors.items():
            items.append(WriteItem(
                index=MetadataIndex(key, torch.Size(offsets)), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(offsets), t.shape),
                    properties=TensorProperties.create_from_tensor(t),
                    size=torch.Size(size))))
        items += [WriteItem(index=MetadataIndex(k), type=WriteItemType.BYTE_IO)
                  for k in self._values]
        self.plan = SavePlan(items, planner_data=self._mappings)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.offset is None:
            return self._values[index.fqn]
        t = self._tensors[(index.fqn, tuple(index.offset))][1]
        return t if t.device.type == "cpu" else t.cpu()
