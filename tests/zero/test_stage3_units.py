"""Stage 3's units on one process: the default plan, ``units=`` by class and by module, the
errors that name a bad unit, parameters shared across units (hoisted to the root), and the
memory the estimator predicts against what ``stats()`` measures."""
import copy

import pytest
import torch
import torch.nn as nn

import zkernels as zk
from tests.conftest import tol
from tests.zero._harness import EPS, LR, make_batches, make_model
from zkernels.demo.model import Block
from zkernels.zero.planning.unit_plan import ROOT_NAME, plan_units


def _names(opt):
    return [u.name for u in opt.schedule.units]


def test_default_units_are_blocks_and_root():
    model = make_model()
    specs = plan_units(model)
    assert [s.name for s in specs] == ["blocks.0", "blocks.1", ROOT_NAME]
    root = {id(p) for p in specs[-1].params}
    assert {id(model.wte.weight), id(model.wpe.weight), id(model.ln_f.weight)} <= root
    assert sum(len(s.params) for s in specs) == len(list(model.parameters()))


def test_units_by_class_and_by_module():
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=3, units=[nn.LayerNorm])
    assert _names(opt) == ["blocks.0.ln_1", "blocks.0.ln_2", "blocks.1.ln_1", "blocks.1.ln_2",
                           "ln_f", ROOT_NAME]
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=3, units=[model.blocks[1]])
    assert _names(opt) == ["blocks.1", ROOT_NAME]


@pytest.mark.parametrize("units, error, match", [
    ([nn.Conv2d], ValueError, "no module of class Conv2d"),
    (lambda m: [nn.Linear(3, 3)], ValueError, r"units\[0\] \(Linear\) is not a submodule"),
    (lambda m: [m.blocks[0], m.blocks[0]], ValueError, "lists module 'blocks.0' twice"),
    (lambda m: [Block, m.blocks[1]], ValueError, "lists module 'blocks.1' twice"),
    (lambda m: [m.blocks[0], m.blocks[0].attn], ValueError,
     "'blocks.0.attn' is inside unit 'blocks.0'"),
    (lambda m: [m], ValueError, "is the model itself"),
    (lambda m: [m.blocks[0].add_module("act", nn.Identity()) or m.blocks[0].act], ValueError,
     "unit 'blocks.0.act' .* holds no parameter"),
    ([3], TypeError, r"units\[0\] must be an nn.Module class"),
    ("blocks", TypeError, "units must be None or a list"),
])
def test_bad_units_name_the_unit(units, error, match):
    """A wrong value is a ValueError, a wrong type a TypeError (each row expects its own)."""
    model = make_model()
    if callable(units) and not isinstance(units, type):
        units = units(model)
    with pytest.raises(error, match=match):
        zk.ZeroOptimizer(model, stage=3, units=units)


def test_stage3_arguments_at_other_stages():
    with pytest.raises(ValueError, match="apply only to stage=3"):
        zk.ZeroOptimizer(make_model(), stage=2, units=[Block])
    with pytest.raises(ValueError, match="apply only to stage=3"):
        zk.ZeroOptimizer(make_model(), stage=1, reshard_after_forward=False)
    with pytest.raises(TypeError, match="reshard_after_forward must be a bool or an int"):
        zk.ZeroOptimizer(make_model(), stage=3, reshard_after_forward="yes")
    # An int is a secondary group's size (tests/zero/test_hybrid.py): one rank has none.
    with pytest.raises(ValueError, match="reshard_after_forward=1 must divide"):
        zk.ZeroOptimizer(make_model(), stage=3, reshard_after_forward=1)


def test_freed_parameter_fails_loudly_and_gathered_reads_it():
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=3)
    w = model.blocks[0].fc.weight
    assert w.numel() == 0 and w.untyped_storage().nbytes() == 0
    with pytest.raises(RuntimeError):
        model.blocks[0].fc(torch.ones(2, 36))
    with pytest.raises(RuntimeError, match="inside `with opt.gathered"):
        model.state_dict()
    with opt.gathered(model.blocks[0]):
        assert w.shape == (144, 36) and torch.isfinite(w).all()
    assert w.numel() == 0


def test_weight_shared_across_units_is_hoisted_to_the_root():
    """blocks.1.fc is blocks.0.fc (one parameter registered in two units): it goes to the root
    unit, gathered whenever any unit runs, and training matches AdamW."""
    torch.set_num_threads(1)
    model = make_model()
    model.blocks[1].fc = model.blocks[0].fc
    ref = copy.deepcopy(model)
    specs = plan_units(model)
    assert set(specs[-1].hoisted) == {"blocks.0.fc.weight", "blocks.0.fc.bias"}
    opt = zk.ZeroOptimizer(model, stage=3, lr=LR, eps=EPS, weight_decay=0.1)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS, weight_decay=0.1)
    root = opt.schedule.units[-1]
    assert id(model.blocks[1].fc.weight) in root.param_ids
    for step, (x, y) in enumerate(make_batches(4, 2)):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        rloss = ref(x, y)
        rloss.backward()
        ropt.step()
        ropt.zero_grad()
        torch.testing.assert_close(loss.item(), rloss.item(), **tol(torch.float32))
        with opt.gathered():
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, **tol(torch.float32),
                                           msg=lambda m, n=n: f"step {step} {n}: {m}")


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_estimate_matches_stats_stage3(param_dtype):
    """estimate_memory(model, stage=3) against stats(): every kind held between steps within
    2% (padding; no reduce buffer is held then), the step's peak buffers against the
    estimate's buffers, the gathered peak under the estimate's transient (the prefetch bound),
    the measured peak total under the estimate's device_bytes."""
    torch.set_num_threads(1)
    model = make_model()
    est = zk.estimate_memory(make_model(), 1, 3, param_dtype=param_dtype)
    opt = zk.ZeroOptimizer(model, stage=3, param_dtype=param_dtype)
    x, y = make_batches(1, 2)[0]
    model(x, y).backward()
    opt.step()
    st = opt.stats()
    mem = st["memory_bytes"]
    for kind in ("params", "grads", "master", "optimizer_states", "held_buffers"):
        want = getattr(est, f"{kind}_bytes")
        got = mem[kind.replace("held_", "")]
        assert abs(got - want) <= 0.02 * max(want, 1), (kind, mem, est)
    assert mem["buffers"] == est.held_buffers_bytes == 0
    peak = st["step_peak_bytes"]
    assert abs(peak["buffers"] - est.buffers_bytes) <= 0.02 * est.buffers_bytes, (peak, est)
    assert st["gather"]["limit_bytes"] <= 1.02 * est.transient_bytes
    assert abs(mem["total"] - est.held_device_bytes) <= 0.02 * est.held_device_bytes
    assert mem["total"] < peak["total"] <= 1.02 * est.device_bytes, (peak, est.device_bytes)


def test_a_backward_that_raises_leaves_nothing_gathered():
    """A backward that raises never runs the end-of-backward callback: the next forward
    closes it (frees what it had gathered) and training goes on."""
    torch.set_num_threads(1)
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=3, lr=LR)
    (x, y), (x2, y2) = make_batches(2, 2)

    def boom(*args):
        raise RuntimeError("boom")

    h = model.blocks[0].register_full_backward_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        model(x, y).backward()
    h.remove()
    opt.zero_grad()
    model(x2, y2).backward()
    assert opt.schedule.live_bytes() == 0 and opt.schedule.phase.name == "IDLE"
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        model(x2, y2)
    assert opt.schedule.live_bytes() == 0
