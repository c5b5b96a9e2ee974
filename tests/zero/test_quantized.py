"""Quantized collectives without ranks: the refusals of ``ZeroOptimizer``'s quantize options,
a one-rank run through them (the comms over :class:`LocalComm`), and the traffic model of
``estimate_memory`` against its formula. The 2-rank checks are in test_quantized_ranks.py."""
import pytest
import torch

import zkernels as zk
from tests._dist import rank_threads
from tests.zero._harness import MICRO_BATCH, chunk, make_batches, make_model
from zkernels import reference as ref
from zkernels.comm import CollectiveError, LocalComm, MeteredComm, VolumeMeter
from zkernels.comm.quantized import QuantizedGradComm, QuantizedWeightComm
from zkernels.zero.planning.estimate import comm_seconds


@pytest.mark.parametrize("kw, match", [
    (dict(stage=2, quantize_weights="int8"), "quantize_weights"),
    (dict(stage=1, quantize_weights="int8"), "quantize_weights"),
    (dict(stage=3, quantize_weights="int4"), "quantize_weights"),
    (dict(stage=3, quantize_weights=True), "quantize_weights"),
    (dict(stage=2, quantize_grads="fp8"), "quantize_grads"),
    (dict(stage=2, quantize_grads=4), "quantize_grads"),
    (dict(stage=2, quantize_grads="int8", quantize_block=100), "quantize_block"),
    (dict(stage=2, quantize_grads="int8", quantize_block=0), "quantize_block"),
    (dict(stage=3, quantize_weights="int8", quantize_block=16384), "quantize_block"),
    (dict(stage=2, quantize_grads="int4", quantize_block="256"), "quantize_block"),
    (dict(stage=2, quantize_grads="int4", comm_backend="nccl"), "quantize_grads"),
    (dict(stage=3, quantize_weights="int8", comm_backend="nccl"), "quantize_weights"),
])
def test_bad_options_are_refused_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        zk.ZeroOptimizer(make_model(), **kw)


def test_one_rank_trains_through_the_quantized_comms():
    """World size 1 (LocalComm): the wrappers are in the path (the one chunk is quantized)
    and the step's loss stays within 1% of the exact run's."""
    threads = torch.get_num_threads()
    torch.set_num_threads(rank_threads())   # tiny ops: OpenMP barriers on a shared machine
    try:
        _one_rank_runs()
    finally:
        torch.set_num_threads(threads)


def _one_rank_runs():
    losses = {}
    for kw in ({}, dict(quantize_grads="int4", quantize_weights="int8")):
        model = make_model()
        opt = zk.ZeroOptimizer(model, stage=3, lr=3e-3, param_dtype=torch.bfloat16, **kw)
        out = []
        for batch in make_batches(2, MICRO_BATCH):
            loss = model(*chunk(batch, 0))
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        losses[bool(kw)] = out
        assert isinstance(opt.schedule.comm, QuantizedWeightComm) == bool(kw)
        assert isinstance(opt.comm, QuantizedGradComm) == bool(kw)
    assert losses[True][0] != losses[False][0]   # the gathered weights were quantized
    for a, b in zip(losses[False], losses[True]):
        assert abs(a - b) <= 0.01 * a, losses


def test_local_comms_are_the_reference():
    ops = zk.ops.for_device("cpu")
    meter = VolumeMeter()
    x = torch.randn(75)
    out = torch.empty(75)
    QuantizedGradComm(MeteredComm(LocalComm(), meter), ops, 4, 16).reduce_scatter(
        out, x, average=True).wait()
    codes, scales = ref.quantize(x, bits=4, block_size=16)
    want = torch.empty(75)
    ref.dequantize_sum(codes[None], scales[None], want, bits=4, block_size=16)
    assert torch.equal(out, want)
    got = torch.empty(75, dtype=torch.bfloat16)
    QuantizedWeightComm(LocalComm(), ops, 32).all_gather(got, x.bfloat16()).wait()
    assert torch.equal(got, ref.dequantize(*ref.quantize(x.bfloat16(), bits=8, block_size=32),
                                           bits=8, block_size=32, dtype=torch.bfloat16))
    meter.close_step()
    assert meter.last_step()["total"] == 0   # one rank sends nothing


class _FourRanks:
    """A comm of 4 ranks that does nothing (what the meter counts is all that is checked)."""
    rank, world_size = 0, 4

    def all_to_all(self, output, input, *, tag=None):
        return _Done()


class _Done:
    def wait(self):
        return None


def test_meter_counts_an_all_to_all_as_the_reduce_scatter_it_implements():
    meter = VolumeMeter()
    MeteredComm(_FourRanks(), meter).all_to_all(torch.empty(250), torch.empty(250)).wait()
    meter.close_step()
    assert meter.last_step() == {"reduce_scatter": 750, "all_gather": 0, "all_reduce": 0,
                                 "total": 750}


@pytest.mark.parametrize("world_size", [2, 8])
def test_estimate_counts_codes_and_scales(world_size):
    psi, n = 1 << 20, world_size
    frac = (n - 1) / n
    bf16 = torch.bfloat16
    plain3 = zk.estimate_memory(psi, n, 3, param_dtype=bf16)
    both3 = zk.estimate_memory(psi, n, 3, param_dtype=bf16, quantize_weights="int8",
                               quantize_grads="int4")
    assert plain3.comm_bytes == round((4 + 2 * 2) * psi * frac)
    assert both3.comm_bytes == round((0.5 + 4 / 256 + 2 * (1 + 4 / 256)) * psi * frac)
    assert both3.comm_bytes <= 0.35 * plain3.comm_bytes
    plain2 = zk.estimate_memory(psi, n, 2, param_dtype=bf16)
    int8_2 = zk.estimate_memory(psi, n, 2, param_dtype=bf16, quantize_grads="int8",
                                quantize_block=64)
    assert int8_2.comm_bytes == round((1 + 4 / 64 + 2) * psi * frac)
    assert int8_2.comm_bytes <= 0.6 * plain2.comm_bytes
    # memory is unchanged
    assert both3.device_bytes == plain3.device_bytes


def test_estimate_secondary_backward_gather_stays_exact():
    psi, bf16 = 1 << 20, torch.bfloat16
    e = zk.estimate_memory(psi, 8, 3, param_dtype=bf16, quantize_weights="int8",
                           secondary_size=2)
    w = 1 + 4 / 256
    assert e.comm_bytes == round(4 * psi * 7 / 8 + w * psi * 7 / 8 + 2 * psi * 1 / 2)


@pytest.mark.parametrize("kw, match", [
    (dict(stage=2, quantize_weights="int8"), "quantize_weights"),
    (dict(stage=0, quantize_grads="int8"), "quantize_grads"),
    (dict(stage=2, quantize_grads="int2"), "quantize_grads"),
    (dict(stage=2, quantize_grads="int8", quantize_block=3), "quantize_block"),
])
def test_estimate_refuses_bad_options(kw, match):
    with pytest.raises(ValueError, match=match):
        zk.estimate_memory(1000, 2, **kw)


def test_comm_seconds():
    assert comm_seconds(125_000_000, 100.0) == pytest.approx(0.01)
    for bad in (0, -1.0, True, "100"):
        with pytest.raises(ValueError, match="link_gbps"):
            comm_seconds(1, bad)


def test_plan_link_gbps_shows_the_quantized_choices(capsys):
    from zkernels.__main__ import main as zk_main
    assert zk_main(["plan", "--params", "1e9", "--world-size", "8", "--link-gbps", "100"]) == 0
    out = capsys.readouterr().out
    assert "comm s" in out
    for name in ("stage 2 + int8 grads", "stage 3 + int8 weights + int4 grads"):
        assert f"  {name}  " in out, out
    line = next(x for x in out.splitlines() if x.startswith("  stage 3 + int8 weights + int4 "
                                                            "grads:"))
    assert "0.32x the bytes of stage 3" in line, line
    # with a device budget: the chosen rung's variants only
    assert zk_main(["plan", "--params", "7.5e9", "--world-size", "64", "--link-gbps", "25",
                    "--device-memory", "30GB"]) == 0
    out = capsys.readouterr().out
    assert "* stage 2  " in out and "stage 2 + int4 grads" in out
    assert "stage 3 + int8 weights" not in out
    assert zk_main(["plan", "--params", "1e9", "--world-size", "8"]) == 0
    assert "comm s" not in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["0", "-5", "fast", "inf"])
def test_plan_refuses_a_bad_link(capsys, bad):
    from zkernels.__main__ import main as zk_main
    with pytest.raises(SystemExit):
        zk_main(["plan", "--params", "1e9", "--world-size", "8", "--link-gbps", bad])
    assert "--link-gbps" in capsys.readouterr().err


def test_demo_rungs_take_the_quantized_options():
    from zkernels.demo.rungs import parse_rungs
    rungs = parse_rungs("3+qw8+qg4, stage 2 + int8 grads, 3")
    assert [r.key for r in rungs] == ["3+qw8+qg4", "2+qg8", "3"]
    assert rungs[0].name == "stage 3 + int8 weights + int4 grads"
    assert (rungs[1].quantize_grads, rungs[1].quantize_weights) == ("int8", None)
    for bad in ("2+qw8", "ddp+qg8"):
        with pytest.raises(ValueError, match="--rungs"):
            parse_rungs(bad)


class _Broken:
    """A comm of 2 ranks whose collectives fail when waited (a peer died)."""
    rank, world_size = 0, 2

    def _fail(self, what):
        class H:
            def wait(self_inner):
                raise CollectiveError(f"{what} failed", collective=what, nbytes=8, tag="t")
        return H()

    def all_to_all(self, output, input, *, tag=None):
        return self._fail("all_to_all")

    def all_gather(self, output, input, *, tag=None):
        return self._fail("all_gather")


def test_a_failed_exchange_raises_naming_the_collective():
    ops = zk.ops.for_device("cpu")
    with pytest.raises(CollectiveError, match="quantized reduce_scatter") as info:
        QuantizedGradComm(_Broken(), ops, 8, 16).reduce_scatter(
            torch.empty(10), torch.empty(20), tag="unit blocks.0").wait()
    assert info.value.collective == "reduce_scatter" and info.value.tag == "unit blocks.0"
    assert isinstance(info.value.__cause__, CollectiveError)
    with pytest.raises(CollectiveError, match="quantized all_gather") as info:
        QuantizedWeightComm(_Broken(), ops, 16).all_gather(torch.empty(20), torch.empty(10)).wait()
    assert info.value.collective == "all_gather"


@pytest.mark.parametrize("out, inp, err, match", [
    (torch.empty(10), torch.empty(21), ValueError, "input must have 2 x"),
    (torch.empty(10), torch.empty(4, 5), ValueError, "input must be a contiguous 1-D"),
    (torch.empty(10, dtype=torch.int32), torch.empty(20), TypeError, "output must be a float"),
    ([0.0] * 10, torch.empty(20), TypeError, "output must be a torch.Tensor"),
])
def test_quantized_reduce_scatter_bad_input(out, inp, err, match):
    q = QuantizedGradComm(_FourRanks2(), zk.ops.for_device("cpu"), 8, 16)
    with pytest.raises(err, match=match):
        q.reduce_scatter(out, inp)


def test_quantized_all_gather_bad_input():
    q = QuantizedWeightComm(_FourRanks2(), zk.ops.for_device("cpu"), 16)
    with pytest.raises(ValueError, match="output must have 2 x"):
        q.all_gather(torch.empty(21), torch.empty(10))
    with pytest.raises(ValueError, match="quantize_block"):
        QuantizedWeightComm(_FourRanks2(), zk.ops.for_device("cpu"), 24)
    with pytest.raises(ValueError, match="all_to_all"):
        QuantizedGradComm(object.__new__(_NoAllToAll), zk.ops.for_device("cpu"), 8, 16)


class _FourRanks2(_FourRanks):
    world_size = 2


class _NoAllToAll:
    rank, world_size = 0, 2
