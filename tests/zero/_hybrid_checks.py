"""Hybrid sharding's checks (``shard_size=K`` and the 2-D ``DeviceMesh`` form), run on every
rank of one 4-rank spawn: 2 shard groups of 2 ranks ({0, 1}, {2, 3}), replicated across.

The battery's hybrid rows (``_battery.py``; test_battery.py's ``parity`` asserted on the ranks:
parity with single-process torch.optim.AdamW over the whole world's batch, then ``_traffic.hybrid_traffic_memory`` against the layouts the
optimizer built over K = 2 ranks) run here, beside a checkpoint across shapes, bad
``shard_size`` and stage 3's secondary shards (``reshard_after_forward=2``).
"""
from __future__ import annotations

import os
import tempfile
from functools import partial

import torch
import torch.distributed as dist

import zkernels as zk
from tests.zero import _battery
from tests.zero._battery import BETAS, SMALL_BUCKET, WD
from tests.zero._harness import EPS, LR, chunk, make_batches, make_model, run_checks
from tests.zero.test_battery import parity_on_rank

K = 2                # ranks per shard group


def _mesh(ws, k=K):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (ws // k, k), mesh_dim_names=("replicate", "shard"))


def _opt(model):
    """Hybrid stage 3 over 2 groups of K ranks."""
    return zk.ZeroOptimizer(model, stage=3, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                            shard_size=K)


def _train(model, opt, rank, ws, batches):
    for batch in batches:
        model(*chunk(batch, rank)).backward()
        opt.step()
        opt.zero_grad()


def _states(opt):
    return [t.clone() for st in opt.shard_update.states
            for t in opt.shard_update.state_tensors(st.unit_index)]


def checkpoint_across_shapes(rank, ws):
    """Hybrid 2x2 stage 3 saved after 2 steps, loaded as plain stage 2 on 3 ranks (rank 3
    idle), saved again there, loaded back as hybrid 2x2 stage 3: every parameter and every
    state element comes back bit for bit, and the next step is the one the first run takes.
    Each shard is written once (by the first replica)."""
    batches = make_batches(3, ws * 2, seed=5)
    root = None
    if rank == 0:
        root = tempfile.mkdtemp(prefix="zk-hybrid-ckpt-")
    box = [root]
    dist.broadcast_object_list(box, src=0)
    root = box[0]
    first, second = os.path.join(root, "hybrid"), os.path.join(root, "plain3")
    three = dist.new_group([0, 1, 2])
    model = make_model()
    opt = _opt(model)
    _train(model, opt, rank, ws, batches[:2])
    zk.checkpoint.save(opt, first)
    shard_files = sorted(f for f in os.listdir(first) if f.startswith("shard-"))
    assert shard_files == ["shard-00000-of-00002.safetensors",
                           "shard-00001-of-00002.safetensors"], shard_files
    with opt.gathered():
        saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    states = _states(opt)
    if rank < 3:
        plain = make_model(seed=7)
        popt = zk.ZeroOptimizer(plain, stage=2, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                process_group=three, bucket_bytes=SMALL_BUCKET)
        zk.checkpoint.load(popt, first)
        for n, p in plain.named_parameters():
            assert torch.equal(p, saved[n]), f"{n} differs after loading hybrid into N=3"
        zk.checkpoint.save(popt, second)
        popt.close()
    dist.barrier()
    back = make_model(seed=9)
    bopt = _opt(back)
    zk.checkpoint.load(bopt, second)
    with bopt.gathered():
        for n, p in back.named_parameters():
            assert torch.equal(p, saved[n]), f"{n} differs after the round trip"
    for a, b in zip(states, _states(bopt)):
        assert torch.equal(a, b), "optimizer state differs after the round trip"
    _train(model, opt, rank, ws, batches[2:])
    _train(back, bopt, rank, ws, batches[2:])
    with opt.gathered(), bopt.gathered():
        for (n, p), q in zip(model.named_parameters(), back.parameters()):
            assert torch.equal(p, q), f"{n}: the step after the round trip differs"
    dist.barrier()
    if rank == 0:
        import shutil
        shutil.rmtree(root)


def bad_shard_size(rank, ws):
    """shard_size that does not divide N, < 1, or not an int: errors naming it."""
    import pytest
    for bad, err, match in ((3, ValueError, "shard_size=3 must divide"),
                            (0, ValueError, "shard_size must be >= 1"),
                            (2.0, TypeError, "shard_size must be an int")):
        with pytest.raises(err, match=match):
            zk.ZeroOptimizer(make_model(), stage=2, shard_size=bad)
    with pytest.raises(ValueError, match="disagrees with the mesh"):
        zk.ZeroOptimizer(make_model(), stage=2, mesh=_mesh(ws), shard_size=4)


def secondary_shards(rank, ws, *, steps=3):
    """reshard_after_forward=2 on 4 ranks (plain stage 3; its parity is the battery's row
    ``stage3-fp32-reshard2``): after forward every unit holds a secondary chunk of 1/2 its
    padded size (4 B x padded / 2) and nothing else beyond the shards; the backward gathers
    run over 2 ranks (4 B x padded x 1/2 each) while the forward ones run over 4 (x 3/4);
    between steps nothing extra is held; bad R refused by name."""
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=3, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                           reshard_after_forward=2)
    shard = sum(u.layout.shard_numel for u in opt.units)
    padded = [u.layout.padded_numel for u in opt.units]
    for step, batch in enumerate(make_batches(steps, ws * 2)):
        loss = model(*chunk(batch, rank))
        held = opt.stats()["memory_bytes"]["params"]
        assert held == 4 * shard + sum(4 * p // 2 for p in padded), (step, held)
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert opt.stats()["memory_bytes"]["params"] == 4 * shard
    _train(model, opt, rank, ws, make_batches(2, ws * 2, seed=3))
    comm = opt.stats()["comm_bytes"]
    forward = sum(4 * p * (ws - 1) // ws for p in padded)
    backward = sum(4 * p * (2 - 1) // 2 for p in padded)
    assert comm["all_gather"] == forward + backward, (comm, forward, backward)
    assert comm["reduce_scatter"] == forward, comm
    assert opt.stats()["gather"]["reshard_after_forward"] == 2
    import pytest
    for bad in (3, 4, 1):
        with pytest.raises(ValueError, match=f"reshard_after_forward={bad} must divide"):
            zk.ZeroOptimizer(make_model(), stage=3, reshard_after_forward=bad)
    with pytest.raises(ValueError, match="applies only to stage=3"):
        zk.ZeroOptimizer(make_model(), stage=2, reshard_after_forward=2)


# The battery's hybrid rows (parity with torch.optim.AdamW, then this traffic and memory) run
# in this spawn beside the checks only hybrid sharding has.
CHECKS = {
    **{key: partial(parity_on_rank, row=row) for key, (row, check) in _battery.TABLE.items()
       if _battery.WORLD_SIZES[key] is _battery.HYBRID and check == "parity"},
    "checkpoint_hybrid_to_plain3_and_back": checkpoint_across_shapes,
    "bad_shard_size": bad_shard_size,
    "stage3_secondary_shards": secondary_shards,
}


def battery(rank, world_size):
    return run_checks(CHECKS, rank, world_size)
