"""Filling a ``ZeroOptimizer`` from a peer's checkpoint, piece by piece (any world size, stage).

A peer's reader (``deepspeed_import.py``) describes its checkpoint as a :class:`Source`:
the full shape of every trainable parameter by name, a function that reads elements
``[start, end)`` of one field (``master``, ``exp_avg``, ``exp_avg_sq``) of one flattened
parameter, the AdamW step count of each, the hyper-parameters of its param groups, and the
model's other tensors (buffers, frozen parameters) whole. :func:`fill` then does what
``load`` does for our own format, through the same :class:`~._view.OptimizerView`: each rank
reads only the ranges its pieces hold, and the compute parameters are rebuilt from the
masters at the end.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ._collective import agree
from ._view import FIELDS, OptimizerView
from .errors import IncompatibleCheckpointError

# The hyper-parameters a peer's AdamW groups carry that mean the same here.
HPARAMS = ("lr", "betas", "eps", "weight_decay")


@dataclass
class Source:
    """A peer's checkpoint as :func:`fill` reads it.

    Attributes:
        where: the path, for messages.
        shapes: ``{name: full shape}`` of every trainable parameter it holds state for.
        read: ``read(name, field, start, end, out)`` writes elements ``[start, end)`` of the
            flattened field into the 1-D ``out`` (cast as needed).
        steps: ``{name: AdamW step count}``.
        groups: per param group, ``{hparam: value}`` (keys of ``HPARAMS`` it has).
        num_steps: optimizer steps taken (the counter ``opt.counters()`` keeps).
        skipped: steps skipped (overflow).
        tensors: ``tensor(key)``: the full value of a ``state_dict`` key that is not a
            trainable parameter (a buffer, a frozen parameter), or None if it has none.
        has_tensor: ``has_tensor(key)``: whether ``tensors(key)`` has a value, without
            reading it (None: :func:`check` calls ``tensors``).
    """

    where: str
    shapes: Dict[str, Tuple[int, ...]]
    read: Callable[[str, str, int, int, torch.Tensor], None]
    steps: Dict[str, int]
    groups: List[dict]
    num_steps: int
    skipped: int
    tensors: Callable[[str], Optional[torch.Tensor]]
    has_tensor: Optional[Callable[[str], bool]] = None


def check(view: OptimizerView, src: Source) -> None:
    """Every trainable parameter here has state of the same shape there; the group counts
    agree. Raises IncompatibleCheckpointError listing the differences."""
    problems = []
    has = src.has_tensor or (lambda k: src.tensors(k) is not None)
    missing = [n for n in view.params if n not in src.shapes]
    if missing:
        problems.append(f"trainable here, not in the checkpoint: {missing[:5]}")
    extra = [n for n in src.shapes if n not in view.params]
    if extra:
        problems.append(f"in the checkpoint, not trainable here: {extra[:5]}")
    shapes = [f"{n} (checkpoint {src.shapes[n]}, model {p.shape})"
              for n, p in view.params.items() if n in src.shapes
              and tuple(src.shapes[n]) != p.shape]
    if shapes:
        problems.append(f"shapes differ: {shapes[:5]}")
    if len(src.groups) != len(view.group_names):
        problems.append(f"the checkpoint has {len(src.groups)} param groups, the optimizer "
                        f"{len(view.group_names)}")
    for e in view.model_entries():
        if e.tensor is not None and not has(e.key):
            problems.append(f"{e.key}: a buffer or frozen parameter here, not in the "
                            f"checkpoint")
    for n in view.frozen:
        if not has(n):
            problems.append(f"{n}: frozen here, no full value in the checkpoint")
    if problems:
        raise IncompatibleCheckpointError(f"{src.where} does not fit this model: "
                                          + "; ".join(problems))


def fill(opt, src: Source) -> None:
    """Load ``src`` into ``opt`` (collective): masters, both moments and step counts of the
    pieces this rank holds, the groups' hyper-parameters, the counters, buffers and frozen
    parameters; then rebuild the compute parameters."""
    view = OptimizerView(opt)
    check(view, src)
    view.set_steps(src.steps)
    error: Optional[BaseException] = None
    try:
        with torch.no_grad():
            for piece in view.pieces():
                for f in FIELDS:
                    src.read(piece.name, f, piece.start, piece.end, piece.tensors[f])
            for fp in view.frozen_pieces(write=True):
                fp.tensor.copy_(src.tensors(fp.name).reshape(-1)[fp.start:fp.end])
            for e in view.model_entries():
                if e.tensor is not None:
                    value = src.tensors(e.key)
                    if tuple(value.shape) != tuple(e.tensor.shape):
                        raise IncompatibleCheckpointError(
                            f"{src.where}: {e.key} has shape {tuple(value.shape)}, the "
                            f"model {tuple(e.tensor.shape)}")
                    e.tensor.copy_(value)
    except BaseException as exc:  # noqa: BLE001 - every rank must learn of it
        error = exc
    agree(view, error, f"importing {src.where}",
          "the optimizer is partly overwritten: rebuild it before training or retrying")
    for g, saved in zip(opt.param_groups, src.groups):
        for k in HPARAMS:
            if k in saved and k in g:
                g[k] = tuple(saved[k]) if isinstance(g[k], tuple) else saved[k]
    view.set_scalars({"num_steps": src.num_steps, "overflow_skips": src.skipped,
                      "loss_scaler": None})
    view.finish_load()
