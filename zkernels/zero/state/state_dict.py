"""Optimizer state_dict / load_state_dict for one rank's shards (same world size and layout).

The state is self-contained: each unit's fp32 master shard is saved too (in pure fp32 it is
this rank's slice of the parameters), so loading restores the parameters exactly even in
mixed precision, where the model's own state_dict holds only the rounded compute copy. It
reads and writes the optimizer through the declared view (``CheckpointSource`` in
``zkernels/zero/checkpoint_view.py``): the units (``opt.units``: layout and index) and each
unit's state (``read_state`` / ``write_state``); the key "buckets" of the fingerprint is kept
for format stability. At stage 3 the frozen parameters exist only as shards
(``opt.frozen_units``, see [Note: frozen parameters at stage 3] in ``units.py``), so their
shards are saved too (``"frozen"``), in the dtype they are kept in.
"""
from __future__ import annotations

from typing import Any, Dict

import torch


def _fingerprint(opt) -> list:
    return [list(u.layout.numels) for u in opt.units]


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
    state = {}
    for u in opt.units:
        # NVMe offload reads its moments (and master) from disk.
        step, (master, exp_avg, exp_avg_sq) = opt.read_state(u)
        state[u.index] = {"step": step, "param_steps": opt.param_steps(u),
                          "master": master.detach().clone(),
                          "exp_avg": exp_avg.detach().clone(),
                          "exp_avg_sq": exp_avg_sq.detach().clone()}
    comm = opt.checkpoint_comm
    zero = {"world_size": comm.world_size, "rank": comm.rank, "stage": opt.stage,
            "param_dtype": str(opt.param_dtype), "buckets": _fingerprint(opt),
            **opt.counters()}
    out = {"state": state, "param_groups": groups, "zero": zero}
    if opt.frozen_units:
        out["frozen"] = {}
        for u in opt.frozen_units:
            with u.shard_values() as shard:
                out["frozen"][u.index] = shard.detach().clone()
    return out


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
    world_size = opt.checkpoint_comm.world_size
    if zero["world_size"] != world_size:
        raise ValueError(f"state_dict was saved with world size {zero['world_size']} but this "
                         f"optimizer runs on {world_size} ranks (use "
                         f"zkernels.checkpoint to change world size)")
    if zero["buckets"] != _fingerprint(opt):
        raise ValueError("state_dict was saved for a different bucket layout (model, "
                         "param_groups, bucket_bytes or dtypes differ)")
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
    with torch.no_grad():
        for u in opt.units:
            s = sd["state"][u.index]
            # (a state saved before per-parameter counts has one "step" for the unit)
            opt.write_state(u, s["step"], s["master"], s["exp_avg"], s["exp_avg_sq"],
                            s.get("param_steps"))
        for u in frozen_units if frozen else ():  # stage 3: the frozen shards
            with u.shard_values(write_back=True) as shard:
                shard.copy_(frozen[u.index])
        opt.publish(list(opt.units) + (frozen_units if frozen else []))
    opt.load_counters(zero)
