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
TMP_SUFFIX = ".zk-tmp"
OLD_SUFFIX = ".zk-old"


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


def save_pretrained(opt, path: str, max_shard_size="5GB", dtype=None,
                    fsync: bool = True) -> None:
    """Write ``opt``'s model in the Hugging Face layout that ``from_pretrained`` and
    :func:`load_pretrained` read. Collective; rank 0 writes.

    One ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` plus
    ``model.safetensors.index.json`` when the weights exceed ``max_shard_size``; tied keys
    written once (under the first); ``config.json`` from ``opt.module.config`` when it has
    ``save_pretrained`` or ``to_json_file``. Streams one unit at a time (see [Note:
    pretrained weights, names and memory]) into ``path.zk-tmp``, then renames it to ``path``.

    Args:
        path: the folder; if it exists it must be empty or hold only what an earlier
            save_pretrained wrote (it is then replaced whole).
        max_shard_size: bytes per file, an int or ``"5GB"``-style.
        dtype: None (trainable parameters as their fp32 masters, the rest as they are) or a
            floating dtype (``torch.bfloat16``, ``"bf16"``) for every floating tensor.
    """
    view = OptimizerView(opt)
    dtype = _resolve_dtype(dtype)
    limit = parse_size(max_shard_size)
    path = os.path.abspath(os.fspath(path))
    tmp, old = path + TMP_SUFFIX, path + OLD_SUFFIX
    intact = f"{path} is untouched"
    entries, primary, tensors = _save_entries(view, dtype)
    shards = _plan_shards(entries, limit)
    n = len(shards)
    names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                                     for i in range(n)]
    error: Optional[BaseException] = None
    if view.leads:
        try:
            if os.path.lexists(path):
                if not os.path.isdir(path) or os.path.islink(path) or any(
                        not _OURS.match(f) for f in os.listdir(path)):
                    raise CheckpointError(f"{path} exists and holds more than a "
                                          f"save_pretrained output: refusing to replace it")
            for p in (tmp, old):
                if os.path.lexists(p):
                    shutil.rmtree(p)
            os.makedirs(tmp)
        except BaseException as exc:  # noqa: BLE001
            error = exc
    agree(view, error, f"preparing {tmp}", intact, SaveAbortedError)

    error = None
    writer = None
    try:
        dtypes = {k: d for k, d, _ in entries}
        file_of = {entries[i][0]: s for s, idx in enumerate(shards) for i in idx}
        current = -1
        for key, t in _stream(view, primary, tensors):
            if not view.leads:
                continue
            s = file_of[key]
            if s != current:
                if writer is not None:
                    writer.close(fsync)
                current = s
                writer = TensorFileWriter(os.path.join(tmp, names[s]),
                                          [entries[i] for i in shards[s]], {"format": "pt"},
                                          checksum=False)
            writer.write(key, t.to(dtypes[key]))
        if writer is not None:
            writer.close(fsync)
            writer = None
        if view.leads:
            for s in range(current + 1, n):   # files of nothing but empty tensors
                TensorFileWriter(os.path.join(tmp, names[s]), [entries[i] for i in shards[s]],
                                 {"format": "pt"}, checksum=False).close(fsync)
            if n > 1:
                total = sum(math.prod(sh) * d.itemsize for _, d, sh in entries)
                index = {"metadata": {"total_size": total},
                         "weight_map": {k: names[file_of[k]] for k, _, _ in entries}}
                with open(os.path.join(tmp, INDEX), "w") as f:
                    json.dump(index, f, indent=2, sort_keys=True)
            _save_config(view.module, tmp)
    except BaseException as exc:  # noqa: BLE001
        if writer is not None:
            writer.abort()
        error = exc
    agree(view, error, f"writing {tmp}", intact, SaveAbortedError)

    error = None
    if view.leads:
        try:
            if os.path.lexists(path):
                os.rename(path, old)
            os.rename(tmp, path)
            if os.path.lexists(old):
                shutil.rmtree(old)
        except BaseException as exc:  # noqa: BLE001
            error = exc
    agree(view, error, f"publishing {path}", intact, SaveAbortedError)


def _save_config(module, folder: str) -> None:
    config = getattr(module, "config", None)
    if hasattr(config, "save_pretrained"):
        config.save_pretrained(folder)
    elif hasattr(config, "to_json_file"):
        config.to_json_file(os.path.join(folder, "config.json"))
