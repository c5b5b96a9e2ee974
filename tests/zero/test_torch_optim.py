"""ZeroOptimizer(optimizer=<torch.optim class>) in one process (issue 26): every element-wise
class against itself on the whole model, per-group optimizers, the memory it holds and the
estimate's, the refusals by name. Multi-rank parity rows: tests/zero/_battery.py (optim=)."""
import copy

import pytest
import torch
import torch.nn as nn

import zkernels as zk
from tests.conftest import tol
from zkernels.zero.planning.optimizer_spec import ELEMENTWISE, resolve_optimizer

HPARAMS = {
    torch.optim.SGD: dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
    torch.optim.Adam: dict(lr=1e-2, amsgrad=True),
    torch.optim.AdamW: dict(lr=1e-2, weight_decay=0.1),
    torch.optim.Adamax: dict(lr=1e-2),
    torch.optim.NAdam: dict(lr=1e-2),
    torch.optim.RAdam: dict(lr=1e-2),
    torch.optim.RMSprop: dict(lr=1e-2, momentum=0.5, centered=True),
    torch.optim.Adagrad: dict(lr=0.05),
    torch.optim.Adadelta: dict(lr=1.0),
    torch.optim.Rprop: dict(lr=1e-2),
    torch.optim.ASGD: dict(lr=1e-2, t0=1.0),
}


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 5))


def _train(model, opt, steps=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(6, 12, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def _worst(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def test_every_class_is_tested():
    assert set(HPARAMS) == set(ELEMENTWISE)


@pytest.mark.parametrize("cls", list(HPARAMS), ids=lambda c: c.__name__)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_class_on_shards_matches_the_class(cls, stage):
    """Four steps on one rank (the shard is the whole unit, several parameters per unit)
    against the class over the model's parameters: fp32 round-off only (the same ops on the
    same values, the gradient divided by a 1/N of 1)."""
    ours, ref = _model(), _model()
    opt = zk.ZeroOptimizer(ours, stage=stage, optimizer=cls, **HPARAMS[cls])
    _train(ours, opt)
    _train(ref, cls(ref.parameters(), **HPARAMS[cls]))
    with opt.gathered():
        for (n, p), q in zip(ours.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **tol(torch.float32), msg=n)
        moved = _worst(ours, _model())
    assert moved > 1e-4, "the optimizer did not train"


def test_sgd_name_and_lr_default_is_the_class():
    ours, ref = _model(), _model()
    opt = zk.ZeroOptimizer(ours, stage=2, optimizer="sgd", momentum=0.9, nesterov=True)
    assert opt.param_groups[0]["lr"] == torch.optim.SGD([torch.zeros(1)]).defaults["lr"]
    _train(ours, opt)
    _train(ref, torch.optim.SGD(ref.parameters(), momentum=0.9, nesterov=True))
    assert _worst(ours, ref) <= 1e-6


def test_per_group_optimizer_and_scheduler():
    """Group 0 SGD with momentum, group 1 the fused AdamW; a LambdaLR on both sides."""
    ours, ref = _model(), _model()
    groups = lambda m: [{"params": list(m[0].parameters()), "optimizer": torch.optim.SGD,  # noqa
                         "lr": 0.05, "momentum": 0.9}, {"params": list(m[2].parameters())}]
    opt = zk.ZeroOptimizer(ours, stage=2, lr=1e-2, param_groups=groups(ours))
    assert [s.name for s in opt.optimizer_specs] == ["SGD", "adamw"]
    assert "optimizer" not in opt.param_groups[0] and opt.param_groups[0]["momentum"] == 0.9
    ref_g = groups(ref)
    sgd = torch.optim.SGD(ref_g[0]["params"], lr=0.05, momentum=0.9)
    adamw = torch.optim.AdamW(ref_g[1]["params"], lr=1e-2, weight_decay=0.0)
    lam = lambda s: 1.0 / (1 + s)  # noqa: E731
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lam) for o in (opt, sgd, adamw)]
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(6, 12, generator=g)
        for m, os_ in ((ours, (opt,)), (ref, (sgd, adamw))):
            for o in os_:
                o.zero_grad()
            m(x).pow(2).mean().backward()
            for o in os_:
                o.step()
        for s in scheds:
            s.step()
    assert _worst(ours, ref) <= 1e-6


@pytest.mark.parametrize("cls, kw, per_elem", [
    (torch.optim.SGD, dict(momentum=0.9), 4), (torch.optim.SGD, {}, 0),
    (torch.optim.Adam, {}, 8), (torch.optim.Adagrad, {}, 4),
    (torch.optim.RMSprop, dict(momentum=0.5, centered=True), 12)], ids=str)
def test_state_bytes_measured_and_estimated(cls, kw, per_elem):
    """stats() measures the class's state (flattened with the master shard) and
    estimate_memory predicts it from the class and its hyperparameters."""
    model = _model()
    opt = zk.ZeroOptimizer(model, stage=2, optimizer=cls, **kw)
    _train(model, opt, steps=1)
    shard = sum(u.layout.shard_numel for u in opt.units)
    assert opt.stats()["memory_bytes"]["optimizer_states"] == per_elem * shard
    est = zk.estimate_memory(model, 1, 2, optimizer=cls, optimizer_kwargs=kw)
    assert est.optimizer_states_bytes == per_elem * sum(p.numel() for p in model.parameters())
    assert zk.estimate_memory(10 ** 6, 4, 1, optimizer="adamw").optimizer_states_bytes == \
        8 * 10 ** 6 // 4


def test_state_is_the_flat_buffer():
    """After a step the class's state tensors are views of the flat shard buffer (so a
    checkpoint and stats() read what the class updates)."""
    model = _model()
    opt = zk.ZeroOptimizer(model, stage=1, optimizer=torch.optim.SGD, lr=0.1, momentum=0.9)
    _train(model, opt, steps=2)
    rule = opt.shard_update.states[0].rule
    flat = rule.flat["momentum_buffer"]
    for p, (s, n) in zip(rule.pieces, rule.slices):
        buf = rule.inner.state[p]["momentum_buffer"]
        assert buf.data_ptr() == flat[s:s + n].data_ptr()
    assert flat.abs().sum() > 0


def test_declared_elementwise_class():
    class MySGD(torch.optim.SGD):
        pass

    with pytest.raises(ValueError, match="MySGD is not known to be element-wise.*elementwise=True"):
        zk.ZeroOptimizer(_model(), optimizer=MySGD, lr=0.1)
    ours, ref = _model(), _model()
    opt = zk.ZeroOptimizer(ours, stage=2, optimizer=MySGD, elementwise=True, lr=0.1)
    _train(ours, opt)
    _train(ref, torch.optim.SGD(ref.parameters(), lr=0.1))
    assert _worst(ours, ref) <= 1e-6


@pytest.mark.parametrize("optimizer, kw, err, match", [
    (torch.optim.LBFGS, {}, ValueError, "LBFGS is refused: its step.. re-evaluates a closure"),
    (torch.optim.SparseAdam, {}, ValueError, "SparseAdam is refused: it takes sparse"),
    ("lion", {"momentum": 0.9}, TypeError, "optimizer='lion' .the fused op. takes lr, betas"),
    ("lion", {"betas": (1.5, 0.99)}, ValueError,
     r"optimizer='lion': betas\[0\] \(beta1\) must be a number in \[0, 1\], got 1.5"),
    ("sgd", {"nesterov": True}, ValueError, "optimizer='sgd': nesterov needs momentum"),
    ("muonn", {}, ValueError, "optimizer='muonn' is not a known name"),
    (42, {}, TypeError, "optimizer must be a name"),
    ("adamw", {"momentum": 0.9}, TypeError, "optimizer='adamw' takes lr, betas.*momentum"),
    (torch.optim.SGD, {"momentum": -1.0}, ValueError, "momentum"),
    (torch.optim.SGD, {"betas": (0.9, 0.99)}, TypeError, "betas"),
], ids=str)
def test_refused_by_name(optimizer, kw, err, match):
    with pytest.raises(err, match=match):
        zk.ZeroOptimizer(_model(), stage=2, optimizer=optimizer, **kw)


def test_matrix_classes_resolve_as_whole_matrix_rules():
    """Muon and Adafactor run on whole matrices (tests/zero/test_matrix_optim.py), by class
    or by name."""
    assert resolve_optimizer(torch.optim.Muon, {}).matrix
    assert resolve_optimizer("adafactor", {"lr": 0.01}).matrix
    assert not resolve_optimizer(torch.optim.SGD, {}).matrix


def test_group_optimizer_refused_names_the_group():
    m = _model()
    with pytest.raises(ValueError, match=r"param_groups\[1\]: optimizer=torch.optim.LBFGS"):
        zk.ZeroOptimizer(m, param_groups=[{"params": list(m[0].parameters())},
                                          {"params": list(m[2].parameters()),
                                           "optimizer": torch.optim.LBFGS}])


def test_nvme_takes_every_optimizer(tmp_path):
    """(offload='nvme' runs the element-wise classes and the fused Lion/SGD, master on disk
    by default, and Muon/Adafactor: tests/zero/test_rule_nvme.py)"""
    opt = zk.ZeroOptimizer(_model(), stage=2, optimizer="sgd", offload="nvme",
                           offload_dir=str(tmp_path))
    assert opt.shard_update.states[0].master.is_meta   # nvme_master, the default
    opt.close()
    est = zk.estimate_memory(10 ** 6, 2, 2, optimizer="sgd", offload="nvme")
    assert est.by_location["disk"]["master"] == 4 * 10 ** 6 // 2
    # Muon: the owners' whole masters and state (8 B) on disk, its shard master in RAM
    est = zk.estimate_memory(10 ** 6, 2, 2, optimizer=torch.optim.Muon, offload="nvme")
    assert est.by_location["disk"]["optimizer_states"] == 8 * 10 ** 6 // 2
    assert est.by_location["host"]["master"] == 4 * 10 ** 6 // 2


def test_plan_takes_the_optimizer(capsys):
    from zkernels.plan import main
    assert main(["--params", "1e9", "--world-size", "8", "--optimizer", "sgd",
                 "--momentum", "0.9", "--param-dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "fp32 sgd" in out and "stage 2 + nvme offload" in out   # (master on disk too)
    stage2 = next(line for line in out.splitlines() if line.strip().startswith("stage 2 "))
    assert stage2.split()[5] == "0.5"   # optim column: 4 B x 1e9 / 8 ranks, in GB
    assert main(["--params", "1e9", "--world-size", "8", "--optimizer", "lbfgs"]) == 2


@pytest.mark.parametrize("stage", [1, 3])
def test_state_dict_follows_the_class_format_and_round_trips(stage):
    """opt.state_dict() with a torch class: per parameter index the class's own keys (as
    torch.optim.SGD's state_dict has them, here the whole parameter: one rank), the groups'
    hyperparameters; loading it into a fresh optimizer continues bit for bit; loading it
    into another optimizer is refused by name, as is the AdamW format into SGD."""
    kw = dict(lr=0.05, momentum=0.9)
    ours, ref = _model(), _model()
    opt = zk.ZeroOptimizer(ours, stage=stage, optimizer=torch.optim.SGD, **kw)
    torch_opt = torch.optim.SGD(ref.parameters(), **kw)
    _train(ours, opt, steps=2)
    _train(ref, torch_opt, steps=2)
    sd, tsd = opt.state_dict(), torch_opt.state_dict()
    assert sorted(sd["state"]) == sorted(tsd["state"])
    for i, st in tsd["state"].items():
        assert set(sd["state"][i]) >= set(st)
        torch.testing.assert_close(sd["state"][i]["momentum_buffer"],
                                   st["momentum_buffer"].reshape(-1), **tol(torch.float32))
    assert {k: v for k, v in sd["param_groups"][0].items() if k in tsd["param_groups"][0]} \
        == tsd["param_groups"][0]
    # resume: a fresh optimizer loading sd continues as the original does
    again = _model(seed=5)
    opt2 = zk.ZeroOptimizer(again, stage=stage, optimizer=torch.optim.SGD, **kw)
    opt2.load_state_dict(sd)
    _train(ours, opt, steps=2, seed=7)
    _train(again, opt2, steps=2, seed=7)
    with opt.gathered(), opt2.gathered():
        for p, q in zip(ours.parameters(), again.parameters()):
            assert torch.equal(p, q)
    # the momentum buffer is restored, not zero: a run without it differs
    fresh = _model(seed=5)
    opt3 = zk.ZeroOptimizer(fresh, stage=stage, optimizer=torch.optim.SGD, **kw)
    sd3 = {**sd, "state": {i: {k: (torch.zeros_like(v) if k == "momentum_buffer" else v)
                               for k, v in st.items()} for i, st in sd["state"].items()}}
    opt3.load_state_dict(sd3)
    _train(fresh, opt3, steps=2, seed=7)
    with opt.gathered(), opt3.gathered():
        assert _worst(ours, fresh) > 1e-6
    other = zk.ZeroOptimizer(_model(), stage=stage, optimizer=torch.optim.Adagrad)
    with pytest.raises(ValueError, match=r"holds SGD state for param_groups\[0\] but this "
                                         r"optimizer runs Adagrad"):
        other.load_state_dict(sd)
    adamw = zk.ZeroOptimizer(_model(), stage=stage)
    with pytest.raises(ValueError, match=r"holds adamw state .* runs SGD"):
        opt2.load_state_dict(adamw.state_dict())


def test_default_adamw_state_dict_format_unchanged():
    """The fused AdamW's state_dict keeps its keys (per unit: step, master, moments, and each
    parameter's own step count: [Note: unused parameters]) and "zero" gains nothing from the
    optimizer choice."""
    model = _model()
    opt = zk.ZeroOptimizer(model, stage=2)
    _train(model, opt, steps=1)
    sd = opt.state_dict()
    assert sorted(sd["state"][0]) == ["exp_avg", "exp_avg_sq", "master", "param_steps", "step"]
    assert sorted(sd["zero"]) == ["buckets", "loss_scaler", "num_steps", "overflow_skips",
                                  "param_dtype", "rank", "stage", "world_size"]
    assert sorted(sd["param_groups"][0]) == ["betas", "eps", "lr", "params", "weight_decay"]



@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_compute_copy_from_the_fp32_master(stage):
    """param_dtype=bf16: the class steps the fp32 masters with the widened bf16 gradients,
    the compute copy is the master rounded; against that recipe in one process (SGD with
    momentum on fp32 masters), the compute parameters within tol(bfloat16)."""
    kw = dict(lr=0.05, momentum=0.9)
    ours = _model()
    master = _model()
    compute = copy.deepcopy(master).to(torch.bfloat16)
    opt = zk.ZeroOptimizer(ours, stage=stage, param_dtype=torch.bfloat16,
                           optimizer=torch.optim.SGD, **kw)
    ref = torch.optim.SGD(master.parameters(), **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(6, 12, generator=g).to(torch.bfloat16)
        opt.zero_grad()
        ours(x).float().pow(2).mean().backward()
        opt.step()
        compute.zero_grad()
        compute(x).float().pow(2).mean().backward()
        for q, c in zip(master.parameters(), compute.parameters()):
            q.grad = c.grad.float()
        ref.step()
        with torch.no_grad():
            for q, c in zip(master.parameters(), compute.parameters()):
                c.copy_(q)
    with opt.gathered():
        for p, c in zip(ours.parameters(), compute.parameters()):
            assert p.dtype == torch.bfloat16
            torch.testing.assert_close(p, c, **tol(torch.bfloat16))


def test_fp16_overflow_skips_the_class_step():
    """fp16 loss scaling: a step with an inf gradient changes neither the parameters nor
    the class's state, and halves the scale."""
    model = _model()
    opt = zk.ZeroOptimizer(model, stage=2, param_dtype=torch.float16, optimizer="sgd",
                           lr=0.05, momentum=0.9)
    x = torch.randn(6, 12).half()
    opt.backward(model(x).float().pow(2).mean())
    opt.step()
    opt.zero_grad()
    buf = opt.shard_update.states[0].rule.flat["momentum_buffer"].clone()
    before = [p.detach().clone() for p in model.parameters()]
    scale = opt.stats()["loss_scale"]
    opt.backward(model(x).float().pow(2).mean() * float("inf"))
    opt.step()
    assert opt.step_was_skipped and opt.stats()["loss_scale"] == scale / 2
    assert torch.equal(opt.shard_update.states[0].rule.flat["momentum_buffer"], buf)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
