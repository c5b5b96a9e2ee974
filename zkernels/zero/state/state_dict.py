"""Optimizer state_dict / load_state_dict for one rank's shards (same world size and layout).

The state is self-contained: each unit's fp32 master shard is saved too (in pure fp32 it is
this rank's slice of the parameters), so loading restores the parameters exactly even in
mixed precision, where the model's own state_dict holds only the rounded compute copy. The
tensors come from the update strategy's ShardStates (``opt.shard_update.states``), the layout
from the units (``opt.units``); the key "buckets" of the fingerprint is kept for format
stability. At stage 3 the frozen parameters exist only as shards (``opt.frozen_units``, see
[Note: frozen parameters at stage 3] in ``units.py``), so their shards are saved too
(``"frozen"``), in the dtype they are kept in.
"""
from __future__ import annotations

from typing import Any, Dict

import torch


def _fingerprint(opt) -> list:
    return [list(u.layout.numels) for u in opt.units]


def state_dict(opt) -> Dict[str, Any]:
    """A snapshot (tensors are cloned) of ``opt``'s per-rank state.

    Returns:
        ``{"state": {unit_index: {"step", "master", "exp_avg", "exp_avg_sq"}},
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
    for st in opt.shard_update.states:
        # Through the strategy: NVMe offload reads its moments (and master) from disk.
        master, exp_avg, exp_avg_sq = opt.shard_update.state_tensors(st.unit_index)
        state[st.unit_index] = {"step": st.step, "master": master.detach().clone(),
                                "exp_avg": exp_avg.detach().clone(),
                                "exp_avg_sq": exp_avg_sq.detach().clone()}
    zero = {"world_size": opt.comm.world_size, "rank": opt.comm.rank, "stage": opt.stage,
            "param_dtype": str(opt.precision.param_dtype), "buckets": _fingerprint(opt),
            "num_steps": opt._num_steps, "overflow_skips": opt._overflow_skips,
            "loss_scaler": opt.scaler.state_dict() if opt.scaler is not None else None}
    out = {"state": state, "param_groups": groups, "zero": zero}
    frozen_units = getattr(opt, "frozen_units", ())
    if frozen_units:
        out["frozen"] = {u.index: u.compute_shard.detach().clone() for u in frozen_units}
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
    if zero["world_size"] != opt.comm.world_size:
        raise ValueError(f"state_dict was saved with world size {zero['world_size']} but this "
                         f"optimizer runs on {opt.comm.world_size} ranks (use "
                         f"zkernels.checkpoint to change world size)")
    if zero["buckets"] != _fingerprint(opt):
        raise ValueError("state_dict was saved for a different bucket layout (model, "
                         "param_groups, bucket_bytes or dtypes differ)")
    if len(sd["param_groups"]) != len(opt.param_groups):
        raise ValueError(f"state_dict has {len(sd['param_groups'])} param groups, this "
                         f"optimizer {len(opt.param_groups)}")
    if (zero["loss_scaler"] is None) != (opt.scaler is None):
        raise ValueError("state_dict and optimizer disagree on loss scaling (param_dtype)")
    frozen_units = list(getattr(opt, "frozen_units", ()))
    frozen = sd.get("frozen", {})
    saved = [(i, t.numel(), t.dtype) for i, t in sorted(frozen.items())]
    if (frozen or frozen_units) and saved != \
            [(u.index, u.layout.shard_numel, u.compute_dtype) for u in frozen_units]:
        raise ValueError("state_dict's frozen parameter shards do not match this optimizer's "
                         "(model, units or param_dtype differ)")
    for g, saved in zip(opt.param_groups, sd["param_groups"]):
        g.update({k: v for k, v in saved.items() if k != "params"})
    with torch.no_grad():
        handles = []
        for u in opt.units:
            s = sd["state"][u.index]
            opt.shard_update.load_state(u, s["step"], s["master"], s["exp_avg"],
                                        s["exp_avg_sq"])
            handles.append(u.gather.publish(opt.comm))
        for u in frozen_units if frozen else ():  # stage 3: the frozen shards, then re-gather
            u.compute_shard.copy_(frozen[u.index])
            handles.append(u.gather.publish(opt.comm))
        for h in handles:
            h.wait()
    opt._num_steps = int(zero["num_steps"])
    opt._overflow_skips = int(zero["overflow_skips"])
    if opt.scaler is not None:
        opt.scaler.load_state_dict(zero["loss_scaler"])
