"""torch.compile (inductor, CPU): a compiled model trains under ZeroOptimizer, with the loss of
every step equal to torch.optim.AdamW's on the same (eager) model to a stated tolerance, and no
graph break.

One tiny model, 3 steps, one process: compiling costs tens of seconds on 2 cores, so each
stage pays one compile. Tolerances: losses tol(float32)'s rtol 1e-5 (measured: equal to the
last bit at both stages over the 3 steps); parameters rtol 1e-4, atol 1e-5, ten times the
eager parity tests' (measured 0.52x of it at both stages): inductor's fused backward sums in
other orders than eager's, and Adam amplifies that gradient round-off on elements whose
gradient is near zero (see [Note: same-order reference] in _harness.py).
"""
import pytest
import torch

import zkernels as zk
from tests.zero._harness import EPS, LR, MICRO_BATCH, chunk, clone_model, make_batches, \
    make_model

pytestmark = pytest.mark.slow  # torch.compile: minutes of inductor compilation

STAGES = (1, 2, 3)
STEPS = 3
LOSS_RTOL = 1e-5


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _train_like_adamw(model, ref, compiled, opt, what, after_step=None):
    """STEPS steps of ``compiled`` under ``opt`` against torch.optim.AdamW on ``ref`` (a copy
    of the model's initial weights, taken before the optimizer sharded them): every loss to
    LOSS_RTOL, every parameter at the end (read inside ``opt.gathered()``: stage 3 holds
    shards) to rtol 1e-4, atol 1e-5."""
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS, weight_decay=0.1)
    for step, batch in enumerate(make_batches(STEPS, MICRO_BATCH)):
        loss = compiled(*chunk(batch, 0))
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        rloss = ref(*chunk(batch, 0))
        rloss.backward()
        ropt.step()
        ropt.zero_grad()
        torch.testing.assert_close(loss.item(), rloss.item(), rtol=LOSS_RTOL, atol=0.0,
                                   msg=lambda m: f"{what}, step {step} loss: {m}")
        if after_step is not None:
            after_step()
    with opt.gathered():  # stage 3: the full parameters (a no-op at stages 1-2)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=name: f"{what}, {n}: {m}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", STAGES)
def test_compiled_model_trains_like_adamw(stage):
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    model = make_model()
    ref = clone_model(model)
    compiled = torch.compile(model)  # the user's order: compile, then hand it to the optimizer
    # Stage 3 keeps units gathered from forward to backward under compile (see [Note: stage 3
    # under torch.compile] in zkernels/zero/optimizer.py; the other mode is refused below).
    extra = {"reshard_after_forward": False} if stage == 3 else {"bucket_bytes": 3000}
    opt = zk.ZeroOptimizer(compiled, stage=stage, lr=LR, eps=EPS, weight_decay=0.1, **extra)
    _train_like_adamw(model, ref, compiled, opt, f"stage {stage}")
    breaks = sum(counters["graph_break"].values())
    # Stages 1-2 hook only backward: no break. Stage 3's per-unit forward hooks (gather,
    # prefetch, the divergent-path check) break the graph around each unit: measured 8 on this
    # 2-block GPT (3 units); the bound is 4 per unit, so a change that breaks more shows here.
    allowed = 0 if stage < 3 else 4 * len(opt.schedule.units)
    assert breaks <= allowed, (f"stage {stage}: {breaks} graph breaks (at most {allowed}): "
                               f"{dict(counters['graph_break'])}")
    assert counters["stats"]["unique_graphs"] >= 1, "nothing was compiled"


def test_stage3_compiled_reshard_after_forward_is_refused():
    compiled = torch.compile(make_model())
    with pytest.raises(ValueError, match="reshard_after_forward=False"):
        zk.ZeroOptimizer(compiled, stage=3, lr=LR)


@pytest.mark.timeout(600)
def test_compiled_stage3_with_offload_params():
    """Stage 3 with the parameter shards in host RAM (offload_params) under torch.compile: the
    gather policy changes where the shard comes from, not the hooks, so it trains like
    torch.optim.AdamW with the same tolerances; reshard_after_forward=True is refused as
    without offload."""
    torch._dynamo.reset()
    model = make_model()
    ref = clone_model(model)
    compiled = torch.compile(model)
    with pytest.raises(ValueError, match="reshard_after_forward=False"):
        zk.ZeroOptimizer(compiled, stage=3, lr=LR, offload="cpu", offload_params=True)
    opt = zk.ZeroOptimizer(compiled, stage=3, lr=LR, eps=EPS, weight_decay=0.1,
                           offload="cpu", offload_params=True, reshard_after_forward=False)

    def no_parameter_bytes_on_device():  # between steps
        assert not any(t.untyped_storage().nbytes() for u in opt.units for t in u.gather.held())
    _train_like_adamw(model, ref, compiled, opt, "offload_params", no_parameter_bytes_on_device)
    opt.close()
