"""optimizer="lion" and optimizer="sgd" run the fused ops (zkernels.ops lion_step /
sgd_step: [Note: fused Lion and SGD] in zkernels/zero/state/fused_rule.py): one process at
stages 1-3 and with CPU offload against the reference Lion and torch.optim.SGD, on every
backend this build has; Lion's memory is 4 B per parameter (formula and measurement); an
unused parameter keeps its state and step; the state round-trips through state_dict. The
2- and 4-rank rows are the battery's (tests/zero/_battery.py, optim=lion / sgd_fused)."""
import pytest
import torch
import torch.nn as nn

import zkernels as zk
from tests.conftest import tol
from tests.zero._battery import RefLion

LION = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
SGD = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 5))


def _train(model, opt, steps=3, skip=None):
    for s in range(steps):
        g = torch.Generator().manual_seed(50 + s)
        x = torch.randn(6, 12, generator=g)
        out = model(x) if skip is None or s != 1 else \
            model[2](torch.relu(x @ model[0].weight.detach().t()))   # layer 0 unused at step 1
        opt.zero_grad()
        out.pow(2).mean().backward()
        opt.step()


def _worst(a, b, opt=None):
    with opt.gathered() if opt is not None else torch.no_grad():
        return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _backends():
    """The reference, and the C++ backend where this build's runs the definitions' generic
    step (``_C.cpu_optimizer_step``)."""
    from zkernels import ops
    out = ["reference"]
    try:
        cpp = ops.for_device("cpu", "cpp")
        if all(cpp.optimizer_backend(n) == "cpp" for n in ("lion", "sgd",)):
            out.append("cpp")
    except (RuntimeError, ValueError):
        pass
    return out


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("stage, offload", [(1, None), (2, None), (3, None), (2, "cpu")])
def test_lion_and_sgd_match_their_oracles(stage, offload, backend):
    for name, hp, oracle in (("lion", LION, RefLion), ("sgd", SGD, torch.optim.SGD)):
        ours, ref = _model(), _model()
        opt = zk.ZeroOptimizer(ours, stage=stage, offload=offload, optimizer=name,
                               ops_backend=backend, **hp)
        assert opt.optimizer_names == [name]
        _train(ours, opt)
        _train(ref, oracle(ref.parameters(), **hp))
        assert _worst(ours, ref, opt) <= tol(torch.float32)["atol"], (name, stage, offload)
        assert _worst(ours, _model(), opt) > 1e-4, "it trained"
        opt.close()


def test_lion_memory_is_four_bytes_per_parameter():
    n = sum(p.numel() for p in _model().parameters())
    est = zk.estimate_memory(_model(), 1, 2, optimizer="lion")
    assert est.optimizer_states_bytes == 4 * n
    assert zk.estimate_memory(_model(), 1, 2, optimizer="sgd").optimizer_states_bytes == 0
    m = _model()
    opt = zk.ZeroOptimizer(m, stage=2, optimizer="lion", **LION)
    _train(m, opt, steps=1)
    assert opt.stats()["memory_bytes"]["optimizer_states"] == \
        4 * sum(u.layout.shard_numel for u in opt.units)


def test_unused_parameter_keeps_its_state_and_step():
    """Step 1 leaves layer 0 without a gradient: torch skips it (state, step); so do we."""
    for name, hp, oracle in (("lion", LION, RefLion), ("sgd", SGD, torch.optim.SGD)):
        ours, ref = _model(), _model()
        opt = zk.ZeroOptimizer(ours, stage=2, optimizer=name, **hp)
        _train(ours, opt, skip=True)
        _train(ref, oracle(ref.parameters(), **hp), skip=True)
        assert _worst(ours, ref, opt) <= tol(torch.float32)["atol"], name


def test_state_dict_round_trip():
    m = _model()
    opt = zk.ZeroOptimizer(m, stage=2, optimizer="sgd", **SGD)
    _train(m, opt, steps=2)
    sd = opt.state_dict()
    assert sorted(sd["state"][0]) == ["momentum_buffer", "step"]
    m2 = _model(seed=3)
    opt2 = zk.ZeroOptimizer(m2, stage=2, optimizer="sgd", **SGD)
    opt2.load_state_dict(sd)
    _train(m, opt, steps=2)
    _train(m2, opt2, steps=2)
    assert _worst(m, m2) == 0.0
    lion = zk.ZeroOptimizer(_model(), stage=2, optimizer="lion", **LION)
    with pytest.raises(ValueError, match="holds sgd state for param_groups.0. but this "
                                         "optimizer runs lion"):
        lion.load_state_dict(sd)


@pytest.mark.parametrize("name, hp", [("lion", LION), ("sgd", SGD)])
def test_checkpoint_resumes_at_another_stage_and_offload(tmp_path, name, hp):
    """zk.checkpoint saves the pieces' state under torch's keys with their step; it resumes
    at stage 3 and with CPU offload as if never stopped, and the state is really restored."""
    m = _model()
    opt = zk.ZeroOptimizer(m, stage=2, optimizer=name, **hp)
    _train(m, opt, steps=2)
    zk.checkpoint.save(opt, str(tmp_path / "ck"))
    _train(m, opt, steps=2)
    for stage, offload, zero in ((3, None, False), (2, "cpu", False), (3, None, True)):
        m2 = _model(seed=4)
        opt2 = zk.ZeroOptimizer(m2, stage=stage, offload=offload, optimizer=name, **hp)
        zk.checkpoint.load(opt2, str(tmp_path / "ck"))
        if zero:
            for rec in opt2.shard_update.states:
                for t in rec.rule.flat.values():
                    t.zero_()
        _train(m2, opt2, steps=2)
        worst = _worst(m, m2, opt2)
        assert (worst > 1e-6) if zero else (worst <= tol(torch.float32)["atol"]), \
            (stage, offload, zero, worst)
        opt2.close()
