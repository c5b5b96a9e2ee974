"""``save(opt, path)``: every rank writes its own pieces; rank 0 publishes the folder atomically.

[Note: atomic checkpoint publish]
A checkpoint is the folder ``PATH`` with its ``manifest.json``; nothing else ever appears at
``PATH``. A save runs in three phases, each closed by :func:`~._collective.agree` (a
barrier that also says which ranks failed):

1. rank 0 recovers from any earlier interrupted save (below), refuses to replace a ``PATH``
   that is not a checkpoint, and creates the empty temporary folder ``PATH.zk-tmp``;
2. every rank streams its pieces into ``PATH.zk-tmp/shard-RRRRR-of-NNNNN.safetensors``
   (rank 0 also ``model.safetensors``), fsyncs it, and writes a small JSON index of it;
3. rank 0 merges the indices into ``manifest.json`` (checking that the pieces tile every
   parameter), fsyncs it, then renames: ``PATH`` -> ``PATH.zk-old`` (if there is one),
   ``PATH.zk-tmp`` -> ``PATH``, fsyncs the parent folder, deletes ``PATH.zk-old``.

A rank killed in phase 1 or 2 leaves ``PATH`` untouched and a ``PATH.zk-tmp`` without a
manifest, which the next save deletes. Renames within one folder are atomic (POSIX), so a crash
in phase 3 leaves either the old checkpoint at ``PATH``, or the new one there (and perhaps
``PATH.zk-old``, deleted by the next save), or, between the two renames, no ``PATH`` and the
old checkpoint whole at ``PATH.zk-old``: ``load`` falls back to it and the next save moves it
back first. At no moment is a half-written folder at ``PATH``.

All ranks must see one filesystem at ``PATH`` (a shared filesystem across nodes).

With hybrid sharding (``shard_size=K``) the shard files are numbered within the shard group
(``shard-RRRRR-of-KKKKK``) and written by the first replica only, so each shard is written
once; rank 0 of the world prepares, writes the model file and publishes, and every rank of
the world takes part in each phase's agreement.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

import torch

from . import _codec, manifest
from ._atomic import TMP_SUFFIX, prepare, publish, write_bytes
from ._collective import agree
from ._tensorfile import TensorFileWriter, dtype_name
from ._view import OptimizerView
from .errors import CheckpointError, SaveAbortedError

_MODEL_INDEX = "model-index.json"   # the leader's model.safetensors index, until the merge


def _index_file(rank: int, world_size: int) -> str:
    return manifest.shard_file(rank, world_size).replace(".safetensors", ".json")


def save(opt, path: str, model_extra: Any = None, *, fsync: bool = True) -> None:
    """Write a checkpoint of ``opt`` (and its model) to the folder ``path``. Collective.

    Each rank writes only its own pieces: per trainable parameter, the element range of its
    shard, with the fp32 master values and both AdamW moments (see [Note: the checkpoint
    adapter]), and at stage 3 the values of its frozen parameters' shards ([Note: frozen
    pieces]); rank 0 also writes the buffers and the frozen parameters of stages 1-2, the
    step counters, the loss scaler, the hyper-parameters of every param group and
    ``model_extra``. The folder
    appears at ``path`` only once every rank has finished, replacing any previous checkpoint
    there (see [Note: atomic checkpoint publish]). It loads at any world size and stage.

    Args:
        opt: a ``zkernels.ZeroOptimizer``.
        path: the checkpoint folder (created; an existing checkpoint there is replaced).
        model_extra: anything else to keep, returned by :func:`load`: numbers, strings,
            lists, tuples, dicts and tensors (e.g. ``{"sched": sched.state_dict(), "step":
            step, "rng": torch.get_rng_state()}``); taken from rank 0.
        fsync: flush every file to stable storage before publishing (leave True unless the
            filesystem is scratch).

    Raises:
        SaveAbortedError: a rank failed or died; the previous checkpoint at ``path`` is intact.
        CheckpointError: ``path`` exists and is not a checkpoint.
        TypeError: ``model_extra`` or a hyper-parameter holds something that is not storable.
    """
    view = OptimizerView(opt)
    path = os.path.abspath(os.fspath(path))
    tmp = path + TMP_SUFFIX
    intact = f"the previous checkpoint at {path} (if any) is intact"
    error: Optional[BaseException] = None
    state = None
    if view.leads:
        try:
            state = _model_state(view, model_extra)   # refuse what cannot be stored first
            prepare(path, _is_checkpoint, f"{path} exists and is not a zkernels checkpoint "
                                          f"(no {manifest.MANIFEST}): refusing to replace it")
        except BaseException as exc:  # noqa: BLE001 - reported to every rank by agree()
            error = exc
    agree(view, error, f"preparing {tmp}", intact, SaveAbortedError)

    error = None
    try:
        # Hybrid sharding: one replica writes the shards (view.writes_shards), the leader
        # the model file (its index goes beside the shards' as a file of its own).
        if view.writes_shards:
            index = _write_shard(view, tmp, fsync)
            _write_json(os.path.join(tmp, _index_file(view.rank, view.world_size)), index,
                        fsync)
        if view.leads:
            _write_json(os.path.join(tmp, _MODEL_INDEX),
                        {"model": _write_model(view, tmp, state, fsync)}, fsync)
    except BaseException as exc:  # noqa: BLE001
        error = exc
    agree(view, error, f"writing the shards of {path}", intact, SaveAbortedError)

    error = None
    if view.leads:
        try:
            body = manifest.dumps(_merge(view, tmp))
            write_bytes(os.path.join(tmp, manifest.MANIFEST), body, fsync)
            for r in range(view.world_size):
                os.remove(os.path.join(tmp, _index_file(r, view.world_size)))
            os.remove(os.path.join(tmp, _MODEL_INDEX))
            publish(path, fsync)
        except BaseException as exc:  # noqa: BLE001
            error = exc
    agree(view, error, f"publishing {path}", intact, SaveAbortedError)


def _is_checkpoint(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, manifest.MANIFEST))






def _write_json(path: str, obj: Any, fsync: bool) -> None:
    write_bytes(path, json.dumps(obj).encode(), fsync)




def _key(field: str, name: str, start: int) -> str:
    return f"{field}/{name}/{start}"


def _write_shard(view: OptimizerView, tmp: str, fsync: bool) -> Dict[str, Any]:
    """Stream this rank's pieces into its shard file; return its index."""
    ranges = view.piece_ranges()
    entries = [(_key(f, name, start), dtype, (numel,))
               for name, start, end, _, fields in ranges
               for f, dtype, numel in view.field_specs(name, start, end, fields)]
    # Stage 3's frozen pieces: their values only, in the shard's dtype ([Note: frozen pieces]).
    entries += [(_key("master", name, start), dtype, (end - start,))
                for name, start, end, dtype in view.frozen_piece_ranges()]
    fname = manifest.shard_file(view.rank, view.world_size)
    writer = TensorFileWriter(os.path.join(tmp, fname), entries,
                              {"format": manifest.FORMAT, "rank": str(view.rank),
                               "world_size": str(view.world_size)})
    try:
        pieces = []
        for piece in view.pieces(as_trained=True):
            for f in piece.tensors:
                writer.write(_key(f, piece.name, piece.start), piece.tensors[f])
            entry = {"name": piece.name, "start": piece.start, "end": piece.end,
                     "step": piece.step,
                     **{f: list(writer.offsets[_key(f, piece.name, piece.start)])
                        for f in piece.tensors}}
            if piece.scalars is not None:   # a torch class ([Note: a torch class's pieces])
                entry.update(fields=list(piece.tensors), scalars=piece.scalars)
            if piece.state_format is not None:   # [Note: low-bit moments in a checkpoint]
                entry.update(fields=list(piece.tensors), state_format=piece.state_format,
                             dtypes={f: dtype_name(t.dtype) for f, t in piece.tensors.items()})
            pieces.append(entry)
        for fp in view.frozen_pieces():
            key = _key("master", fp.name, fp.start)
            writer.write(key, fp.tensor)
            pieces.append({"name": fp.name, "start": fp.start, "end": fp.end, "step": 0,
                           "master": list(writer.offsets[key])})
    except BaseException:
        writer.abort()
        raise
    return {"file": fname, "entry": writer.close(fsync), "pieces": pieces}


def _model_state(view: OptimizerView, model_extra: Any):
    """Rank 0: ``model_extra`` and the hyper-parameters as JSON, and every tensor that goes
    into ``model.safetensors`` (theirs, the frozen parameters and the buffers)."""
    tensors: Dict[str, torch.Tensor] = {}
    extra = _codec.encode(model_extra, tensors, "model_extra")
    groups = [_codec.encode(h, tensors, f"param_groups[{i}]")
              for i, h in enumerate(view.hparams())]
    for e in view.model_entries():
        if e.tensor is not None:
            tensors[f"model/{e.key}"] = e.tensor
    return extra, groups, tensors


def _write_model(view: OptimizerView, tmp: str, state, fsync: bool) -> Dict[str, Any]:
    """Rank 0: ``model.safetensors``, once."""
    extra, groups, tensors = state
    writer = TensorFileWriter(os.path.join(tmp, manifest.MODEL_FILE),
                              [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()],
                              {"format": manifest.FORMAT})
    try:
        for k, t in tensors.items():
            writer.write(k, t)
    except BaseException:
        writer.abort()
        raise
    return {"entry": writer.close(fsync), "extra": extra, "param_groups": groups,
            "tensors": {k: {"file": manifest.MODEL_FILE, "dtype": dtype_name(t.dtype),
                            "shape": list(t.shape), "offsets": list(writer.offsets[k])}
                        for k, t in tensors.items()}}


def _merge(view: OptimizerView, tmp: str) -> Dict[str, Any]:
    """Rank 0: the manifest, from every rank's index."""
    files: Dict[str, Any] = {}
    params = {name: {"shape": list(p.shape), "dtype": "F32", "group": p.group, "pieces": []}
              for name, p in view.params.items()}
    for name, fz in view.frozen.items():  # [Note: frozen pieces]
        params[name] = {"shape": list(fz.shape), "dtype": dtype_name(fz.dtype), "group": None,
                        "frozen": True, "pieces": []}
    for r in range(view.world_size):
        with open(os.path.join(tmp, _index_file(r, view.world_size))) as f:
            index = json.load(f)
        files[index["file"]] = index["entry"]
        for piece in index["pieces"]:
            params[piece.pop("name")]["pieces"].append(dict(piece, file=index["file"]))
    with open(os.path.join(tmp, _MODEL_INDEX)) as f:
        model_index = json.load(f)["model"]
    files[manifest.MODEL_FILE] = model_index["entry"]
    for p in params.values():
        p["pieces"].sort(key=lambda q: q["start"])
    tensors = model_index["tensors"]
    model: List[Dict[str, Any]] = []
    for e in view.model_entries():
        if e.tensor is not None:
            model.append({"key": e.key, "kind": e.kind, **tensors.pop(f"model/{e.key}")})
        else:
            model.append({"key": e.key, "kind": e.kind, "of": e.of})
    m = {"format": manifest.FORMAT, "format_version": manifest.FORMAT_VERSION,
         "zkernels_version": _version(), "torch_version": torch.__version__,
         "saved_with": view.describe(), "files": files, "params": params, "model": model,
         "param_groups": [dict({"hparams": h, "params": names},
                               **({} if o == "adamw" else {"optimizer": o}))
                          for h, names, o in zip(model_index["param_groups"],
                                                 view.group_names, view.optimizers)],
         "optimizer": view.scalars(), "extra": model_index["extra"],
         "extra_tensors": tensors}
    try:
        manifest._check_structure(m, "the manifest being written")
    except CheckpointError as exc:  # the adapter's pieces do not tile a parameter: a bug
        raise RuntimeError(f"zkernels bug: {exc}") from None
    return m




def _version() -> str:
    from .. import __version__
    return __version__
