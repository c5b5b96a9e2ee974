"""Full weights from a sharded checkpoint, on one machine, by streaming.

``consolidate(path)`` returns ``{state_dict key: tensor}`` exactly as the model's
``state_dict()`` would hold them (trainable parameters as their fp32 masters, frozen
parameters and buffers as saved, tied keys sharing one tensor): memory is the output plus one
8 MiB staging buffer. ``consolidate_to_file(path, out)`` streams into a ``.safetensors``
file piece by piece, so its memory is the staging buffers alone, whatever the model's size;
a ``.pt`` output is ``torch.save`` of the in-memory dict (plain tensors, loadable with
``torch.load(out, weights_only=True)``). ``consolidate_moments(path)`` exports the AdamW
moments in fp32 (low-bit ones dequantized).
"""
from __future__ import annotations

import math
import os
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from . import manifest
from ._lowbit import read_lowbit, saved_format
from ._read import CheckpointFiles
from ._tensorfile import TensorFileWriter, dtype_from_name
from .load import open_folder

EXPORT_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                 "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def _resolve_dtype(dtype) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype):
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
        return dtype
    if dtype in EXPORT_DTYPES:
        return EXPORT_DTYPES[dtype]
    raise ValueError(f"dtype must be None, a torch floating dtype or one of "
                     f"{sorted(EXPORT_DTYPES)}, got {dtype!r}")


def _entries(m: Dict[str, Any], dtype: Optional[torch.dtype]
             ) -> Iterator[Tuple[Dict[str, Any], torch.dtype, Tuple[int, ...]]]:
    """``(model entry, output dtype, shape)`` per state_dict key; aliases resolved to the
    entry they repeat. Only floating-point tensors change dtype."""
    by_key = {e["key"]: e for e in m["model"]}
    for e in m["model"]:
        src = e
        while src["kind"] == "alias":
            src = by_key[src["of"]]
        if src["kind"] == "param":
            p = m["params"][src["of"]]
            saved, shape = dtype_from_name(p["dtype"], f"params[{src['of']!r}]"), p["shape"]
        else:
            saved, shape = dtype_from_name(src["dtype"], f"model[{src['key']!r}]"), src["shape"]
        out = dtype if dtype is not None and saved.is_floating_point else saved
        yield dict(e, source=src), out, tuple(shape)


def consolidate(path: str, dtype=None) -> Dict[str, torch.Tensor]:
    """``{state_dict key: tensor}`` of the checkpoint at ``path``, on the CPU.

    Args:
        path: a checkpoint folder.
        dtype: None (trainable parameters in fp32, the rest as saved) or a floating dtype
            (``torch.bfloat16`` or ``"bf16"``, ...) for every floating-point tensor.

    Returns:
        a dict ``model.load_state_dict`` accepts; tied keys share one tensor.
    """
    dtype = _resolve_dtype(dtype)
    folder = open_folder(path)
    m = manifest.read(folder)
    out: Dict[str, torch.Tensor] = {}
    built: Dict[str, torch.Tensor] = {}
    with CheckpointFiles(folder, m) as files:
        for e, out_dtype, shape in _entries(m, dtype):
            src = e["source"]
            ident = src["of"] if src["kind"] == "param" else src["key"]
            if ident not in built:
                t = torch.empty(shape, dtype=out_dtype)
                if src["kind"] == "param":
                    files.read_param(src["of"], "master", 0, t.numel(), t.view(-1))
                else:
                    files.tensor(src, f"model[{src['key']!r}]", out=t)
                built[ident] = t
            out[e["key"]] = built[ident]
    return out


def consolidate_moments(path: str) -> Dict[str, Dict[str, Any]]:
    """The AdamW state of checkpoint ``path`` for export: ``{parameter name: {"exp_avg",
    "exp_avg_sq": fp32 tensors of its shape, "step": int}}``, low-bit moments dequantized
    ([Note: low-bit moments in a checkpoint] in ``_lowbit.py``). Parameters of a group that
    ran a torch.optim class (no AdamW moments) and frozen ones are left out."""
    folder = open_folder(path)
    m = manifest.read(folder)
    out: Dict[str, Dict[str, Any]] = {}
    with CheckpointFiles(folder, m) as files:
        for name, p in m["params"].items():
            pieces = p["pieces"]
            if p.get("frozen") or not pieces or "exp_avg" not in pieces[0]:
                continue
            numel, shape = math.prod(p["shape"]), tuple(p["shape"])
            desc = saved_format(m, name)
            if desc is not None:
                exp_avg, exp_avg_sq, _ = read_lowbit(files, name, 0, numel, desc)
            else:
                exp_avg, exp_avg_sq = torch.empty(numel), torch.empty(numel)
                files.read_param(name, "exp_avg", 0, numel, exp_avg)
                files.read_param(name, "exp_avg_sq", 0, numel, exp_avg_sq)
            out[name] = {"exp_avg": exp_avg.view(shape), "exp_avg_sq": exp_avg_sq.view(shape),
                         "step": pieces[0]["step"]}
    return out


def consolidate_to_file(path: str, out: str, dtype=None) -> None:
    """Write the consolidated weights of checkpoint ``path`` to ``out`` atomically.

    Args:
        out: ``*.safetensors`` (streamed: memory stays at the staging buffers) or ``*.pt``
            (``torch.save`` of :func:`consolidate`'s dict: memory is the output's size).
        dtype: as in :func:`consolidate`.
    """
    out = os.fspath(out)
    if out.endswith(".pt") or out.endswith(".pth"):
        tensors = consolidate(path, dtype)
        tmp = out + ".tmp"
        torch.save(tensors, tmp)
        os.replace(tmp, out)
        return
    if not out.endswith(".safetensors"):
        raise ValueError(f"out must end in .safetensors or .pt, got {out!r}")
    dtype = _resolve_dtype(dtype)
    folder = open_folder(path)
    m = manifest.read(folder)
    entries = list(_entries(m, dtype))
    tmp = out + ".tmp"
    writer = TensorFileWriter(tmp, [(e["key"], d, s) for e, d, s in entries],
                              {"format": "pt", "source": "zkernels.checkpoint.consolidate"},
                              checksum=False)
    try:
        with CheckpointFiles(folder, m) as files:
            for e, out_dtype, _ in entries:
                src = e["source"]
                for chunk in _source_chunks(files, m, src):
                    writer.feed(e["key"], chunk.to(out_dtype))
        writer.close()
    except BaseException:
        writer.abort()
        os.remove(tmp)
        raise
    os.replace(tmp, out)


def _source_chunks(files: CheckpointFiles, m: Dict[str, Any],
                   src: Dict[str, Any]) -> Iterator[torch.Tensor]:
    if src["kind"] == "param":
        p = m["params"][src["of"]]
        saved = dtype_from_name(p["dtype"], f"params[{src['of']!r}]")
        for piece in p["pieces"]:
            begin, end = piece["master"]
            n = piece["end"] - piece["start"]
            if end - begin != n * saved.itemsize:
                raise manifest.CorruptCheckpointError(
                    f"params[{src['of']!r}]: a master byte range does not match its elements")
            yield from files.chunks(piece["file"], begin, saved, n)
    else:
        saved = dtype_from_name(src["dtype"], f"model[{src['key']!r}]")
        begin, end = src["offsets"]
        n = math.prod(src["shape"])
        if end - begin != n * saved.itemsize:
            raise manifest.CorruptCheckpointError(
                f"model[{src['key']!r}]: its byte range does not match its shape")
        yield from files.chunks(src["file"], begin, saved, n)


def verify(path: str) -> Dict[str, int]:
    """Read every byte of every file of checkpoint ``path`` and check every checksum.

    Returns:
        ``{"files": count, "bytes": total}``.

    Raises:
        CorruptCheckpointError: the first missing, truncated or corrupt file.
    """
    folder = open_folder(path)
    m = manifest.read(folder)
    total = 0
    with CheckpointFiles(folder, m) as files:
        for name, entry in m["files"].items():
            reader = files.reader(name)
            step = 8 << 20
            for lo in range(0, entry["size"], step):
                reader.read_bytes(lo, min(step, entry["size"] - lo))
            reader.header()
            total += entry["size"]
    return {"files": len(m["files"]), "bytes": total}
