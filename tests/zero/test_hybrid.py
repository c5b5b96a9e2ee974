"""Hybrid sharding (``shard_size=K``, a 2-D DeviceMesh): 4 gloo ranks as 2 groups of 2, in one
spawn running every check of ``_hybrid_checks.CHECKS``, each reported as its own test; and
the estimator and the meter without ranks."""
import pytest
import torch

import zkernels as zk
from tests.zero._harness import battery_results, make_model
from tests.zero._hybrid_checks import CHECKS, battery
from zkernels.comm import VolumeMeter


@pytest.fixture(scope="module")
def results():
    return battery_results(CHECKS, battery, timeout=600.0)


@pytest.mark.parametrize("check", list(CHECKS))
def test_check(results, check):
    error = results(4)[check]
    assert error is None, f"{check} failed on 2 groups of 2 ranks:\n{error}"


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
