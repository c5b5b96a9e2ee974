"""``load(opt, path)``: restore a checkpoint into an optimizer of any world size and stage.

Each rank asks its optimizer which pieces it holds now (element ranges of named parameters,
:meth:`~._view.OptimizerView.pieces`) and reads, for each, the overlapping parts of the saved
pieces: only those byte ranges (and the checksum blocks around them), from whichever ranks'
files hold them. The saved world size, stage, bucket size and dtypes do not matter; the
parameter names and shapes and the param-group membership do.
"""
from __future__ import annotations

import logging
import math
import os
from typing import Any, Dict, List, Optional

import torch

from . import _codec, manifest
from ._collective import agree
from ._read import CheckpointFiles
from ._tensorfile import dtype_from_name
from ._lowbit import read_lowbit, saved_format
from ._view import FIELDS, OptimizerView
from .errors import CorruptCheckpointError, IncompatibleCheckpointError
from ._atomic import OLD_SUFFIX

_SHOW = 5  # differences listed per kind
_log = logging.getLogger("zkernels.checkpoint")


def open_folder(path: str) -> str:
    """The folder to read for checkpoint ``path``: ``path`` itself, or the previous checkpoint
    a save moved aside and was interrupted before replacing (see [Note: atomic checkpoint
    publish])."""
    path = os.path.abspath(os.fspath(path))
    old = path + OLD_SUFFIX
    if not os.path.lexists(path) and os.path.isfile(os.path.join(old, manifest.MANIFEST)):
        return old
    return path


def load(opt, path: str) -> Any:
    """Restore the checkpoint at ``path`` into ``opt`` and its model. Collective.

    Restores, for every trainable parameter, the fp32 master values and both AdamW moments
    of the elements this rank holds now (whatever world size, stage and layout the checkpoint
    was saved with), the step counts, the hyper-parameters of every param group, the step
    counters and the loss scaler (fp16 to fp16), the frozen parameters (at stage 3 each rank
    reads its shards of them, see [Note: frozen pieces] in ``_view.py``) and buffers; then
    rebuilds the compute parameters (master rounded to ``param_dtype``, all-gathered), so the
    next step is the one the saved run would have taken. Nothing is unpickled.

    Returns:
        the ``model_extra`` given to :func:`~zkernels.checkpoint.save`.

    Raises:
        NotACheckpointError, UnsupportedVersionError, CorruptCheckpointError: see their
            docstrings; raised on every rank (a rank that finds a bad file tells the others).
        IncompatibleCheckpointError: parameter names or shapes, state_dict keys or param
            groups differ from the model's (the first differences are listed), before
            anything is changed.
    """
    view = OptimizerView(opt)
    folder = open_folder(path)
    m = manifest.read(folder)
    steps = check_compatible(view, m, folder)
    view.set_steps(steps)
    error: Optional[BaseException] = None
    extra = groups = None
    try:
        with CheckpointFiles(folder, m) as files, torch.no_grad():
            saved = {n: tuple(p["pieces"][0].get("fields", FIELDS))
                     for n, p in m["params"].items() if p["pieces"]}
            for piece in view.pieces(fields=saved):
                desc = saved_format(m, piece.name) if piece.scalars is None else None
                for f in piece.tensors:
                    if desc is None or f == "master":
                        files.read_param(piece.name, f, piece.start, piece.end,
                                         piece.tensors[f])
                raw = None
                if desc is not None:   # [Note: low-bit moments in a checkpoint]
                    exp_avg, exp_avg_sq, raw = read_lowbit(files, piece.name, piece.start,
                                                           piece.end, desc)
                    piece.tensors["exp_avg"].copy_(exp_avg)
                    piece.tensors["exp_avg_sq"].copy_(exp_avg_sq)
                if piece.scalars is None:
                    view.keep_lowbit(piece, desc, raw)
                if piece.scalars is not None:   # [Note: a torch class's pieces]
                    piece.scalars.update(m["params"][piece.name]["pieces"][0]
                                         .get("scalars", {}))
            for fp in view.frozen_pieces(write=True):
                _read_frozen_piece(m, files, fp)
            _load_model_tensors(view, m, files)
            def tensor(key):
                return files.tensor(m["extra_tensors"][key], f"extra_tensors[{key!r}]")
            extra = _codec.decode(m.get("extra"), tensor, "extra")
            groups = [_codec.decode(g["hparams"], tensor, f"param_groups[{i}]")
                      for i, g in enumerate(m["param_groups"])]
    except BaseException as exc:  # noqa: BLE001 - every rank must learn of it
        error = exc
    agree(view, error, f"loading {folder}",
          "the optimizer is partly overwritten: rebuild it before training or retrying")
    view.set_hparams(groups)
    view.set_scalars(m["optimizer"])
    for saved_as, here in sorted(view.converted):
        _log.warning("zkernels.checkpoint.load: %s holds AdamW moments in %s, this optimizer "
                     "keeps %s: converted through fp32", folder, saved_as, here)
    view.finish_load()
    return extra


def _frozen_source(m: Dict[str, Any], name: str) -> Dict[str, Any]:
    """The saved form of a parameter that is frozen and sharded here: its pieces (frozen or
    trainable when saved: ``params[name]``) or a whole tensor (``model`` kind "frozen")."""
    if name in m["params"]:
        return {"pieces": name, "shape": m["params"][name]["shape"]}
    by_key = {e["key"]: e for e in m["model"]}
    return by_key[name]


def _read_frozen_piece(m: Dict[str, Any], files: CheckpointFiles, piece) -> None:
    """Fill a frozen piece held here ([Note: frozen pieces] in ``_view.py``) from whichever
    form the checkpoint holds it in, cast to the shard's dtype."""
    src = _frozen_source(m, piece.name)
    if "pieces" in src:
        files.read_param(piece.name, "master", piece.start, piece.end, piece.tensor)
        return
    saved = dtype_from_name(src["dtype"], f"model[{piece.name!r}]")
    begin, end = src["offsets"]
    if end - begin != math.prod(src["shape"]) * saved.itemsize:
        raise CorruptCheckpointError(f"model[{piece.name!r}]: its byte range does not match "
                                     f"its shape")
    files.read_into(src["file"], begin + piece.start * saved.itemsize, saved, piece.tensor)


def _load_model_tensors(view: OptimizerView, m: Dict[str, Any], files: CheckpointFiles) -> None:
    saved = {e["key"]: e for e in m["model"]}
    for e in view.model_entries():
        if e.tensor is None:
            continue  # trainable (its pieces) or an alias (the same tensor)
        s = saved[e.key]
        if s["kind"] == "param":   # trainable, or frozen at stage 3, when saved: in full
            numel = e.tensor.numel()
            flat = torch.empty(numel, dtype=e.tensor.dtype)
            files.read_param(s["of"], "master", 0, numel, flat)
            e.tensor.copy_(flat.view(e.tensor.shape))
        else:
            files.tensor(s, f"model[{e.key!r}]", out=e.tensor)


def _listing(kind: str, items: List[str]) -> str:
    more = f" and {len(items) - _SHOW} more" if len(items) > _SHOW else ""
    return f"{kind}: {', '.join(items[:_SHOW])}{more}"


def check_compatible(view: OptimizerView, m: Dict[str, Any], folder: str) -> Dict[str, int]:
    """Check that the checkpoint fits ``view``'s model and groups; return each trainable
    parameter's saved step count.

    Raises:
        IncompatibleCheckpointError: listing the first differences of each kind.
    """
    saved_params = m["params"]
    saved_model = {e["key"]: e for e in m["model"]}
    problems = []
    # A parameter saved as frozen pieces (stage 3) has no optimizer state either.
    missing = [n for n in view.params if n not in saved_params
               or saved_params[n].get("frozen")]
    frozen_then = [n for n in missing if saved_model.get(n, {}).get("kind") in ("frozen",)
                   or n in saved_params]
    missing = [n for n in missing if n not in frozen_then]
    if missing:
        problems.append(_listing("trainable here, missing from the checkpoint", missing))
    if frozen_then:
        problems.append(_listing("trainable here but frozen when saved (no optimizer state)",
                                 frozen_then))
    shapes = [f"{n} (checkpoint {tuple(saved_params[n]['shape'])}, model {view.params[n].shape})"
              for n in view.params if n in saved_params
              and tuple(saved_params[n]["shape"]) != view.params[n].shape]
    if shapes:
        problems.append(_listing("shapes differ", shapes))
    for n, fz in view.frozen.items():  # frozen and sharded here: any saved form, same shape
        src = saved_params.get(n) or saved_model.get(n)
        if src is not None and "shape" in src and tuple(src["shape"]) != fz.shape:
            problems.append(f"{n}: checkpoint shape {tuple(src['shape'])}, model {fz.shape}")
        elif src is not None and src.get("kind") not in (None, "frozen"):
            problems.append(f"{n}: frozen here, saved as a {src.get('kind')} (not a parameter)")
    entries = view.model_entries()
    keys = {e.key for e in entries}
    unexpected = [k for k in saved_model if k not in keys]
    if unexpected:
        problems.append(_listing("in the checkpoint, not in the model", unexpected))
    absent = [e.key for e in entries if e.key not in saved_model and e.key not in missing]
    if absent:
        problems.append(_listing("in the model's state_dict, not in the checkpoint", absent))
    for e in entries:
        s = saved_model.get(e.key)
        if s is None or e.tensor is None or s["kind"] == "alias":
            continue
        shape = tuple(saved_params[s["of"]]["shape"]) if s["kind"] == "param" \
            else tuple(s["shape"])
        if shape != tuple(e.tensor.shape):
            problems.append(f"{e.key}: checkpoint shape {shape}, model {tuple(e.tensor.shape)}")
    saved_opts = [g.get("optimizer", "adamw") for g in m["param_groups"]]
    for i, (a, b) in enumerate(zip(saved_opts, view.optimizers)):
        if a != b:
            problems.append(f"param_groups[{i}] was saved with {a}'s state but runs {b} "
                            f"here: one optimizer's state does not load into another")
    if not problems:
        # Parameters frozen since the save belong to no group now.
        saved_groups = [set(g["params"]) & set(view.params) for g in m["param_groups"]]
        here = [set(g) for g in view.group_names]
        if len(saved_groups) != len(here):
            problems.append(f"the checkpoint has {len(saved_groups)} param groups, the "
                            f"optimizer {len(here)}")
        else:
            for i, (a, b) in enumerate(zip(saved_groups, here)):
                if a != b:
                    problems.append(f"param_groups[{i}] differs: "
                                    f"{_listing('only in the checkpoint', sorted(a - b))}; "
                                    f"{_listing('only here', sorted(b - a))}")
    if problems:
        raise IncompatibleCheckpointError(f"checkpoint {folder} does not fit this model: "
                                          + "; ".join(problems))
    steps = {}
    for name in view.params:
        counts = {p["step"] for p in saved_params[name]["pieces"]}
        if len(counts) != 1 or not all(isinstance(c, int) and c >= 0 for c in counts):
            raise CorruptCheckpointError(f"{folder}: the pieces of {name!r} record step counts "
                                  f"{sorted(counts)}; expected one count")
        steps[name] = counts.pop()
    return steps
