"""Optimizer state_dict / load_state_dict for one rank's shards (same world size and layout).

The state is self-contained: each unit's fp32 master shard is saved too (in pure fp32 it is
this rank's slice of the parameters), so loading restores the parameters exactly even in
mixed precision, where the model's own state_dict holds only the rounded compute copy. It
reads and writes the optimizer through the declared view (``CheckpointSource`` in
``zkernels/zero/checkpoint_view.py``): the units (``opt.units``: layout and index) and each
unit's state (``opt.zero_units[u.index]``: ``read_state`` / ``write_state``); the key
"buckets" of the fingerprint is kept for format stability. At stage 3 the frozen parameters
exist only as shards (``opt.frozen_units``, see [Note: frozen parameters at stage 3] in
``units.py``), so their shards are saved too (``"frozen"``), in the dtype they are kept in.
"""
from __future__ import annotations

import logging
from typing import Any, Dict

import torch

from ..planning.optimizer_spec import MATRIX
from .lowbit_state import fp32_moments


def _fingerprint(opt) -> list:
    return [list(u.layout.numels) for u in opt.units]


# [Note: the state_dict of a torch class]
# With the fused AdamW in every group the format is the one above, unchanged. Where a group
# runs a torch.optim class (issue 26) the state follows the class's torch format: "state" is
# keyed by parameter index (the order of param_groups' "params"), each entry that class's
# state keys for this rank's piece of the parameter (1-D, elements ``zero["pieces"][index]``
# of the flattened parameter; a fused AdamW group's entries have "exp_avg", "exp_avg_sq" and
# "step"); "param_groups" carry the class's hyperparameters. "zero" adds each group's
# optimizer ("optimizers") and the fp32 master shards by unit ("masters"). A parameter no
# element of which lives on this rank has no entry. A whole-matrix class's parameter (Muon,
# Adafactor: [Note: whole matrices on owners]) has its class's own entry, whole, on its owner
# only ("owned": its indices; "pieces" [0, numel]). Loading one optimizer's state into
# another is refused by name.


# [Note: low-bit state in a state_dict]
# A unit whose moments are low-bit (``state_dtype``) saves them as trained: "exp_avg" and
# "exp_avg_sq" are its bf16 tensors or int8 / uint8 codes, int8 adds "exp_avg_scales" and
# "exp_avg_sq_scales" (fp32, one per block of the shard), and "state_format" says which
# (``{"dtype": "bf16" | "int8", "block_size": n}``, int8 with the ``"code"`` of its map; one
# without it holds an earlier version's linear codes, read as such and converted as another
# format is, [Note: low-bit moments in a checkpoint]). Loading into the same format copies
# them (a resume continues bit for bit); into another (fp32 <-> bf16 <-> int8, or another
# block size) the moments are dequantized to fp32 and stored in this optimizer's format (fp32,
# rounded to bf16, or requantized), and a WARNING on the "zkernels.zero" logger names the
# units and the conversion.
LOWBIT_KEYS = ("exp_avg", "exp_avg_sq", "exp_avg_scales", "exp_avg_sq_scales")
_log = logging.getLogger("zkernels.zero")


def _name(desc) -> str:
    if desc is None or desc["dtype"] != "int8":
        return "fp32" if desc is None else desc["dtype"]
    code = desc.get("code", "linear")
    return f"int8/{desc['block_size']}" + ("" if code == "float8" else f" ({code} codes)")


def _optimizers(opt) -> list:
    return list(opt.optimizer_names)


def _param_index(opt) -> Dict[str, int]:
    """Parameter name (its first in ``named_parameters()``, as the units name it) -> index."""
    names = {id(p): n for n, p in opt.module.named_parameters()}
    return {names[id(p)]: i for i, p in enumerate(p for g in opt.param_groups
                                                  for p in g["params"])}


def _pieces_state(opt) -> Dict[str, Any]:
    index, state, pieces, masters, owned = _param_index(opt), {}, {}, {}, []
    for u in opt.units:
        z = opt.zero_units[u.index]
        if _matrix(opt, u):
            whole = z.read_owned_state()
            masters[u.index] = z.read_state()[1][0].detach().clone()
            for name, st in whole.items():
                k = index[name]
                state[k], pieces[k] = st, [0, int(u.layout.numels[u.names.index(name)])]
                owned.append(k)
            continue
        step, master, states = z.read_rule_state()
        masters[u.index] = master.detach().clone()
        for (name, a, _, n), st in zip(u.param_slices_in_shard(), states):
            k = index[name]
            entry = {key: v.detach().clone() if isinstance(v, torch.Tensor) else v
                     for key, v in st.items()}
            entry.setdefault("step", torch.tensor(float(step)))
            state[k] = entry
            pieces[k] = [a, a + n]
    return {"state": state, "pieces": pieces, "masters": masters, "owned": owned}


def _matrix(opt, unit) -> bool:
    """A whole-matrix class's unit (its name in ``optimizer_spec.MATRIX``)."""
    return opt.optimizer_names[unit.group_index] in {c.__name__ for c in MATRIX}


def state_dict(opt) -> Dict[str, Any]:
    """A snapshot (tensors are cloned) of ``opt``'s per-rank state.

    Returns:
        ``{"state": {unit_index: {"step", "param_steps", "master", "exp_avg",
        "exp_avg_sq"}},
        "param_groups": [torch-style groups with parameter indices], "zero": {...}}``, and
        at stage 3 with frozen parameters ``"frozen": {frozen unit index: this rank's
        shard}``.
    """
    index = 0
    groups = []
    for g in opt.param_groups:
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": list(range(index, index + len(g["params"])))})
        index += len(g["params"])
    if any(n != "adamw" for n in _optimizers(opt)):   # [Note: the state_dict of a torch class]
        got = _pieces_state(opt)
        comm = opt.checkpoint_comm
        zero = {"world_size": comm.world_size, "rank": comm.rank, "stage": opt.stage,
                "param_dtype": str(opt.param_dtype), "buckets": _fingerprint(opt),
                "optimizers": _optimizers(opt), "pieces": got["pieces"],
                "masters": got["masters"], "owned": got["owned"],
                "steps": {u.index: opt.zero_units[u.index].state_step for u in opt.units},
                **opt.counters()}
        out = {"state": got["state"], "param_groups": groups, "zero": zero}
        _add_frozen(opt, out)
        return out
    state = {}
    for u in opt.units:
        z = opt.zero_units[u.index]
        # NVMe offload reads its moments (and master) from disk.
        step, (master, exp_avg, exp_avg_sq) = z.read_state()
        state[u.index] = {"step": step, "param_steps": z.param_steps,
                          "master": master.detach().clone(),
                          "exp_avg": exp_avg.detach().clone(),
                          "exp_avg_sq": exp_avg_sq.detach().clone()}
        low = z.read_lowbit_state()
        if low is not None:   # [Note: low-bit state in a state_dict]
            state[u.index].update({k: v.detach().clone() for k, v in low.items()},
                                  state_format=z.state_format)
    comm = opt.checkpoint_comm
    zero = {"world_size": comm.world_size, "rank": comm.rank, "stage": opt.stage,
            "param_dtype": str(opt.param_dtype), "buckets": _fingerprint(opt),
            **opt.counters()}
    out = {"state": state, "param_groups": groups, "zero": zero}
    _add_frozen(opt, out)
    return out


def _add_frozen(opt, out: Dict[str, Any]) -> None:
    if opt.frozen_units:
        out["frozen"] = {}
        for u in opt.frozen_units:
            with u.shard_values() as shard:
                out["frozen"][u.index] = shard.detach().clone()


def load_state_dict(opt, sd: Dict[str, Any]) -> None:
    """Restore ``sd`` (from :func:`state_dict` on the same rank of a same-sized world) into
    ``opt`` and rebuild the parameters from the master shards. Collective: every rank calls it.

    Raises:
        ValueError: ``sd`` is malformed or was saved with another world size, bucket layout
            (model, param_groups, bucket_bytes, dtypes) or number of param groups.
    """
    if not isinstance(sd, dict) or not {"state", "param_groups", "zero"} <= set(sd):
        raise ValueError("state_dict must be a dict from ZeroOptimizer.state_dict() with keys "
                         "'state', 'param_groups' and 'zero'")
    zero = sd["zero"]
    saved_opts = zero.get("optimizers", ["adamw"] * len(sd["param_groups"]))
    here = _optimizers(opt)
    for gi, (a, b) in enumerate(zip(saved_opts, here)):
        if a != b:
            raise ValueError(f"state_dict holds {a} state for param_groups[{gi}] but this "
                             f"optimizer runs {b} there: one optimizer's state does not load "
                             f"into another")
    world_size = opt.checkpoint_comm.world_size
    if zero["world_size"] != world_size:
        raise ValueError(f"state_dict was saved with world size {zero['world_size']} but this "
                         f"optimizer runs on {world_size} ranks (use "
                         f"zkernels.checkpoint to change world size)")
    if zero["buckets"] != _fingerprint(opt):
        raise ValueError("state_dict was saved for a different bucket layout (model, "
                         "param_groups, bucket_bytes or dtypes differ)")
    for u in opt.units if "optimizers" not in zero else ():
        got = sd["state"][u.index]["master"].numel()
        if got != u.layout.shard_numel:
            raise ValueError(
                f"state_dict's unit {u.index} shard holds {got} elements, this optimizer's "
                f"{u.layout.shard_numel}: the layouts' alignment differs (state_dtype='int8' "
                f"starts every parameter at a multiple of state_block_size); convert "
                f"through zkernels.checkpoint (save, then load), which maps each parameter")
    if len(sd["param_groups"]) != len(opt.param_groups):
        raise ValueError(f"state_dict has {len(sd['param_groups'])} param groups, this "
                         f"optimizer {len(opt.param_groups)}")
    if (zero["loss_scaler"] is None) != (opt.counters()["loss_scaler"] is None):
        raise ValueError("state_dict and optimizer disagree on loss scaling (param_dtype)")
    frozen_units = list(opt.frozen_units)
    frozen = sd.get("frozen", {})
    saved = [(i, t.numel(), t.dtype) for i, t in sorted(frozen.items())]
    if (frozen or frozen_units) and saved != \
            [(u.index, u.layout.shard_numel, u.compute_dtype) for u in frozen_units]:
        raise ValueError("state_dict's frozen parameter shards do not match this optimizer's "
                         "(model, units or param_dtype differ)")
    for g, saved in zip(opt.param_groups, sd["param_groups"]):
        g.update({k: v for k, v in saved.items() if k != "params"})
    converted = []
    with torch.no_grad():
        if "optimizers" in zero:   # [Note: the state_dict of a torch class]
            index = _param_index(opt)
            for u in opt.units:
                z = opt.zero_units[u.index]
                if _matrix(opt, u):
                    z.write_owned_state(zero["steps"][u.index], zero["masters"][u.index],
                                        {n: sd["state"][index[n]] for n in u.names
                                         if index[n] in sd["state"]})
                    continue
                states = [{k: v for k, v in sd["state"][index[name]].items()
                           if not (k == "step" and opt.optimizer_names[u.group_index]
                                   == "adamw")}
                          for name, _, _, _ in u.param_slices_in_shard()]
                z.write_rule_state(zero["steps"][u.index], zero["masters"][u.index], states)
        for u in opt.units if "optimizers" not in zero else ():
            s, z = sd["state"][u.index], opt.zero_units[u.index]
            saved, here = s.get("state_format"), z.state_format
            exp_avg, exp_avg_sq = fp32_moments(saved, s)
            # (a state saved before per-parameter counts has one "step" for the unit)
            z.write_state(s["step"], s["master"], exp_avg, exp_avg_sq, s.get("param_steps"))
            if here is not None and saved == here:
                z.write_lowbit_state({k: s[k] for k in LOWBIT_KEYS if k in s})
            elif saved != here:
                converted.append((u.index, saved, here))
        for u in frozen_units if frozen else ():  # stage 3: the frozen shards
            with u.shard_values(write_back=True) as shard:
                shard.copy_(frozen[u.index])
        opt.publish(list(opt.units) + (frozen_units if frozen else []))
    if converted:
        _log.warning("load_state_dict: converted the AdamW moments of units %s: %s",
                     [i for i, _, _ in converted], "; ".join(sorted({
                         f"{_name(a)} -> {_name(b)}" for _, a, b in converted})))
    opt.load_counters(zero)
