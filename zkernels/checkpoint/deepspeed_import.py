"""``import_deepspeed(opt, dir, tag=None)``: start from a DeepSpeed ZeRO 1, 2 or 3 checkpoint.

[Note: DeepSpeed's ZeRO checkpoint layout]
``dir/latest`` names the tag (``global_stepN``); ``dir/TAG`` holds, for a data-parallel world
of N ranks without tensor parallelism (``mp_rank_00`` only):

- the model states: ``mp_rank_00_model_states.pt`` (stages 1-2; the full 16/32-bit module
  state_dict under ``module``) or ``zero_pp_rank_R_mp_rank_00_model_states.pt`` (stage 3;
  ``module`` holds empty parameters); each also has ``param_shapes`` (per param group, an
  ordered ``{name: shape}``), ``buffer_names``, ``global_steps``, ``skipped_steps``,
  ``lr_scheduler`` (DeepSpeed's scheduler's state_dict) and ``frozen_param_shapes``;
- per rank R, ``zero_pp_rank_R_mp_rank_00_optim_states.pt`` with ``optimizer_state_dict``:
  - stages 1-2: ``single_partition_of_fp32_groups[g]``, rank R's equal slice of param group
    g's flat fp32 buffer, in which the group's parameters lie back to back in
    ``param_shapes[g]`` order (padding at the end); ``base_optimizer_state["state"][g]``
    holds ``exp_avg``/``exp_avg_sq`` of the same slice and ``step``;
  - stage 3: ``fp32_flat_groups[g]``, rank R's part of sub-group g, in which every
    parameter is split on its own: ``ceil(numel / N)`` elements each, rank R holding
    elements ``[R * that, (R + 1) * that)``, parameters back to back; the parameters of all
    sub-groups run on in ``param_shapes`` order (as ``zero_to_fp32.py`` concatenates
    them); ``optimizer_state_dict["state"][g]`` holds the moments of the same layout.

These are the rules ``zero_to_fp32.py`` of DeepSpeed 0.19 consolidates by; the tests check
our reading against its output. Each ``.pt`` file is opened memory-mapped, so a rank reads
the pages its pieces touch. What the files pickle beyond tensors is in [Note: what a
DeepSpeed checkpoint pickles] (``_safe_pickle.py``).
"""
from __future__ import annotations

import math
import os
import re
from typing import Any, Dict, List, Optional, Tuple

import torch

from ._import import Source, fill
from ._safe_pickle import load_pt
from .errors import CheckpointError, IncompatibleCheckpointError, NotACheckpointError

_OPTIM = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def resolve_tag(ds_dir: str, tag: Optional[str]) -> str:
    """The folder of tag ``tag`` (or of the one ``ds_dir/latest`` names)."""
    ds_dir = os.fspath(ds_dir)
    if tag is None:
        latest = os.path.join(ds_dir, "latest")
        if not os.path.isfile(latest):
            raise NotACheckpointError(f"{ds_dir}: no 'latest' file: pass tag= (the "
                                      f"global_stepN folder to import)")
        with open(latest) as f:
            tag = f.read().strip()
    folder = os.path.join(ds_dir, str(tag))
    if not os.path.isdir(folder):
        raise NotACheckpointError(f"{ds_dir}: no checkpoint folder for tag {tag!r}")
    return folder


def import_deepspeed(opt, ds_checkpoint_dir: str, tag: Optional[str] = None) -> Dict[str, Any]:
    """Start ``opt`` (any world size and stage) from a DeepSpeed ZeRO 1-3 checkpoint.
    Collective.

    Restores the fp32 master of every trainable parameter, both Adam moments, the step
    counts, the groups' ``lr``/``betas``/``eps``/``weight_decay``, the global step counter,
    and (stages 1-2) buffers and frozen parameters; see [Note: DeepSpeed's ZeRO checkpoint
    layout]. The ``.pt`` files are read with ``torch.load(weights_only=True)`` and the
    allow-list of [Note: what a DeepSpeed checkpoint pickles]; nothing else is unpickled.

    Returns:
        ``{"global_steps", "skipped_steps", "lr_scheduler", "ds_config", "tag"}``:
        ``lr_scheduler`` is DeepSpeed's scheduler state (``{"last_batch_iteration": i}``;
        for the ``LambdaLR`` that ``zkernels.integrations.deepspeed.build_scheduler``
        builds, set ``last_epoch = i + 1``, or load it with ``load_state_dict``), and
        ``ds_config`` the config DeepSpeed saved.

    Raises:
        NotACheckpointError: no ``latest`` file (and no ``tag``), or no such tag folder.
        UnsafeCheckpointError: a file needs a type outside the allow-list (named).
        IncompatibleCheckpointError: names, shapes or group counts differ from the model's,
            or the checkpoint is tensor/pipeline parallel (``mp_rank_01``...).
        CheckpointError: a file is missing or not laid out as DeepSpeed 0.19 writes it.
    """
    folder = resolve_tag(ds_checkpoint_dir, tag)
    optim: Dict[int, str] = {}
    for f in os.listdir(folder):
        m = _OPTIM.match(f)
        if m:
            if int(m.group(2)) != 0:
                raise IncompatibleCheckpointError(
                    f"{folder}: {f} is model-parallel rank {int(m.group(2))}: only "
                    f"data-parallel (mp_rank_00) DeepSpeed checkpoints are imported")
            optim[int(m.group(1))] = os.path.join(folder, f)
    world = len(optim)
    if world == 0 or sorted(optim) != list(range(world)):
        raise CheckpointError(f"{folder}: expected zero_pp_rank_R_mp_rank_00_optim_states.pt "
                              f"for R = 0..N-1, found ranks {sorted(optim)}")
    files = [load_pt(optim[r]) for r in range(world)]
    osds = [f["optimizer_state_dict"] for f in files]
    stage = int(osds[0]["zero_stage"])
    model_file = os.path.join(folder, "mp_rank_00_model_states.pt" if stage < 3 else
                              "zero_pp_rank_0_mp_rank_00_model_states.pt")
    if not os.path.isfile(model_file):
        raise CheckpointError(f"{folder}: no {os.path.basename(model_file)} (a ZeRO-{stage} "
                              f"checkpoint writes one)")
    ms = load_pt(model_file)
    groups_shapes: List[Dict[str, Tuple[int, ...]]] = [
        {n: tuple(s) for n, s in g.items()} for g in ms["param_shapes"]]
    if stage < 3:
        src = _stage12(folder, osds, groups_shapes, world)
    else:
        src = _stage3(folder, osds, groups_shapes, world)
        if ms.get("frozen_param_shapes"):
            raise IncompatibleCheckpointError(
                f"{folder}: a ZeRO-3 checkpoint with frozen parameters "
                f"{list(ms['frozen_param_shapes'])[:5]}: their shards are not imported")
    module = ms["module"]

    def tensors(key: str) -> Optional[torch.Tensor]:
        t = module.get(key)
        return None if t is None or (stage == 3 and key not in ms.get("buffer_names", ())) \
            else t
    src.tensors = tensors
    src.num_steps = int(ms["global_steps"])
    src.skipped = int(ms.get("skipped_steps", 0))
    fill(opt, src)
    return {"global_steps": src.num_steps, "skipped_steps": src.skipped,
            "lr_scheduler": ms.get("lr_scheduler"), "ds_config": files[0].get("ds_config"),
            "tag": os.path.basename(folder)}


def _step(state: dict, where: str) -> int:
    s = state.get("step")
    if s is None:
        raise CheckpointError(f"{where}: no Adam state (was the run a step in?)")
    return int(s.item() if isinstance(s, torch.Tensor) else s)


def _groups(param_groups: List[dict]) -> List[dict]:
    return [{k: g[k] for k in ("lr", "betas", "eps", "weight_decay") if k in g}
            for g in param_groups]


def _reader(layout: Dict[str, Any], fields: Dict[str, List[torch.Tensor]], chunk: int):
    """``read`` over ranks' equal slices of one flat buffer: ``layout[name] = (global
    offset, per-rank part size)``; element e of the flat buffer is at rank ``e // chunk``."""
    def read(name, field, start, end, out):
        parts = fields[field]
        off = layout[name]
        e = off + start
        while e < off + end:
            r, i = divmod(e, chunk)
            n = min(chunk - i, off + end - e)
            out[e - off - start:e - off - start + n].copy_(parts[r][i:i + n])
            e += n
    return read


def _stage12(folder, osds, groups_shapes, world) -> Source:
    shapes, steps, group_reads = {}, {}, []
    for g, gshapes in enumerate(groups_shapes):
        parts = [o["single_partition_of_fp32_groups"][g] for o in osds]
        states = [o["base_optimizer_state"]["state"][g] for o in osds]
        chunk = parts[0].numel()
        if any(p.numel() != chunk for p in parts):
            raise CheckpointError(f"{folder}: the ranks' fp32 partitions of group {g} differ "
                                  f"in size")
        pads = [x for o in osds for x in o.get("param_alignment_paddings", [[0]])[g]]
        if any(pads):
            raise CheckpointError(f"{folder}: group {g} has parameter alignment padding "
                                  f"{pads}: this layout is not imported")
        off = 0
        glayout = {}
        for n, s in gshapes.items():
            shapes[n] = s
            steps[n] = _step(states[0], f"{folder} group {g}")
            glayout[n] = off
            off += math.prod(s)
        if off > chunk * world:
            raise CheckpointError(f"{folder}: group {g}'s parameters hold {off} elements, its "
                                  f"partitions {chunk * world}")
        gf = {"master": parts, "exp_avg": [s["exp_avg"] for s in states],
              "exp_avg_sq": [s["exp_avg_sq"] for s in states]}
        group_reads.append((glayout, _reader(glayout, gf, chunk)))
    by_name = {n: rd for gl, rd in group_reads for n in gl}

    def read(name, field, start, end, out):
        by_name[name](name, field, start, end, out)
    return Source(folder, shapes, read, steps,
                  _groups(osds[0]["base_optimizer_state"]["param_groups"]), 0, 0,
                  lambda k: None)


def _stage3(folder, osds, groups_shapes, world) -> Source:
    def cat(key):
        return [torch.cat(list(v)) for v in key]
    master = cat([o["fp32_flat_groups"] for o in osds])
    inner = [o["optimizer_state_dict"] for o in osds]
    nsub = len(osds[0]["fp32_flat_groups"])
    fields = {"master": master}
    for f in ("exp_avg", "exp_avg_sq"):
        fields[f] = [torch.cat([s["state"][k][f] for k in range(nsub)]) for s in inner]
    counts = {_step(inner[0]["state"][k], f"{folder} sub-group {k}") for k in range(nsub)}
    if len(counts) != 1:
        raise CheckpointError(f"{folder}: sub-groups record step counts {sorted(counts)}")
    step = counts.pop()
    shapes, layout = {}, {}
    off = 0
    for gshapes in groups_shapes:
        for n, s in gshapes.items():
            part = math.ceil(math.prod(s) / world)
            shapes[n], layout[n] = s, (off, part)
            off += part
    if any(m.numel() < off for m in master):
        raise CheckpointError(f"{folder}: a rank's fp32 partition holds fewer than the "
                              f"{off} elements its parameters' shapes need")

    def read(name, field, start, end, out):
        base, part = layout[name]
        parts = fields[field]
        e = start
        while e < end:
            r, i = divmod(e, part)
            n = min(part - i, end - e)
            out[e - start:e - start + n].copy_(parts[r][base + i:base + i + n])
            e += n
    return Source(folder, shapes, read, {n: step for n in shapes},
                  _groups(inner[0]["param_groups"]), 0, 0, lambda k: None)
