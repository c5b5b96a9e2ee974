"""The torch.distributed comm backend, the single-rank backend and the volume meter."""
from datetime import timedelta

import pytest
import torch

from zkernels.comm import LocalComm, MeteredComm, VolumeMeter, make_comm
from tests._dist import run_ranks
from tests.zero._comm_checks import collectives, dead_peer, holds_group


def test_meter_counts_ring_volume_per_step():
    meter = VolumeMeter()
    meter.record("reduce_scatter", 1200, 4)
    meter.record("all_gather", 600, 4)
    meter.record("all_reduce", 8, 4)
    assert meter.current_step()["total"] == 900 + 450 + 12
    assert meter.last_step()["total"] == 0
    meter.close_step()
    assert meter.last_step() == {"reduce_scatter": 900, "all_gather": 450, "all_reduce": 12,
                                 "total": 1362}
    assert meter.current_step()["total"] == 0
    with pytest.raises(ValueError, match="kind"):
        meter.record("broadcast", 4, 2)


def test_single_rank_backend_without_process_group():
    comm = make_comm(None, torch.device("cpu"))
    assert isinstance(comm, LocalComm) and comm.world_size == 1
    meter = VolumeMeter()
    mc = MeteredComm(comm, meter)
    x = torch.arange(6.0)
    out = torch.empty(6)
    mc.reduce_scatter(out, x).wait()
    assert torch.equal(out, x)
    full = torch.empty(6)
    mc.all_gather(full, x).wait()
    assert torch.equal(full, x)
    meter.close_step()
    assert meter.last_step()["total"] == 0  # one rank sends nothing
    with pytest.raises(ValueError, match="backend"):
        make_comm(None, torch.device("cpu"), backend="mpi")


def test_auto_is_torch_distributed_even_on_cuda(monkeypatch):
    """The native engine is opt-in until benchmarks/gpu_check.sh has passed on a GPU
    ([Note: the native engine is opt-in]): "auto" never picks it, even where it is built."""
    from zkernels.comm import nccl
    from zkernels.comm.select import resolve_backend
    monkeypatch.setattr(nccl, "AVAILABLE", True)
    for device in (torch.device("cuda", 0), torch.device("cpu"), None):
        assert resolve_backend("auto", device) == "torch"
        assert resolve_backend("torch", device) == "torch"
    assert resolve_backend("nccl", torch.device("cuda", 0)) == "nccl"
    with pytest.raises(ValueError, match="comm_backend must be one of"):
        resolve_backend("gloo", None)


def test_collectives_on_three_gloo_ranks():
    assert run_ranks(collectives, 3) == [True] * 3


@pytest.mark.slow  # fault timing
def test_a_rank_that_keeps_the_group_fails_the_teardown_check():
    """The teardown check of tests/_dist.py (gloo threads gone within its grace after
    destroy_process_group()) fails a rank that still holds the group, instead of passing."""
    with pytest.raises(AssertionError, match="outlived destroy_process_group"):
        run_ranks(holds_group, 2, timeout=60.0)


@pytest.mark.slow  # fault timing
@pytest.mark.parametrize("mode", ["exit", "silent"])
def test_dead_peer_fails_within_timeout(mode):
    pg_timeout_s = 3.0
    results = run_ranks(dead_peer, 2, mode, pg_timeout_s=pg_timeout_s, timeout=60.0)
    elapsed, message = results[0]
    assert elapsed < pg_timeout_s + 5.0, (elapsed, message)
    assert message.startswith("all_gather of 32 bytes (torch.float32) on rank 0 of 2 "
                              "[unit blocks.7] failed or did not complete within the process "
                              "group's timeout"), message


@pytest.mark.slow  # fault timing
def test_own_timeout_bounds_a_silent_peer():
    """make_comm(timeout=...) bounds the wait on a stuck peer even when the process group's
    timeout is much longer (see [Note: timeouts on torch.distributed])."""
    results = run_ranks(dead_peer, 2, "silent", timedelta(seconds=2), 6.0, pg_timeout_s=60.0,
                        timeout=60.0)
    elapsed, message = results[0]
    assert 1.5 < elapsed < 2.0 + 3.0, (elapsed, message)
    assert "within timeout 2s" in message, message


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-1.0, ValueError),
                                        (timedelta(0), ValueError), ("5", TypeError),
                                        (True, TypeError)])
def test_timeout_must_be_positive_seconds(bad, error):
    with pytest.raises(error, match="timeout"):
        make_comm(None, torch.device("cpu"), timeout=bad)
