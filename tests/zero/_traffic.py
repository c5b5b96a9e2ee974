"""The battery's ``traffic_memory`` check (``_battery.py``) for a rung on the device, stages
1-3 in fp32 or bf16: bytes sent per step (volume meter) and held per rank (allocated storages)
against the ring formula and docs/design.md#the-ladder. Run on every rank (module-level so spawned
ranks can import it); and :func:`hybrid_traffic_memory`, which hybrid rows run in their
``parity``.

Exact against the padded layout; within 1% of the unpadded formula (padding is at most
align*(tensors+N) elements per bucket or unit) and of docs/design.md#by-kind.
"""
from __future__ import annotations

import torch.distributed as dist

import zkernels as zk
from tests.zero._harness import MICRO_BATCH, chunk, make_batches, make_model
from zkernels.zero.planning.state_format import state_bytes

RING_BUCKET = 2 ** 16   # stages 1-2: bucket bytes large enough for the 1% padding bound


def traffic_memory(rank, ws, *, row):
    """``row`` (no offload, no hybrid sharding) after 3 steps."""
    from tests.zero._battery import row_model, row_optimizer  # (the battery imports this)
    assert row.offload is None and row.shard_size is None and row.dtype in ("fp32", "bf16")
    model = row_model(row)
    psi = sum(p.numel() for p in model.parameters())  # the tied weight once
    opt = row_optimizer(row, model, None,
                        **({} if row.stage == 3 else {"bucket_bytes": RING_BUCKET}))
    for batch in make_batches(3, ws * MICRO_BATCH):
        model(*chunk(batch, rank)).backward()
        opt.step()
        opt.zero_grad()
    st = opt.stats()
    pel = 2 if row.param_dtype is not None else 4
    rel = 4
    padded = sum(u.layout.padded_numel for u in opt.units)
    shard = sum(u.layout.shard_numel for u in opt.units)
    comm = st["comm_bytes"]
    # Stage 3 gathers in forward and again in backward (once without resharding).
    gathers = 1 if row.stage < 3 or row.reshard is False else 2
    assert comm["reduce_scatter"] == padded * rel * (ws - 1) // ws, comm
    assert comm["all_gather"] == gathers * padded * pel * (ws - 1) // ws, comm
    # A 4-byte all-reduce per step: the non-finite check (clip.py's Note), metered apart from
    # the 2 Psi / 3 Psi, which count reduce-scatter and all-gather only; stage 3 adds a path
    # check (16 bytes, [Note: divergent paths]) per gather and one as step() begins.
    checks = gathers * len(opt.units) + 1 if row.stage == 3 and ws > 1 else 0
    # The ranks agree on which parameters have a gradient: one byte each ([Note: unused
    # parameters] in zkernels/zero/gradients/presence.py).
    mask = opt.reducer.presence.nbytes * 2 * (ws - 1) // ws
    assert opt.reducer.presence.nbytes == sum(len(u.params) for u in opt.units)
    assert comm["all_reduce"] == (checks * 16 + 4) * 2 * (ws - 1) // ws + mask, comm
    moved = comm["reduce_scatter"] + comm["all_gather"]
    assert comm["total"] == moved + comm["all_reduce"], comm
    ideal = psi * (rel + gathers * pel) * (ws - 1) / ws
    assert ws == 1 and moved == 0 or abs(moved - ideal) <= 0.01 * ideal, (comm, ideal)
    if row.stage == 3:
        _stage3_memory(opt, st, psi, ws, row, padded, shard, pel, rel)
    else:
        _stage12_memory(opt, st, psi, ws, row, padded, shard, pel, rel)


def _stage12_memory(opt, st, psi, ws, row, padded, shard, pel, rel) -> None:
    mem = st["memory_bytes"]
    biggest = max(u.layout.padded_numel for u in opt.units)
    mixed = row.param_dtype is not None
    pooled = row.stage == 2 or mixed  # stage 1 casts through the pool
    expected = {"params": padded * pel,
                "grads": padded * pel if row.stage == 1 else shard * 4,
                "master": shard * 4 if mixed else 0,
                "optimizer_states": shard * 8,
                "buffers": 2 * biggest * rel if pooled else 0}
    expected["total"] = sum(expected.values())
    assert mem == expected, (mem, expected)
    # docs/design.md#by-kind: fp32 stage 1 4+4+8/N, stage 2 4+12/N; bf16 stage 1 2+2+12/N,
    # stage 2 2+(4+12)/N (our grad shard is fp32, the reduce dtype), bucket buffers aside.
    if not mixed:
        design = psi * (8 + 8 / ws) if row.stage == 1 else psi * (4 + 12 / ws)
    else:
        design = psi * (4 + 12 / ws) if row.stage == 1 else psi * (2 + 16 / ws)
    held = mem["total"] - mem["buffers"]
    assert abs(held - design) <= 0.01 * design, (held, design)


def _stage3_memory(opt, st, psi, ws, row, padded, shard, pel, rel) -> None:
    """One all-gather per flat unit per direction; params held between steps = this rank's
    shards (nothing gathered); every kind exact against the layout, the total within 2% of
    16Ψ/N (fp32, docs/design.md#pure-fp32) beside the reduce buffers; peak gathered bytes under
    the prefetch bound (all of them without resharding)."""
    g = st["gather"]
    gathers = 1 if row.reshard is False else 2
    assert g["all_gathers"] == gathers * len(opt.units), g
    assert g["gathered_bytes"] == 0, g
    biggest = max(u.nbytes for u in opt.schedule.units[:-1])
    assert g["limit_bytes"] == opt.schedule.root.nbytes + 2 * biggest
    if row.reshard is False:
        assert g["peak_gathered_bytes"] == padded * pel, g
    else:
        assert 0 < g["peak_gathered_bytes"] <= g["limit_bytes"], g
    mem = st["memory_bytes"]
    # Between steps: the shards and nothing else (the reduce buffers live only while
    # gradients are in flight: [Note: transient reduce buffers]).
    expected = {"params": shard * pel, "grads": shard * 4,
                "master": shard * 4 if row.param_dtype is not None else 0,
                "optimizer_states": shard * 8, "buffers": 0}
    expected["total"] = sum(expected.values())
    assert mem == expected, (mem, expected)
    assert opt.reducer.held_buffers() == []
    design = psi * (16 if row.param_dtype is None else 18) / ws  # bf16: 2 + 4 (fp32 grad) + 12
    assert abs(mem["total"] - design) <= 0.02 * design, (mem["total"], design)
    # The step's peak: the two unit-sized reduce buffers and the gathered units beside it.
    peak = st["step_peak_bytes"]
    buffers = 2 * max(u.layout.padded_numel for u in opt.units) * rel
    assert peak == {"buffers": buffers, "gathered_params": g["peak_gathered_bytes"],
                    "total": mem["total"] + buffers + g["peak_gathered_bytes"]}, peak


def hybrid_traffic_memory(opt, ws, stage, offload, K, state=None, row=None):
    """A hybrid row (``shard_size=K``), called from its parity: the last step's bytes, exact
    against the layouts, and bytes held: the formula with N replaced by K (the layouts are
    over K ranks). A whole-matrix row (``row.optim``): its bytes only (:func:`_matrix_hybrid`).
    """
    if row is not None and row.optim.startswith(("muon", "adafactor")):
        return _matrix_hybrid(opt, ws, row)
    g = ws // K
    padded = sum(u.layout.padded_numel for u in opt.units)
    shard = sum(u.layout.shard_numel for u in opt.units)
    assert all(u.layout.world_size == K for u in opt.units), "layouts are over the group"
    assert padded == K * shard
    assert opt.comm.rank == dist.get_rank() % K and opt.comm.replica_rank == dist.get_rank() // K
    comm = opt.stats()["comm_bytes"]
    rs = padded * 4 * (K - 1) // K                   # fp32 reduce-scatter within the group
    gathers = 2 if stage == 3 else 1                 # stage 3 gathers in forward and backward
    pb = opt.param_dtype.itemsize                    # gathered in the compute dtype
    ag = gathers * padded * pb * (K - 1) // K
    # The cross-group all-reduce of each reduced shard (ring: 2 x bytes x (G-1)/G, per bucket).
    across = sum(2 * u.layout.shard_numel * 4 * (g - 1) // g for u in opt.units)
    # Within the group: the 4-byte norm/flag all-reduce and, at stage 3, the 16-byte path
    # checks (one per gather and one as step() begins).
    checks = gathers * len(opt.units) + 1 if stage == 3 else 0
    # And the per-parameter gradient mask over all ranks ([Note: unused parameters]).
    ws = dist.get_world_size()
    small = (checks * 16 + 4) * 2 * (K - 1) // K + \
        opt.reducer.presence.nbytes * 2 * (ws - 1) // ws
    assert comm["reduce_scatter"] == rs, comm
    assert comm["all_gather"] == ag, comm
    assert comm["across_groups"] == across, (comm, across)
    assert comm["within_group"] == rs + ag + small, comm
    assert comm["all_reduce"] == across + small, comm
    assert comm["total"] == comm["within_group"] + comm["across_groups"], comm
    mem = opt.stats()["memory_bytes"]
    fmt = opt.state_formats[0]   # (state: the row's state_dtype, one group)
    spec = opt.optimizer_specs[0]   # (the fused AdamW's bytes, or the group's rule's per element)
    per = spec.state_bytes("fp32" if fmt is None else fmt.name) if not spec.fused else None
    assert mem["optimizer_states"] == sum(
        state_bytes(u.layout.shard_numel, fmt) if per is None else per * u.layout.shard_numel
        for u in opt.units), mem
    assert (fmt is None) == (state is None)
    assert mem["params"] == pb * (shard if stage == 3 else padded), mem
    assert mem["grads"] == (4 * padded if stage == 1 else 4 * shard), mem
    # The master apart from the parameter shard unless it is that shard ([Note: bf16 master]).
    mdt = opt.shard_update.master_dtype
    assert mem["master"] == (0 if mdt == opt.param_dtype and not offload
                             else mdt.itemsize * shard), mem
    if stage == 3:  # between steps: the formula with N -> K and nothing else (no reduce buffer)
        assert mem["buffers"] == 0, mem
        assert mem["total"] == sum(mem[k] for k in ("params", "grads", "master",
                                                     "optimizer_states")), mem
    kw = dict(offload=offload, state_dtype=state, param_dtype=opt.param_dtype,
              master_dtype=mdt, optimizer=spec)
    est = zk.estimate_memory(make_model(), ws, stage, shard_size=K, **kw)
    plain = zk.estimate_memory(make_model(), K, stage, **kw)
    for kind in ("params_bytes", "grads_bytes", "master_bytes", "optimizer_states_bytes"):
        assert getattr(est, kind) == getattr(plain, kind), kind
    assert abs(est.comm_across_groups_bytes - across) <= 0.02 * across + 8, (est, across)


def _matrix_hybrid(opt, ws, row):
    """A hybrid Muon / Adafactor row's last step: the reduce-scatter within the group, the
    all-gather of the compute dtype and the cross-group all-reduce as any hybrid row's, plus
    the owners' two exchanges within the group, each half of ``estimate_memory(...,
    param_groups=)``'s ``comm_matrix_bytes`` ([Note: the matrix exchanges in the estimate]):
    exact."""
    from tests.zero._battery import matrix_groups, row_model
    K = row.shard_size
    g = ws // K
    model = row_model(row)   # (the same shapes, whole)
    est = zk.estimate_memory(model, ws, row.stage, shard_size=K, param_dtype=row.param_dtype,
                             param_groups=matrix_groups(model, row.optim),
                             **({} if row.stage == 3 else {"bucket_bytes": row.optimizer_kw(
                                 None)["bucket_bytes"]}))
    extra = est.comm_matrix_bytes
    assert extra > 0 and extra % 2 == 0, est
    padded = sum(u.layout.padded_numel for u in opt.units)
    pel = 2 if row.param_dtype is not None else 4
    gathers = 2 if row.stage == 3 else 1
    comm = opt.stats()["comm_bytes"]
    rs = padded * 4 * (K - 1) // K + extra // 2
    ag = gathers * padded * pel * (K - 1) // K + extra // 2
    across = sum(2 * u.layout.shard_numel * 4 * (g - 1) // g for u in opt.units)
    assert comm["reduce_scatter"] == rs, (comm, rs)
    assert comm["all_gather"] == ag, (comm, ag)
    assert comm["across_groups"] == across, (comm, across)
    assert comm["within_group"] == comm["total"] - across, comm
