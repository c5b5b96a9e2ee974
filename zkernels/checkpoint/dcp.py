"""``import_dcp`` / ``export_dcp``: FSDP2's ``torch.distributed.checkpoint`` folders, both ways.

[Note: the DCP layout of an FSDP2 run]
An FSDP2 (``fully_shard``) run with ``torch.optim.AdamW`` checkpoints as
``dcp.save({"model": msd, "optim": osd}, checkpoint_id=dir)`` with
``msd, osd = get_state_dict(model, optimizer)``. DCP flattens the nested dict; torch 2.13
writes, keyed by ``fqn`` (the name in ``model.named_parameters()``):

- ``model.FQN``: each parameter's full value (FSDP2's sharded fp32 parameter, a DTensor
  saved as one chunk of rows per FSDP2 rank), and every buffer whole;
- ``optim.state.FQN.exp_avg`` / ``.exp_avg_sq``: the moments, chunked like the parameter;
  ``optim.state.FQN.step``: AdamW's step count, a 0-dim float32 tensor;
- ``optim.param_groups.G.KEY`` for each key of AdamW's group ``G`` (``lr``, ``betas``,
  ``eps``, ``weight_decay``, ``amsgrad``, ... and ``params``: the group's fqns), each a
  bytes item (a ``torch.save``'d value);
- ``.metadata``: every key's global shape, dtype and saved chunks (offsets, sizes), where
  each chunk lies in the ``__R_0.distcp`` files, and the flat key -> path map.

With ``MixedPrecisionPolicy(param_dtype=bf16)`` FSDP2 still keeps (and saves) the sharded
parameters in fp32, so ``model.FQN`` is the fp32 master on both sides: a bf16 zkernels run
imports it into its masters exactly and exports its masters.

[Note: what a rank of import_dcp reads]
Each rank reads only what its own pieces need, alone (``dcp.load(..., no_dist=True)``: no
collective until the final agreement): for each piece and field, one box of whole rows (along
dim 0) covering the piece (at most two rows more), which DCP fills from the saved chunks that
overlap it. DCP's ``FileSystemReader`` deserializes a saved chunk whole before narrowing it,
so a rank's transient memory is its pieces (the optimizer's own tensors) plus one box plus
one saved chunk (an FSDP2 rank's rows of one parameter) at a time; the bytes it reads are
those chunks. Buffers and frozen parameters are read whole, one at a time.

[Note: what export_dcp writes]
Every rank offers its pieces to DCP's save as boxes: a range of a flattened parameter is at
most ``2 * ndim - 1`` boxes, each contiguous, so each box is a view of the piece (DCP copies
the boxes as it serializes them: one at a time from host memory, within its copy-ahead, 10
MB per thread by default, from a GPU); DCP's planner checks that the chunks of all ranks
tile every tensor and writes ``.metadata``. With hybrid sharding the first replica offers
the pieces (each once), every rank takes part. The rank holding a parameter's first element
writes its step; rank 0 writes buffers, frozen parameters (stages 1-2) and the param groups,
with every key torch's ``AdamW`` has (so FSDP2's ``get_state_dict`` of an ``AdamW`` finds
each key it asks for), plus plain keys of ours such as a scheduler's ``initial_lr``. Tied
aliases get a ``model`` entry too. It writes into ``DIR.zk-tmp``; after every rank is done,
rank 0 renames it to ``DIR`` (an existing DCP folder there is replaced: ``DIR`` ->
``DIR.zk-old`` -> deleted), so a crash never leaves a half-written folder at ``DIR``.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from ._atomic import TMP_SUFFIX, prepare, publish
from ._collective import agree
from ._dcp_io import BoxSavePlanner, SafeReader, boxes, covering_box, read
from ._import import HPARAMS, Source, fill
from ._view import FIELDS, OptimizerView
from .errors import (CheckpointError, IncompatibleCheckpointError, NotACheckpointError,
                     SaveAbortedError)

_METADATA = ".metadata"


def _is_dcp(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, _METADATA))


def _flat(path: Tuple) -> str:
    return ".".join(str(p) for p in path)


def import_dcp(opt, dcp_dir: str, *, model_key: str = "model",
               optim_key: str = "optim") -> Dict[str, Any]:
    """Start ``opt`` (any world size, stage, offload) from an FSDP2 DCP checkpoint.
    Collective.

    Restores the fp32 master of every trainable parameter from ``model.FQN``, both AdamW
    moments and each parameter's step from ``optim.state.FQN`` (a parameter AdamW never
    stepped, without state there, starts fresh: zero moments, step 0), the groups' ``lr``,
    ``betas``, ``eps`` and ``weight_decay``, buffers and frozen parameters, and sets the
    optimizer's step counter to the largest step; see [Note: the DCP layout of an FSDP2 run]
    and, for what each rank reads, [Note: what a rank of import_dcp reads].

    Args:
        opt: a ``zkernels.ZeroOptimizer`` over the same model (its values are overwritten).
        dcp_dir: the folder ``dcp.save`` wrote.
        model_key, optim_key: the top-level keys the model and optimizer state dicts were
            saved under (``dcp.save({"model": msd, "optim": osd})``).

    Returns:
        ``{"num_steps", "param_groups"}``: the step counter now set, and the checkpoint's
        groups as saved (without ``params``). An LR scheduler's state is not part of
        ``get_state_dict``'s output: restore it as the FSDP2 script saved it.

    Raises:
        NotACheckpointError: ``dcp_dir`` is no folder, or has no ``.metadata``.
        UnsafeCheckpointError: ``.metadata`` names a global outside the allow-list.
        IncompatibleCheckpointError: no optimizer state under ``optim_key``, names, shapes
            or param groups differ from the model's.
        CheckpointError: a key a parameter needs is missing, or not a tensor.
    """
    folder = os.path.abspath(os.fspath(dcp_dir))
    if not os.path.isdir(folder):
        raise NotACheckpointError(f"dcp_dir {folder}: no such folder")
    if not os.path.isfile(os.path.join(folder, _METADATA)):
        raise NotACheckpointError(f"dcp_dir {folder}: no {_METADATA} file: not a "
                                  f"torch.distributed.checkpoint folder")
    reader = SafeReader(folder)
    md = reader.read_metadata()
    entries = md.state_dict_metadata
    paths = {tuple(p): k for k, p in (md.planner_data or {}).items()}
    if not paths:
        raise CheckpointError(f"dcp_dir {folder}: its .metadata maps no key to a path (saved "
                              f"without DCP's flatten_state_dict?): not the layout "
                              f"dcp.save(get_state_dict(...)) writes")
    tops = sorted({p[0] for p in paths})
    state = {p[2] for p in paths if p[:2] == (optim_key, "state") and len(p) == 4}
    if not state:
        raise IncompatibleCheckpointError(
            f"dcp_dir {folder} holds no optimizer state under {optim_key!r} (top-level keys: "
            f"{tops}): save with dcp.save({{'{model_key}': msd, '{optim_key}': osd}}) where "
            f"msd, osd = get_state_dict(model, optimizer), or pass optim_key=")

    def key(*path) -> str:
        k = paths.get(path)
        if k is None:
            raise CheckpointError(f"dcp_dir {folder}: no {_flat(path)!r}")
        return k

    def tensor_md(k: str) -> TensorStorageMetadata:
        m = entries.get(k)
        if not isinstance(m, TensorStorageMetadata):
            raise CheckpointError(f"dcp_dir {folder}: {k!r} is not a tensor")
        return m

    keys = {}
    shapes = {}
    for name in sorted(state):
        keys[(name, "master")] = key(model_key, name)
        for f in ("exp_avg", "exp_avg_sq"):
            keys[(name, f)] = key(optim_key, "state", name, f)
        sizes = {f: tuple(tensor_md(keys[(name, f)]).size) for f in FIELDS}
        if len(set(sizes.values())) != 1:
            raise CheckpointError(f"dcp_dir {folder}: {name}'s value and moments differ in "
                                  f"shape: {sizes}")
        shapes[name] = sizes["master"]
    step_keys = {n: key(optim_key, "state", n, "step") for n in shapes}
    steps = _read_steps(reader, entries, step_keys)
    groups = _read_groups(reader, entries, paths, optim_key)
    view = OptimizerView(opt)
    _check_groups(view, groups, folder)
    # A parameter torch's AdamW never stepped (no gradient yet) has no state: it starts
    # fresh here too (moments zero, step 0) from its value under ``model``.
    fresh = {n for n in view.params if n not in state and (model_key, n) in paths}
    for n in fresh:
        keys[(n, "master")] = paths[(model_key, n)]
        shapes[n], steps[n] = tuple(tensor_md(keys[(n, "master")]).size), 0

    def read_range(name, field, start, end, out):
        if name in fresh and field != "master":
            out.zero_()
            return
        k = keys[(name, field)]
        box = covering_box(shapes[name], start, end)
        if box[2] == start and box[3] == end:   # the range is the box: DCP fills ``out``
            read(reader, [(k, box, out.view(box[1]))])
            return
        buf = torch.empty(box[1], dtype=torch.float32)
        read(reader, [(k, box, buf)])
        out.copy_(buf.reshape(-1)[start - box[2]:end - box[2]])

    cache: Dict[str, Optional[torch.Tensor]] = {}

    def tensors(state_key: str) -> Optional[torch.Tensor]:
        k = paths.get((model_key, state_key))
        m = entries.get(k) if k is not None else None
        if not isinstance(m, TensorStorageMetadata):
            return None
        if state_key not in cache:
            cache.clear()           # one whole tensor at a time
            t = torch.empty(tuple(m.size), dtype=m.properties.dtype)
            read(reader, [(k, (((0,) * len(m.size)), tuple(m.size), 0, t.numel()), t)])
            cache[state_key] = t
        return cache[state_key]

    num_steps = max(steps.values(), default=0)
    src = Source(folder, shapes, read_range, steps,
                 [{k: g[k] for k in HPARAMS if k in g} for g in groups], num_steps, 0,
                 tensors, lambda k: isinstance(entries.get(paths.get((model_key, k), "")),
                                               TensorStorageMetadata))
    fill(opt, src)
    return {"num_steps": num_steps,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in groups]}


def _read_steps(reader, entries, step_keys: Dict[str, str]) -> Dict[str, int]:
    """Each parameter's AdamW step: a 0-dim tensor (a number, as bytes, in older torch)."""
    zero = {n: torch.zeros((), dtype=torch.float64) for n in step_keys}
    tensors, byte_keys = [], []
    for n, k in step_keys.items():
        m = entries[k]
        if isinstance(m, BytesStorageMetadata):
            byte_keys.append(k)
        elif tuple(m.size) != ():
            raise CheckpointError(f"{k!r}: a step count of shape {tuple(m.size)}, expected a "
                                  f"0-dim tensor")
        else:
            tensors.append((k, ((), (), 0, 1), zero[n]))
    values = read(reader, tensors, byte_keys)
    return {n: int(float(values[k]) if k in values else zero[n].item())
            for n, k in step_keys.items()}


def _read_groups(reader, entries, paths, optim_key: str) -> List[Dict[str, Any]]:
    """The saved param groups: ``[{key: value}]`` in group order."""
    by_group: Dict[int, Dict[str, str]] = {}
    for p, k in paths.items():
        if p[:2] == (optim_key, "param_groups") and len(p) == 4 and \
                isinstance(entries.get(k), BytesStorageMetadata):
            by_group.setdefault(int(p[2]), {})[str(p[3])] = k
    if sorted(by_group) != list(range(len(by_group))):
        raise CheckpointError(f"the checkpoint's param groups are numbered {sorted(by_group)}")
    values = read(reader, [], [k for g in by_group.values() for k in g.values()])
    return [{name: values[k] for name, k in by_group[g].items()} for g in sorted(by_group)]


def _check_groups(view: OptimizerView, groups: List[Dict[str, Any]], folder: str) -> None:
    if len(groups) != len(view.group_names):
        raise IncompatibleCheckpointError(
            f"dcp_dir {folder} has {len(groups)} param groups, the optimizer "
            f"{len(view.group_names)}")
    for g, (saved, ours) in enumerate(zip(groups, view.group_names)):
        # Flags of torch's AdamW whose update is not ours (amsgrad keeps a third moment).
        other = {k: saved[k] for k in ("amsgrad", "maximize") if saved.get(k)}
        if saved.get("decoupled_weight_decay") is False and saved.get("weight_decay"):
            other["decoupled_weight_decay"] = False    # torch.optim.Adam's L2 penalty
        if other:
            raise IncompatibleCheckpointError(
                f"dcp_dir {folder}: param group {g} was trained with {other}: zkernels runs "
                f"AdamW without them")
        if "params" in saved and set(saved["params"]) != set(ours):
            raise IncompatibleCheckpointError(
                f"dcp_dir {folder}: param group {g} holds {sorted(saved['params'])[:5]}, "
                f"the optimizer's {sorted(ours)[:5]}")


def export_dcp(opt, dcp_dir: str, *, model_key: str = "model",
               optim_key: str = "optim") -> None:
    """Write ``opt``'s state as the DCP folder an FSDP2 run with ``torch.optim.AdamW``
    loads: ``dcp.load({"model": msd, "optim": osd}, checkpoint_id=dcp_dir)`` with ``msd, osd
    = get_state_dict(model, optimizer)``, then ``set_state_dict``. Any world size and stage
    here and there. Collective. See [Note: what export_dcp writes].

    Raises:
        IncompatibleCheckpointError: a param group runs another optimizer than AdamW.
        CheckpointError: ``dcp_dir`` exists and is not a DCP folder.
        SaveAbortedError: a rank failed; ``dcp_dir`` is as it was.
    """
    view = OptimizerView(opt)
    for g, name in enumerate(view.optimizers):
        if name != "adamw":
            raise IncompatibleCheckpointError(
                f"param group {g} runs {name!r}: export_dcp writes AdamW's state only")
    path = os.path.abspath(os.fspath(dcp_dir))
    tmp = path + TMP_SUFFIX
    intact = f"{path} is as it was"
    error: Optional[BaseException] = None
    if view.leads:
        try:
            prepare(path, _is_dcp, f"dcp_dir {path} exists and is not a DCP folder (no "
                                   f"{_METADATA}): refusing to replace it")
        except BaseException as exc:  # noqa: BLE001 - reported to every rank by agree()
            error = exc
    agree(view, error, f"preparing {tmp}", intact, SaveAbortedError)
    error = None
    try:
        tensors, values, mappings = _offer(view, model_key, optim_key)
        group, no_dist = _process_group(view)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.save({}, storage_writer=dcp.FileSystemWriter(tmp),
                     planner=BoxSavePlanner(tensors, values, mappings),
                     process_group=group, no_dist=no_dist)
    except BaseException as exc:  # noqa: BLE001
        error = exc
    agree(view, error, f"writing {tmp}", intact, SaveAbortedError)
    error = None
    if view.leads:
        try:
            publish(path, fsync=True)
        except BaseException as exc:  # noqa: BLE001
            error = exc
    agree(view, error, f"publishing {path}", intact, SaveAbortedError)




def _process_group(view: OptimizerView):
    """``(process group, no_dist)`` for DCP's save: the group of every rank."""
    comm = view.everyone
    if not (dist.is_available() and dist.is_initialized()):
        if comm.world_size != 1:
            raise CheckpointError("export_dcp needs torch.distributed initialized")
        return None, True
    group = getattr(comm, "group", None)    # TorchComm: None is the default group
    if dist.get_world_size(group) != comm.world_size:
        raise CheckpointError(f"export_dcp: the optimizer runs on {comm.world_size} ranks, "
                              f"its process group has {dist.get_world_size(group)}")
    return group, False


def _adamw_group(saved: Dict[str, Any]) -> Dict[str, Any]:
    """Every key of torch's AdamW group, ours where we have it (plain values only)."""
    ref = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]).param_groups[0]
    out = {k: v for k, v in ref.items() if k != "params"}
    for k, v in saved.items():
        if isinstance(v, (bool, int, float, str, type(None))) or (
                isinstance(v, (tuple, list)) and all(isinstance(x, (int, float)) for x in v)):
            out[k] = tuple(v) if isinstance(v, list) else v
    return out


def _offer(view: OptimizerView, model_key: str, optim_key: str):
    """This rank's boxes and values for :class:`BoxSavePlanner`, and the flat key map."""
    tensors: Dict[Tuple[str, Tuple[int, ...]], Tuple[Tuple[int, ...], torch.Tensor]] = {}
    values: Dict[str, Any] = {}
    mappings: Dict[str, Tuple] = {}

    def flat(*path) -> str:
        k = _flat(path)
        mappings[k] = path
        return k

    def offer(k: str, shape, start: int, t: torch.Tensor, end: int) -> None:
        for offsets, sizes, a, b in boxes(shape, start, end):
            tensors[(k, offsets)] = (tuple(shape), t[a - start:b - start].view(sizes))

    entries = view.model_entries()
    aliases: Dict[str, List[str]] = {}
    for e in entries:       # a tied parameter's keys (stage 3's frozen ones too)
        if e.kind == "param":
            aliases.setdefault(e.of, []).append(e.key)
    if view.writes_shards:
        for piece in view.pieces():
            shape = view.params[piece.name].shape
            for f in FIELDS:
                names = aliases.get(piece.name, [piece.name]) if f == "master" else [None]
                for alias in names:
                    k = flat(model_key, alias) if f == "master" else \
                        flat(optim_key, "state", piece.name, f)
                    offer(k, shape, piece.start, piece.tensors[f], piece.end)
            if piece.start == 0:
                k = flat(optim_key, "state", piece.name, "step")
                tensors[(k, ())] = ((), torch.tensor(float(piece.step)))
        for fp in view.frozen_pieces():
            for alias in aliases.get(fp.name, [fp.name]):
                offer(flat(model_key, alias), view.frozen[fp.name].shape, fp.start,
                      fp.tensor.clone(), fp.end)
    if view.leads:
        whole = {e.key: e.tensor.contiguous() for e in entries if e.tensor is not None}
        for e in entries:     # buffers, frozen parameters (stages 1-2), their aliases
            t = whole.get(e.key if e.kind != "alias" else e.of)
            if t is not None:
                tensors[(flat(model_key, e.key), (0,) * t.dim())] = (tuple(t.shape), t)
        for g, (hp, names) in enumerate(zip(view.hparams(), view.group_names)):
            group = dict(_adamw_group(hp), params=list(names))
            for k, v in group.items():
                values[flat(optim_key, "param_groups", g, k)] = v
    return tensors, values, mappings
