"""Hugging Face-layout weights in and out of a ``ZeroOptimizer``'s shards.

    result = zk.checkpoint.load_pretrained(opt, "llama-dir")   # model.safetensors[.index.json]
    zk.checkpoint.save_pretrained(opt, "out-dir", max_shard_size="5GB", dtype="bf16")

[Note: pretrained weights, names and memory]
Names map as ``from_pretrained`` maps them. Every key of ``opt.module.state_dict()`` is
looked up in the files under its own name and, for a peft model, under the name without
peft's ``base_model.model.`` prefix and its LoRA wrapper's ``.base_layer`` segment (the
names the base model was saved under). Tied weights (``lm_head.weight`` sharing the
embedding's tensor) are one parameter with several keys: the first key the files hold feeds
it, so a file holding only the embedding loads both, and no key of a tied group is missing
when another is present. Keys no file holds are ``missing_keys`` (an error unless
``strict=False``; they keep their values), file keys no model key asks for are
``unexpected_keys`` (reported, as transformers does), and a shape that differs is refused,
by name, before anything is written.

Memory is bounded by one unit. ``load_pretrained`` walks the optimizer's units
(:meth:`~._view.OptimizerView.write_fresh`): for each piece of its shard (elements
``[start, end)`` of one flattened parameter) a rank reads, through ``safe_open(...).
get_slice``, only the rows of the tensor that cover the range (a 2-D weight cut
mid-row costs at most one extra row at each end), converts them to the master's dtype and
copies them in; each unit's state is handed back before the next is touched. So a rank reads
about its share of the file's bytes, and the buffer is one piece. One file is open at a time:
``safe_open`` memory-maps it, and the pages a rank reads count in its RSS until the file is
closed, so keeping every file open would add the rank's share of all of them (2Ψ/N for bf16
files) to its peak; closed as the next opens, they add at most its share of one file.
Buffers and stages 1-2's frozen parameters (whole on every rank) are read whole. Because it writes shards unit by
unit and never needs the model's full parameters, the same walk serves a model whose
parameters were never materialized.
``save_pretrained`` all-gathers one unit's fp32 masters (a frozen unit's values) at a time
(:meth:`~._view.OptimizerView.full_units`); rank 0 streams its parameters into the shard file
they belong to and drops the unit. The shard plan (which key goes to which
``model-0000i-of-0000N.safetensors``) is made from shapes and dtypes alone before any data
moves, in the order the units will produce them.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from . import _atomic
from ._atomic import OLD_SUFFIX, TMP_SUFFIX
from ._collective import agree
from ._tensorfile import TensorFileWriter
from ._view import OptimizerView
from .consolidate import _resolve_dtype
from .errors import CheckpointError, IncompatibleCheckpointError, SaveAbortedError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_PEFT_PREFIX = "base_model.model."
_OURS = re.compile(r"^(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json"
                   r"|config\.json|generation_config\.json)$")


@dataclass
class LoadResult:
    """What :func:`load_pretrained` found, as transformers' loading info reports it.

    Attributes:
        missing_keys: ``state_dict`` keys no file holds (they kept their values).
        unexpected_keys: file keys the model has no use for (ignored).
    """

    missing_keys: List[str] = field(default_factory=list)
    unexpected_keys: List[str] = field(default_factory=list)


def _file_names(key: str) -> List[str]:
    """The names ``key`` may be saved under (see [Note: pretrained weights, names and memory])."""
    out = [key]
    if key.startswith(_PEFT_PREFIX):
        out.append(key[len(_PEFT_PREFIX):].replace(".base_layer.", "."))
    return out


def weight_map(path: str) -> Dict[str, str]:
    """``{tensor key: file path}`` of a Hugging Face model folder (or one .safetensors)."""
    path = os.fspath(path)
    if os.path.isfile(path):
        folder, files = os.path.dirname(path), None
        single = path
    else:
        folder, single = path, os.path.join(path, SINGLE)
        files = os.path.join(path, INDEX)
    if files is not None and os.path.isfile(files):
        with open(files) as f:
            wm = json.load(f)["weight_map"]
        return {k: os.path.join(folder, v) for k, v in wm.items()}
    if not os.path.isfile(single):
        raise CheckpointError(f"{path}: neither {SINGLE} nor {INDEX} found")
    from safetensors import safe_open
    with safe_open(single, framework="pt") as f:
        return {k: single for k in f.keys()}


def _read_rows(sl, r0: int, r1: int) -> torch.Tensor:
    """Rows ``[r0, r1)`` of a safetensors slice: the only place file bytes are read (tests
    wrap it to count them)."""
    return sl[r0:r1]


class _Reader:
    """Open safetensors files, one at a time, and element ranges of their tensors.

    Only the file being read is open: opening another closes it, which unmaps the pages this
    rank touched (a memory-mapped file's pages count in its RSS while mapped; see [Note:
    pretrained weights, names and memory]). A file is reopened if needed again (the root
    unit's embedding and head are in the first and last files), which costs one header read.
    """

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self._open: Dict[str, object] = {}
        stack.callback(self.close)

    def handle(self, path: str):
        if path not in self._open:
            from safetensors import safe_open
            self.close()
            f = safe_open(path, framework="pt")
            self._open[path] = f.__enter__()
        return self._open[path]

    def close(self) -> None:
        while self._open:
            _, f = self._open.popitem()
            f.__exit__(None, None, None)

    def shape(self, path: str, key: str) -> Tuple[int, ...]:
        return tuple(self.handle(path).get_slice(key).get_shape())

    def read(self, path: str, key: str, start: int, end: int, out: torch.Tensor) -> None:
        """Elements ``[start, end)`` of the flattened tensor into the 1-D ``out`` (cast)."""
        if end <= start:
            return
        sl = self.handle(path).get_slice(key)
        shape = sl.get_shape()
        if not shape:   # a 0-d tensor: one element
            t = self.handle(path).get_tensor(key).reshape(-1)
            r0, row = 0, 1
        else:
            row = math.prod(shape[1:])
            r0, r1 = start // row, -(-end // row)
            t = _read_rows(sl, r0, r1).reshape(-1)
        lo = start - r0 * row
        out.copy_(t[lo:lo + end - start])


def _groups(view: OptimizerView):
    """``(keys, target)`` per distinct tensor of the state_dict: all its keys (tied ones
    together, first first) and either a parameter name (sharded: filled piece by piece) or
    the tensor itself (buffers, stages 1-2's frozen parameters)."""
    groups: Dict[object, Tuple[List[str], object]] = {}
    first: Dict[str, object] = {}
    for e in view.model_entries():
        if e.kind == "param":
            ident = ("param", e.of)
            groups.setdefault(ident, ([], e.of))[0].append(e.key)
        elif e.kind == "alias":
            ident = first[e.of]
            groups[ident][0].append(e.key)
        else:
            ident = ("tensor", e.key)
            groups[ident] = ([e.key], e.tensor)
        first[e.key] = ident
    return list(groups.values())


def _shape_of(view: OptimizerView, target) -> Tuple[int, ...]:
    if isinstance(target, str):
        info = view.params.get(target) or view.frozen[target]
        return tuple(info.shape)
    return tuple(target.shape)


def load_pretrained(opt, path: str, strict: bool = True) -> LoadResult:
    """Load Hugging Face-layout safetensors weights into ``opt``'s shards. Collective.

    Reads ``path/model.safetensors``, or the files ``path/model.safetensors.index.json``
    lists (or ``path`` itself, one ``.safetensors`` file). Each rank reads only the rows
    covering the element ranges of its own shards, cast to the fp32 master (a frozen shard's
    dtype); the compute copy follows (stages 1-2: the model's parameters; stage 3: the next
    gather). The optimizer starts fresh: moments zero, step 0. Names map as ``from_pretrained``
    maps them (see [Note: pretrained weights, names and memory]).

    Args:
        opt: a ``zkernels.ZeroOptimizer``.
        path: a model folder or one ``.safetensors`` file.
        strict: raise if a key of the model's ``state_dict`` is in no file.

    Returns:
        a :class:`LoadResult` (``missing_keys``, ``unexpected_keys``).

    Raises:
        IncompatibleCheckpointError: shapes differ (by name), or keys are missing with
            ``strict``; nothing has been written then.
    """
    view = OptimizerView(opt)
    wm = weight_map(path)
    result = LoadResult()
    sources: Dict[object, Tuple[str, str]] = {}   # target ident -> (file, key)
    plan: List[Tuple[object, Tuple[str, str]]] = []
    mismatched = []
    with contextlib.ExitStack() as stack:
        reader = _Reader(stack)
        for keys, target in _groups(view):
            found = next(((fk, wm[fk]) for k in keys for fk in _file_names(k) if fk in wm),
                         None)
            if found is None:
                result.missing_keys.extend(keys)
                continue
            fk, fpath = found
            want, have = _shape_of(view, target), reader.shape(fpath, fk)
            if want != have:
                mismatched.append(f"{keys[0]} (file {fk}: {have}, model {want})")
                continue
            plan.append((target, (fpath, fk)))
            if isinstance(target, str):
                sources[target] = (fpath, fk)
        used = {fk for keys, _ in _groups(view) for k in keys for fk in _file_names(k)
                 if fk in wm}
        result.unexpected_keys = [k for k in wm if k not in used]
        if mismatched:
            raise IncompatibleCheckpointError(
                f"{path}: shapes differ from the model's: {', '.join(mismatched)}")
        if strict and result.missing_keys:
            raise IncompatibleCheckpointError(
                f"{path}: missing keys {result.missing_keys} (pass strict=False to keep their "
                f"values)")

        def fill(name, start, end, out):
            src = sources.get(name)
            if src is not None:
                reader.read(src[0], src[1], start, end, out)

        error: Optional[BaseException] = None
        try:
            with torch.no_grad():
                view.write_fresh(fill)
                for target, (fpath, fk) in plan:
                    if not isinstance(target, str):   # buffers, stages 1-2's frozen: whole
                        reader.read(fpath, fk, 0, target.numel(), target.view(-1))
        except BaseException as exc:  # noqa: BLE001 - every rank must learn of it
            error = exc
        agree(view, error, f"loading {path}",
              "the optimizer is partly overwritten: rebuild it before training or retrying")
    view.finish_fresh()
    return result


def parse_size(size) -> int:
    """Bytes of ``max_shard_size``: an int, or ``"5GB"`` / ``"500MB"`` / ``"2GiB"`` as
    transformers reads them (KB, MB, GB are powers of 10; KiB, MiB, GiB of 2)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size must be an int or like '5GB', got {size!r}")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10,
             "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(float(m.group(1)) * scale)


def _save_entries(view: OptimizerView, dtype: Optional[torch.dtype]):
    """``[(key, dtype, shape)]`` in the order :func:`_stream` yields them, and the first key
    of each parameter name. Tied keys are written once, under their first key."""
    primary: Dict[str, str] = {}
    tensors = []
    seen_ids = set()
    for keys, target in _groups(view):
        if isinstance(target, str):
            primary[target] = keys[0]
        elif id(target) not in seen_ids:
            seen_ids.add(id(target))
            tensors.append((keys[0], target))

    def out(d):
        return dtype if dtype is not None and d.is_floating_point else d
    entries = []
    for u in list(view.opt.units) + list(view.frozen_units):
        for name, shape in zip(u.names, u.shapes):
            if name in primary:
                entries.append((primary[name], out(torch.float32 if name in view.params
                                                   else u.compute_dtype), tuple(shape)))
    entries += [(k, out(t.dtype), tuple(t.shape)) for k, t in tensors]
    return entries, primary, tensors


def _plan_shards(entries, limit: int) -> List[List[int]]:
    """Indices of ``entries`` per file, in order: a file is closed when the next tensor
    would take it past ``limit`` (a larger tensor gets a file of its own)."""
    shards, size = [[]], 0
    for i, (_, d, shape) in enumerate(entries):
        n = math.prod(shape) * d.itemsize
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += n
    return shards


def _stream(view: OptimizerView, primary, tensors) -> Iterator[Tuple[str, torch.Tensor]]:
    for name, t in view.full_units():
        if name in primary:
            yield primary[name], t
    for k, t in tensors:
        yield k, t


class LayoutWriter:
    """The Hugging Face layout's files for ``entries`` (``(key, dtype, shape)``, in the order
    they will be fed) in ``folder``: one ``model.safetensors``, or
    ``model-0000i-of-0000N.safetensors`` plus ``model.safetensors.index.json`` when they
    exceed ``limit`` bytes. Each tensor may be fed in several chunks; a file is opened when
    its first tensor arrives and closed at the next file's. The one writer of
    :func:`save_pretrained` and ``python -m zkernels checkpoint consolidate --hf``."""

    def __init__(self, folder: str, entries, limit: int, fsync: bool = True) -> None:
        self.folder, self.entries, self.fsync = folder, list(entries), fsync
        self.shards = _plan_shards(self.entries, limit)
        n = len(self.shards)
        self.names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                                              for i in range(n)]
        self.dtypes = {k: d for k, d, _ in self.entries}
        self.file_of = {self.entries[i][0]: s for s, idx in enumerate(self.shards) for i in idx}
        self._writer: Optional[TensorFileWriter] = None
        self._current = -1

    def _open(self, s: int) -> None:
        self._writer = TensorFileWriter(os.path.join(self.folder, self.names[s]),
                                        [self.entries[i] for i in self.shards[s]],
                                        {"format": "pt"}, checksum=False)
        self._current = s

    def feed(self, key: str, chunk: torch.Tensor) -> None:
        s = self.file_of[key]
        while s != self._current:
            if self._writer is not None:
                self._writer.close(self.fsync)
                self._writer = None
            self._open(self._current + 1)   # files of nothing but empty tensors included
        self._writer.feed(key, chunk.to(self.dtypes[key]))

    def close(self) -> None:
        while True:
            if self._writer is not None:
                self._writer.close(self.fsync)
                self._writer = None
            if self._current + 1 >= len(self.shards):
                break
            self._open(self._current + 1)
        if len(self.shards) > 1:
            total = sum(math.prod(sh) * d.itemsize for _, d, sh in self.entries)
            index = {"metadata": {"total_size": total},
                     "weight_map": {k: self.names[self.file_of[k]] for k, _, _ in self.entries}}
            with open(os.path.join(self.folder, INDEX), "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
            self._writer = None


def prepare(path: str, keep_others: bool) -> str:
    """Check ``path`` may be written and make an empty ``path.zk-tmp`` beside it."""
    tmp, old = path + TMP_SUFFIX, path + OLD_SUFFIX
    if os.path.lexists(path) and not keep_others:
        if not os.path.isdir(path) or os.path.islink(path) or any(
                not _OURS.match(f) for f in os.listdir(path)):
            raise CheckpointError(f"{path} exists and holds more than a save_pretrained "
                                  f"output: refusing to replace it")
    if keep_others and os.path.lexists(path) and not os.path.isdir(path):
        raise CheckpointError(f"{path} exists and is not a folder")
    for p in (tmp, old):
        if os.path.lexists(p):
            shutil.rmtree(p)
    os.makedirs(tmp)
    return tmp


def publish(tmp: str, path: str, keep_others: bool, fsync: bool) -> None:
    """Move the finished ``tmp`` to ``path``: the whole folder (``keep_others=False``), or
    file by file into ``path``, after removing the files of this layout an earlier save left
    there (stale shards, index, config), as transformers' ``save_pretrained`` does."""
    if not keep_others:
        _atomic.publish(path, fsync)
        return
    os.makedirs(path, exist_ok=True)
    for f in os.listdir(path):
        if _OURS.match(f) and os.path.isfile(os.path.join(path, f)):
            os.remove(os.path.join(path, f))
    for f in os.listdir(tmp):
        os.replace(os.path.join(tmp, f), os.path.join(path, f))
    os.rmdir(tmp)


def save_pretrained(opt, path: str, max_shard_size="5GB", dtype=None,
                    fsync: bool = True, keep_others: bool = False) -> None:
    """Write ``opt``'s model in the Hugging Face layout that ``from_pretrained`` and
    :func:`load_pretrained` read. Collective; rank 0 writes.

    One ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` plus
    ``model.safetensors.index.json`` when the weights exceed ``max_shard_size``; tied keys
    written once (under the first); ``config.json`` from ``opt.module.config`` when it has
    ``save_pretrained`` or ``to_json_file``. Streams one unit at a time (see [Note:
    pretrained weights, names and memory]) into ``path.zk-tmp``, then renames it to ``path``.

    Args:
        path: the folder; if it exists it must be empty or hold only what an earlier
            save_pretrained wrote (it is then replaced whole), unless ``keep_others``.
        max_shard_size: bytes per file, an int or ``"5GB"``-style.
        dtype: None (trainable parameters as their fp32 masters, the rest as they are) or a
            floating dtype (``torch.bfloat16``, ``"bf16"``) for every floating tensor.
        keep_others: ``path`` may hold other files (a Trainer's output folder: checkpoints,
            tokenizer, logs), which stay; this layout's files in it are replaced (see
            :func:`publish`).
    """
    view = OptimizerView(opt)
    dtype = _resolve_dtype(dtype)
    limit = parse_size(max_shard_size)
    path = os.path.abspath(os.fspath(path))
    tmp = path + TMP_SUFFIX
    intact = f"{path} is untouched"
    entries, primary, tensors = _save_entries(view, dtype)
    error: Optional[BaseException] = None
    if view.leads:
        try:
            prepare(path, keep_others)
        except BaseException as exc:  # noqa: BLE001
            error = exc
    agree(view, error, f"preparing {tmp}", intact, SaveAbortedError)

    error = None
    writer = LayoutWriter(tmp, entries, limit, fsync) if view.leads else None
    try:
        for key, t in _stream(view, primary, tensors):   # every rank: the gathers
            if writer is not None:
                writer.feed(key, t)
        if writer is not None:
            writer.close()
            _save_config(view.module, tmp)
    except BaseException as exc:  # noqa: BLE001
        if writer is not None:
            writer.abort()
        error = exc
    agree(view, error, f"writing {tmp}", intact, SaveAbortedError)

    error = None
    if view.leads:
        try:
            publish(tmp, path, keep_others, fsync)
        except BaseException as exc:  # noqa: BLE001
            error = exc
    agree(view, error, f"publishing {path}", intact, SaveAbortedError)


def _save_config(module, folder: str) -> None:
    config = getattr(module, "config", None)
    if hasattr(config, "save_pretrained"):
        config.save_pretrained(folder)
    elif hasattr(config, "to_json_file"):
        config.to_json_file(os.path.join(folder, "config.json"))


def consolidate_to_pretrained(checkpoint: str, out: str, max_shard_size="5GB", dtype=None,
                              config: Optional[str] = None, fsync: bool = True) -> None:
    """A ``zkernels.checkpoint`` folder's full weights in the Hugging Face layout, on one
    machine, with the writer :func:`save_pretrained` uses (tied keys once, under the first;
    shards and index past ``max_shard_size``). Streams piece by piece: memory is the staging
    buffers. ``config``: a ``config.json`` or a model folder whose ``config.json`` (and
    ``generation_config.json``) are copied beside the weights, so that ``from_pretrained``
    loads ``out`` (a checkpoint holds no model config)."""
    from . import manifest
    from ._read import CheckpointFiles
    from .consolidate import _entries, _source_chunks
    from .load import open_folder
    dtype = _resolve_dtype(dtype)
    configs = []
    if config is not None:
        config = os.fspath(config)
        names = ("config.json", "generation_config.json")
        configs = [os.path.join(config, n) for n in names
                   if os.path.isfile(os.path.join(config, n))] if os.path.isdir(config) \
            else [config]
        if not configs or not all(os.path.isfile(c) for c in configs):
            raise ValueError(f"config must be a config.json or a folder holding one, got "
                             f"{config!r}")
    folder = open_folder(checkpoint)
    m = manifest.read(folder)
    entries, seen = [], set()
    for e, d, s in _entries(m, dtype):   # a tied tensor once, under its first key
        src = e["source"]
        ident = (src["kind"] == "param", src["of"] if src["kind"] == "param" else src["key"])
        if ident not in seen:
            seen.add(ident)
            entries.append((e, d, s))
    out = os.path.abspath(os.fspath(out))
    tmp = prepare(out, keep_others=False)
    writer = LayoutWriter(tmp, [(e["key"], d, s) for e, d, s in entries],
                          parse_size(max_shard_size), fsync)
    try:
        with CheckpointFiles(folder, m) as files:
            for e, _, _ in entries:
                for chunk in _source_chunks(files, m, e["source"]):
                    writer.feed(e["key"], chunk)
        writer.close()
        for c in configs:
            shutil.copyfile(c, os.path.join(tmp, os.path.basename(c) if c.endswith(
                "generation_config.json") else "config.json"))
    except BaseException:
        writer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish(tmp, out, keep_others=False, fsync=fsync)
