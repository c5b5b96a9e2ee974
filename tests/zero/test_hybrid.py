"""Hybrid sharding (``shard_size=K``, a 2-D DeviceMesh): 4 gloo ranks as 2 groups of 2, in one
spawn running the selected rows below (the battery's hybrid rows, a checkpoint across shapes,
bad ``shard_size``, stage 3's secondary shards), each rank returning what it measured and the
test asserting here; and the estimator and the meter without ranks."""
from __future__ import annotations

import os
import tempfile
from functools import partial

import pytest
import torch
import torch.distributed as dist

import zkernels as zk
from tests.zero import _battery
from tests.zero._battery import BETAS, SMALL_BUCKET, WD
from tests.zero._harness import EPS, LR, chunk, make_batches, make_model, rank_fixture
from tests.zero.test_battery import check_parity, parity
from zkernels.comm import VolumeMeter

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
    return [t.clone() for z in opt.zero_units for t in z.read_state()[1]]


def checkpoint_across_shapes(rank, ws) -> dict:
    """Hybrid 2x2 stage 3 saved after 2 steps, loaded as plain stage 2 on 3 ranks (rank 3
    idle), saved again there, loaded back as hybrid 2x2 stage 3: every parameter and every
    state element comes back bit for bit, and the next step is the one the first run takes.
    Each shard is written once (by the first replica). Returns the shard files and what
    differed at each stage (names of parameters; whether the state did)."""
    out = {}
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
    out["shard_files"] = sorted(f for f in os.listdir(first) if f.startswith("shard-"))
    with opt.gathered():
        saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    states = _states(opt)
    if rank < 3:
        plain = make_model(seed=7)
        popt = zk.ZeroOptimizer(plain, stage=2, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                process_group=three, bucket_bytes=SMALL_BUCKET)
        zk.checkpoint.load(popt, first)
        out["differ_in_plain3"] = [n for n, p in plain.named_parameters()
                                   if not torch.equal(p, saved[n])]
        zk.checkpoint.save(popt, second)
        popt.close()
    dist.barrier()
    back = make_model(seed=9)
    bopt = _opt(back)
    zk.checkpoint.load(bopt, second)
    with bopt.gathered():
        out["differ_after_round_trip"] = [n for n, p in back.named_parameters()
                                          if not torch.equal(p, saved[n])]
    back_states = _states(bopt)
    out["state_equal_after_round_trip"] = len(states) == len(back_states) and all(
        torch.equal(a, b) for a, b in zip(states, back_states))
    _train(model, opt, rank, ws, batches[2:])
    _train(back, bopt, rank, ws, batches[2:])
    with opt.gathered(), bopt.gathered():
        out["differ_at_the_next_step"] = [n for (n, p), q in zip(model.named_parameters(),
                                                                 back.parameters())
                                          if not torch.equal(p, q)]
    dist.barrier()
    if rank == 0:
        import shutil
        shutil.rmtree(root)
    return out


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


def secondary_shards(rank, ws, *, steps=3) -> dict:
    """reshard_after_forward=2 on 4 ranks (plain stage 3; its parity is the battery's row
    ``stage3-fp32-reshard2``): parameter bytes held after each forward and after each step,
    with what they should be; the comm bytes of two clean steps; the R stats reports."""
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=3, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                           reshard_after_forward=2)
    shard = sum(u.layout.shard_numel for u in opt.units)
    padded = [u.layout.padded_numel for u in opt.units]
    out = {"shard_bytes": 4 * shard, "padded": padded, "after_forward": [], "after_step": []}
    for batch in make_batches(steps, ws * 2):
        loss = model(*chunk(batch, rank))
        out["after_forward"].append(opt.stats()["memory_bytes"]["params"])
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["after_step"].append(opt.stats()["memory_bytes"]["params"])
    _train(model, opt, rank, ws, make_batches(2, ws * 2, seed=3))
    out["comm"] = opt.stats()["comm_bytes"]
    out["reshard_after_forward"] = opt.stats()["gather"]["reshard_after_forward"]
    return out


def bad_reshard_after_forward(rank, ws):
    """R that does not divide the 4 ranks or is 1, and R at stage 2: errors naming it."""
    import pytest
    for bad in (3, 4, 1):
        with pytest.raises(ValueError, match=f"reshard_after_forward={bad} must divide"):
            zk.ZeroOptimizer(make_model(), stage=3, reshard_after_forward=bad)
    with pytest.raises(ValueError, match="applies only to stage=3"):
        zk.ZeroOptimizer(make_model(), stage=2, reshard_after_forward=2)


# The battery's hybrid rows (parity with torch.optim.AdamW, then the hybrid traffic and
# memory on the ranks) run in this spawn beside the rows only hybrid sharding has.
HYBRID_ROWS = {key: row for key, (row, check) in _battery.TABLE.items()
               if _battery.WORLD_SIZES[key] is _battery.HYBRID and check == "parity"}
BODIES = {
    **{key: partial(parity, row=row) for key, row in HYBRID_ROWS.items()},
    "checkpoint_hybrid_to_plain3_and_back": checkpoint_across_shapes,
    "bad_shard_size": bad_shard_size,
    "stage3_secondary_shards": secondary_shards,
    "stage3_bad_reshard_after_forward": bad_reshard_after_forward,
}

ranks = rank_fixture(BODIES, world_size=4, timeout=600.0)


@pytest.mark.parametrize("row", [pytest.param(k, id=f"4-{k}") for k in HYBRID_ROWS])
def test_parity(ranks, row):
    for res in ranks(row):
        check_parity(res, HYBRID_ROWS[row], 4)


@pytest.mark.parametrize("row", ["checkpoint_hybrid_to_plain3_and_back"])
def test_checkpoint_across_shapes(ranks, row):
    """Every parameter and state element comes back bit for bit, the next step is the one
    the first run takes, each shard is written once (by the first replica)."""
    for rank, res in enumerate(ranks(row)):
        assert res["shard_files"] == ["shard-00000-of-00002.safetensors",
                                      "shard-00001-of-00002.safetensors"]
        if rank < 3:   # loaded as plain stage 2 on 3 ranks
            assert res["differ_in_plain3"] == []
        assert res["differ_after_round_trip"] == []
        assert res["state_equal_after_round_trip"]
        assert res["differ_at_the_next_step"] == []


@pytest.mark.parametrize("row", ["bad_shard_size", "stage3_bad_reshard_after_forward"])
def test_bad_arguments_on_ranks(ranks, row):
    ranks(row)   # pytest.raises on the ranks (a mesh needs the process group)


@pytest.mark.parametrize("row", ["stage3_secondary_shards"])
def test_secondary_shards(ranks, row):
    """After forward every unit holds a secondary chunk of 1/2 its padded size (4 B x padded
    / 2) and nothing else beyond the shards; the backward gathers run over 2 ranks (4 B x
    padded x 1/2 each) while the forward ones run over 4 (x 3/4); between steps nothing extra
    is held."""
    ws = 4
    for res in ranks(row):
        padded, shard = res["padded"], res["shard_bytes"]
        assert res["after_forward"] == [shard + sum(4 * p // 2 for p in padded)] * 3
        assert res["after_step"] == [shard] * 3
        forward = sum(4 * p * (ws - 1) // ws for p in padded)
        backward = sum(4 * p * (2 - 1) // 2 for p in padded)
        assert res["comm"]["all_gather"] == forward + backward
        assert res["comm"]["reduce_scatter"] == forward
        assert res["reshard_after_forward"] == 2


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_estimate_is_the_formula_with_n_replaced_by_k(stage):
    model = make_model()
    hyb = zk.estimate_memory(model, 8, stage, shard_size=2, param_dtype=torch.bfloat16)
    plain = zk.estimate_memory(model, 2, stage, param_dtype=torch.bfloat16)
    for kind in ("params_bytes", "grads_bytes", "master_bytes", "optimizer_states_bytes",
                 "buffers_bytes", "device_bytes"):
        assert getattr(hyb, kind) == getattr(plain, kind), kind
    psi = sum(p.numel() for p in model.parameters())
    # Across groups: the fp32 gradient shard all-reduced over G = 4 groups, 2 (G-1)/G.
    assert hyb.comm_across_groups_bytes == round(2 * 4 * -(-psi // 2) * 3 / 4)
    assert hyb.comm_within_group_bytes == plain.comm_bytes
    assert hyb.shard_size == 2 and hyb.world_size == 8
    full = zk.estimate_memory(model, 8, stage, shard_size=8)
    assert full.comm_across_groups_bytes == 0
    assert full.device_bytes == zk.estimate_memory(model, 8, stage).device_bytes


@pytest.mark.parametrize("bad, err", [(3, ValueError), (0, ValueError), (True, TypeError)])
def test_estimate_refuses_bad_shard_size(bad, err):
    with pytest.raises(err, match="shard_size"):
        zk.estimate_memory(1000, 8, 2, shard_size=bad)


def test_meter_splits_the_total_by_scope():
    meter = VolumeMeter()
    meter.record("reduce_scatter", 1200, 4)
    meter.record("all_reduce", 800, 2, scope="across_groups")
    meter.close_step()
    assert meter.last_step() == {"reduce_scatter": 900, "all_gather": 0, "all_reduce": 800,
                                 "total": 1700}
    assert meter.last_step_scopes() == {"within_group": 900, "across_groups": 800}
    with pytest.raises(ValueError, match="scope"):
        meter.record("all_reduce", 8, 2, scope="between")


def test_plan_shard_size(capsys):
    from zkernels.plan import main
    assert main(["--params", "7e9", "--world-size", "16", "--shard-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "within" in out and "across" in out and "K = 8" in out
    with pytest.raises(SystemExit) as exc:
        main(["--params", "7e9", "--world-size", "16", "--shard-size", "5"])
    assert exc.value.code == 2
    assert "--shard-size must divide --world-size (16), got 5" in capsys.readouterr().err


class _FakeHandle:
    def __init__(self, log, what):
        self.log, self.what, self.finished = log, what, False

    def done(self):
        return self.finished

    def wait(self):
        self.log.append(f"wait {self.what}")


class _FakeComm:
    """Records launches; handles say done only when the test says so."""

    def __init__(self, log, name, rank, world_size):
        self.log, self.name, self.rank, self.world_size = log, name, rank, world_size
        self.handles = []

    def _launch(self, what):
        self.log.append(f"{self.name} {what}")
        self.handles.append(_FakeHandle(self.log, f"{self.name} {what}"))
        return self.handles[-1]

    def reduce_scatter(self, output, input, *, average=False, tag=None):
        return self._launch(f"rs {tag}")

    def all_gather(self, output, input, *, tag=None):
        return self._launch(f"ag {tag}")

    def all_reduce(self, tensor, *, op="sum", tag=None):
        return self._launch(f"ar {tag}")


def test_cross_group_all_reduce_starts_once_its_reduce_scatter_is_done():
    """[Note: hybrid sharding is a group shape]: the all-reduce of bucket 0's shard starts at
    the next collective after its reduce-scatter is done, before anyone waits; bucket 1's,
    still in flight then, starts in its wait(); launches follow reduce-scatter order."""
    from zkernels.comm import HybridComm, num_averaged
    log = []
    shard, rep = _FakeComm(log, "shard", 1, 2), _FakeComm(log, "rep", 0, 3)
    hc = HybridComm(shard, rep, _FakeComm(log, "world", 1, 6))
    assert (hc.rank, hc.world_size, hc.replica_rank, hc.num_replicas) == (1, 2, 0, 3)
    assert num_averaged(hc) == 6
    buf = torch.zeros(4)
    h0 = hc.reduce_scatter(buf[:2], buf, tag="b0")
    h1 = hc.reduce_scatter(buf[2:], buf, tag="b1")
    assert not any(e.startswith("rep") for e in log)
    shard.handles[0].finished = True
    hc.all_gather(buf, buf[:2], tag="u")
    assert log == ["shard rs b0", "shard rs b1", "wait shard rs b0", "rep ar b0", "shard ag u"]
    h1.wait()
    assert log[5:] == ["wait shard rs b1", "rep ar b1", "wait rep ar b1"]
    h0.wait()
    assert log[8:] == ["wait rep ar b0"]
    # Waited out of order: the earlier reduce-scatter's all-reduce still starts first.
    del log[:]
    h2 = hc.reduce_scatter(buf[:2], buf, tag="b2")
    h3 = hc.reduce_scatter(buf[2:], buf, tag="b3")
    h3.wait()
    assert log == ["shard rs b2", "shard rs b3", "wait shard rs b2", "rep ar b2",
                   "wait shard rs b3", "rep ar b3", "wait rep ar b3"]
    h2.wait()
    with pytest.raises(ValueError, match="is not the world's"):
        HybridComm(shard, rep, _FakeComm(log, "world", 0, 4))


def test_estimate_secondary_shards():
    """reshard_after_forward=R in the estimate: backward gathers over R ranks, the secondary
    chunks p·Ψ/R transient; bad R named."""
    model = make_model()
    psi = sum(p.numel() for p in model.parameters())
    base = zk.estimate_memory(model, 8, 3)
    hpz = zk.estimate_memory(model, 8, 3, secondary_size=2)
    assert abs(hpz.comm_bytes - (base.comm_bytes - 4 * psi * (7 / 8 - 1 / 2))) <= 1
    assert hpz.transient_bytes == base.transient_bytes + 4 * -(-psi // 2)
    assert hpz.device_bytes == base.device_bytes + 4 * -(-psi // 2)
    assert hpz.held_device_bytes == base.held_device_bytes   # nothing between steps
    with pytest.raises(ValueError, match="reshard_after_forward=3 must divide"):
        zk.estimate_memory(model, 8, 3, secondary_size=3)
    with pytest.raises(ValueError, match="applies only to stage=3"):
        zk.estimate_memory(model, 8, 2, secondary_size=2)
