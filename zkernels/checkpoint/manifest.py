"""The manifest: one JSON file that says everything about a checkpoint but the numbers.

Layout of a checkpoint folder::

    PATH/manifest.json                     this file (written last)
    PATH/shard-00000-of-00002.safetensors  rank 0's pieces: master, exp_avg, exp_avg_sq
    PATH/shard-00001-of-00002.safetensors  rank 1's pieces
    PATH/model.safetensors                 frozen parameters, buffers, tensors of model_extra

Manifest keys: ``format`` ("zkernels.checkpoint"), ``format_version``, ``files`` (name ->
size and per-block CRC-32, see [Note: checkpoint file format]), ``params`` (trainable
parameter name -> shape, dtype, group, and the pieces that tile it: file, element range, step,
byte range of each field; stage 3's frozen parameters too, with ``"frozen": true`` and their
values only, see [Note: frozen pieces] in ``_view.py``), ``model`` (every ``state_dict()`` key, in order: a trainable
parameter, a tensor in ``model.safetensors``, or an alias of an earlier key), ``param_groups``
(hyper-parameters and parameter names), ``optimizer`` (step counters, loss scaler),
``extra`` (the caller's ``model_extra``), ``saved_with`` (world size, stage, dtypes: for
people, never needed to load), and ``manifest_crc32`` over the rest.
"""
from __future__ import annotations

import json
import math
import os
import zlib
from typing import Any, Dict

from .errors import CorruptCheckpointError, NotACheckpointError, UnsupportedVersionError

FORMAT = "zkernels.checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MODEL_FILE = "model.safetensors"


def shard_file(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.safetensors"


def _crc(manifest: Dict[str, Any]) -> int:
    body = {k: v for k, v in manifest.items() if k != "manifest_crc32"}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def dumps(manifest: Dict[str, Any]) -> bytes:
    """The manifest as JSON bytes, with its own CRC-32 added."""
    manifest = dict(manifest, manifest_crc32=_crc(manifest))
    return json.dumps(manifest, indent=1, allow_nan=False).encode()


def read(path: str) -> Dict[str, Any]:
    """Parse and check the manifest of the checkpoint folder ``path``.

    Raises:
        NotACheckpointError: ``path`` is missing, is a file, or has no manifest.
        UnsupportedVersionError: a newer format version.
        CorruptCheckpointError: the manifest is not valid JSON, fails its CRC, or is malformed
            (including a file name that would leave the folder).
    """
    if not os.path.exists(path):
        raise NotACheckpointError(f"checkpoint {path!r} does not exist")
    if not os.path.isdir(path):
        raise NotACheckpointError(f"{path!r} is a file, not a zkernels checkpoint (a checkpoint "
                                  f"is a folder holding {MANIFEST}; torch.save files are not "
                                  f"read, they may run code when unpickled)")
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isfile(mpath):
        raise NotACheckpointError(f"{path!r} is not a zkernels checkpoint: it has no {MANIFEST} "
                                  f"(an interrupted save leaves no manifest)")
    with open(mpath, "rb") as f:
        raw = f.read()
    try:
        m = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(f"{mpath} is not valid JSON ({exc})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise NotACheckpointError(f"{mpath} is not a zkernels checkpoint manifest (its "
                                  f"'format' is not {FORMAT!r})")
    version = m.get("format_version")
    if not isinstance(version, int):
        raise CorruptCheckpointError(f"{mpath}: format_version must be an int, got {version!r}")
    if version > FORMAT_VERSION:
        raise UnsupportedVersionError(f"{path!r} has checkpoint format version {version}, newer "
                                      f"than this zkernels reads ({FORMAT_VERSION}): upgrade "
                                      f"zkernels to load it")
    if m.get("manifest_crc32") != _crc(m):
        raise CorruptCheckpointError(f"{mpath} fails its checksum (manifest_crc32): it was "
                                     f"edited or damaged")
    _check_structure(m, mpath)
    return m


def _check_structure(m: Dict[str, Any], where: str) -> None:
    for key, typ in (("files", dict), ("params", dict), ("model", list),
                     ("param_groups", list), ("optimizer", dict)):
        if not isinstance(m.get(key), typ):
            raise CorruptCheckpointError(f"{where}: {key!r} must be a JSON "
                                         f"{'object' if typ is dict else 'array'}")
    for name, entry in m["files"].items():
        check_file_name(name, where)
        if not (isinstance(entry, dict) and isinstance(entry.get("size"), int)
                and isinstance(entry.get("block_crc32"), list)):
            raise CorruptCheckpointError(f"{where}: files[{name!r}] must have an int 'size' "
                                         f"and a 'block_crc32' list")
    keys = set()
    for i, e in enumerate(m["model"]):
        kind = e.get("kind") if isinstance(e, dict) else None
        ok = kind in ("param", "alias") and isinstance(e.get("of"), str) or \
            kind in ("frozen", "buffer") and e.get("file") in m["files"] and \
            isinstance(e.get("shape"), list) and isinstance(e.get("offsets"), list)
        if not ok or not isinstance(e.get("key"), str) or e["key"] in keys:
            raise CorruptCheckpointError(f"{where}: model[{i}] is malformed")
        if kind == "param" and e["of"] not in m["params"] or kind == "alias" and \
                e["of"] not in keys:
            raise CorruptCheckpointError(f"{where}: model[{i}] ({e['key']!r}) refers to "
                                         f"{e['of']!r}, which the manifest does not hold")
        keys.add(e["key"])
    for name, p in m["params"].items():
        if not isinstance(p, dict) or not isinstance(p.get("pieces"), list) \
                or not isinstance(p.get("shape"), list):
            raise CorruptCheckpointError(f"{where}: params[{name!r}] must have 'shape' and "
                                         f"'pieces' lists")
        numel = math.prod(p["shape"])
        pos = 0
        for piece in sorted(p["pieces"], key=lambda q: q.get("start", -1)):
            if piece.get("file") not in m["files"]:
                raise CorruptCheckpointError(f"{where}: a piece of {name!r} names file "
                                             f"{piece.get('file')!r}, which 'files' does not list")
            if piece.get("start") != pos or not piece.get("end", -1) > pos:
                raise CorruptCheckpointError(f"{where}: the pieces of {name!r} do not tile "
                                             f"its {numel} elements (gap or overlap at {pos})")
            pos = piece["end"]
        if pos != numel:
            raise CorruptCheckpointError(f"{where}: the pieces of {name!r} cover {pos} of its "
                                         f"{numel} elements")


def check_file_name(name: str, where: str) -> None:
    """A manifest names files inside the checkpoint folder only: a plain file name, no
    separators, no ``..``, not absolute."""
    bad = (not isinstance(name, str) or not name or name in (".", "..")
           or "/" in name or "\\" in name or os.sep in name or (os.altsep or "/") in name
           or "\0" in name or os.path.isabs(name))
    if bad:
        raise CorruptCheckpointError(f"{where} names file {name!r}, which is not a plain file "
                                     f"name inside the checkpoint folder: refused")


def resolve(folder: str, name: str) -> str:
    """The path of manifest file ``name`` in ``folder``, refusing anything that resolves
    outside it (a symlink planted in the folder included)."""
    check_file_name(name, os.path.join(folder, MANIFEST))
    path = os.path.join(folder, name)
    real_folder = os.path.realpath(folder)
    if os.path.dirname(os.path.realpath(path)) != real_folder:
        raise CorruptCheckpointError(f"{path} resolves outside the checkpoint folder "
                                     f"({os.path.realpath(path)}): refused")
    return path
