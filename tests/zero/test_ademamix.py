"""optimizer="ademamix" runs the fused AdEMAMix (the definition zkernels.optimizers.ADEMAMIX
through zkernels/zero/state/fused_rule.py's generic rule: nothing in zkernels/zero names it),
against the single-process oracle zkernels.optimizers.AdEMAMix: one process at stages 1-3,
with CPU and NVMe offload, on every backend this build has; the bf16 state form against the
oracle with its moments rounded to bf16 after each step; its memory (12 B per parameter, 6 in
bf16) by formula and measurement; refusals by name; checkpoints. The multi-rank rows
(hybrid, bf16/fp16 compute, clipping, accumulation) are the battery's (tests/zero/_battery.py,
optim=ademamix), and a wrong beta3 or alpha fails the parity check there (catches_ rows)."""
import pytest
import torch
import torch.nn as nn

import zkernels as zk
from tests.conftest import tol
from zkernels.optimizers import AdEMAMix

# beta3 and alpha warm up over the run, so the schedules are exercised (and the slow EMA moves
# within a few steps).
HP = dict(lr=2e-3, betas=(0.9, 0.99, 0.999), alpha=3.0, beta3_warmup=4, alpha_warmup=3,
          eps=1e-8, weight_decay=0.1)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 5))


def _train(model, opt, steps=5, skip=None, after=None):
    for s in range(steps):
        g = torch.Generator().manual_seed(50 + s)
        x = torch.randn(6, 12, generator=g)
        out = model(x) if skip is None or s != 1 else \
            model[2](torch.relu(x @ model[0].weight.detach().t()))   # layer 0 unused at step 1
        opt.zero_grad()
        out.pow(2).mean().backward()
        opt.step()
        if after is not None:
            after(opt)


def _worst(a, b, opt=None):
    with opt.gathered() if opt is not None else torch.no_grad():
        return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _backends(fp32=True):
    """The reference, and the C++ backend where this build's runs the definitions' generic
    step (``_C.cpu_optimizer_step``) for fp32 states (``fp32``) or bf16 ones."""
    from zkernels import ops
    out = ["reference"]
    try:
        cpp = ops.for_device("cpu", "cpp")
        if cpp.optimizer_backend("ademamix", fp32=fp32) == "cpp":
            out.append("cpp")
    except (RuntimeError, ValueError):
        pass
    return out


def _rung_kw(offload, tmp_path):
    if offload == "nvme":
        return dict(offload="nvme", offload_dir=str(tmp_path))
    return dict(offload=offload)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("stage, offload", [(1, None), (2, None), (3, None), (2, "cpu"),
                                            (3, "cpu"), (2, "nvme"), (3, "nvme")])
def test_matches_the_oracle(stage, offload, backend, tmp_path):
    ours, ref = _model(), _model()
    opt = zk.ZeroOptimizer(ours, stage=stage, optimizer="ademamix", ops_backend=backend,
                           **_rung_kw(offload, tmp_path), **HP)
    assert opt.optimizer_names == ["ademamix"]
    _train(ours, opt)
    _train(ref, AdEMAMix(ref.parameters(), **HP))
    assert _worst(ours, ref, opt) <= tol(torch.float32)["atol"], (stage, offload, backend)
    assert _worst(ours, _model(), opt) > 1e-4, "it trained"
    opt.close()


@pytest.mark.parametrize("wrong", [dict(betas=(0.9, 0.99, 0.99)), dict(alpha=2.5),
                                   dict(beta3_warmup=None), dict(alpha_warmup=None)], ids=str)
def test_catches_a_wrong_hyperparameter(wrong):
    """The parity check fails when ours runs another beta3, alpha or schedule than the
    oracle's (the single-process twin of the battery's catches_ rows)."""
    ours, ref = _model(), _model()
    opt = zk.ZeroOptimizer(ours, stage=2, optimizer="ademamix", **{**HP, **wrong})
    _train(ours, opt)
    _train(ref, AdEMAMix(ref.parameters(), **HP))
    assert _worst(ours, ref, opt) > tol(torch.float32)["atol"], wrong


def _round_moments(ref_opt):
    """The bf16 form in the oracle: each moment rounded to bf16 (nearest even) after the
    step, widened again before the next."""
    for st in ref_opt.state.values():
        for k in ("exp_avg_fast", "exp_avg_slow", "exp_avg_sq"):
            st[k].copy_(st[k].bfloat16().float())


@pytest.mark.parametrize("backend", _backends(fp32=False))
@pytest.mark.parametrize("stage, offload", [(2, None), (3, None), (2, "cpu"), (3, "nvme")])
def test_bf16_state_matches_the_rounded_oracle(stage, offload, backend, tmp_path):
    ours, ref = _model(), _model()
    opt = zk.ZeroOptimizer(ours, stage=stage, optimizer="ademamix", state_dtype="bf16",
                           ops_backend=backend, **_rung_kw(offload, tmp_path), **HP)
    ref_opt = AdEMAMix(ref.parameters(), **HP)
    _train(ours, opt)
    _train(ref, ref_opt, after=lambda o: _round_moments(o))
    for st in opt.state_dict()["state"].values():   # (NVMe: read from its bf16 files)
        assert all(st[k].dtype == torch.bfloat16 for k in st if k != "step"), st.keys()
    if offload == "nvme":   # three bf16 files per unit: 2 B per element on disk
        files = [f for rec in opt.shard_update.states for f in rec.rule.swaps.values()]
        assert len(files) == 3 * len(opt.units)
        assert all(f.dtype == torch.bfloat16 and f.data_bytes < f.numel * 2 + 4096
                   for f in files)
    assert _worst(ours, ref, opt) <= tol(torch.float32)["atol"], (stage, offload, backend)
    # ... and without the rounding in the oracle it is another optimizer (the check sees it)
    ref2 = _model()
    _train(ref2, AdEMAMix(ref2.parameters(), **HP))
    assert _worst(ours, ref2, opt) > tol(torch.float32)["atol"]


def test_memory_is_twelve_bytes_per_parameter():
    n = sum(p.numel() for p in _model().parameters())
    est = zk.estimate_memory(_model(), 1, 2, optimizer="ademamix")
    assert est.optimizer_states_bytes == 12 * n
    est = zk.estimate_memory(_model(), 1, 2, optimizer="ademamix", state_dtype="bf16")
    assert est.optimizer_states_bytes == 6 * n
    for form, per in ((None, 12), ("bf16", 6)):
        m = _model()
        opt = zk.ZeroOptimizer(m, stage=2, optimizer="ademamix", state_dtype=form, **HP)
        _train(m, opt, steps=1)
        assert opt.stats()["memory_bytes"]["optimizer_states"] == \
            per * sum(u.layout.shard_numel for u in opt.units), form


def test_plan_takes_ademamix(capsys):
    from zkernels.plan import main
    assert main(["--params", "1e9", "--world-size", "8", "--optimizer", "ademamix",
                 "--param-dtype", "fp32"]) == 0
    text = capsys.readouterr().out
    stage1 = next(line for line in text.splitlines() if line.strip().startswith("stage 1 "))
    assert stage1.split()[5] == "1.5", stage1   # 12 B x 1e9 / 8 ranks in the optim column
    assert main(["--params", "1e9", "--world-size", "8", "--optimizer", "ademamix",
                 "--state-dtype", "int8"]) != 0
    assert "no blockwise int8 code is built" in capsys.readouterr().err


@pytest.mark.parametrize("kw, err, match", [
    (dict(state_dtype="int8"), ValueError,
     "state_dtype='int8' is not supported by optimizer='ademamix': no blockwise int8"),
    (dict(momentum=0.9), TypeError, "optimizer='ademamix' .the fused op. takes lr, betas"),
    (dict(betas=(0.9, 0.999)), ValueError, "optimizer='ademamix': betas must be a tuple of 3"),
    (dict(alpha=-1.0), ValueError, "optimizer='ademamix': alpha must be a finite number >= 0"),
    (dict(beta3_warmup=0), ValueError, "optimizer='ademamix': beta3_warmup must be None or"),
    (dict(master_dtype=torch.bfloat16, param_dtype=torch.bfloat16), ValueError,
     "master_dtype=torch.bfloat16 applies to the fused AdamW only"),
], ids=str)
def test_refused_by_name(kw, err, match):
    with pytest.raises(err, match=match):
        zk.ZeroOptimizer(_model(), stage=2, optimizer="ademamix", **kw)


def test_unused_parameter_keeps_its_state_and_step():
    """Step 1 leaves layer 0 without a gradient: torch skips it (state, step); so do we, and
    its warmups count its own steps."""
    ours, ref = _model(), _model()
    opt = zk.ZeroOptimizer(ours, stage=2, optimizer="ademamix", **HP)
    _train(ours, opt, skip=True)
    _train(ref, AdEMAMix(ref.parameters(), **HP), skip=True)
    assert _worst(ours, ref, opt) <= tol(torch.float32)["atol"]


def test_state_dict_round_trip():
    m = _model()
    opt = zk.ZeroOptimizer(m, stage=2, optimizer="ademamix", **HP)
    _train(m, opt, steps=2)
    sd = opt.state_dict()
    assert sorted(sd["state"][0]) == ["exp_avg_fast", "exp_avg_slow", "exp_avg_sq", "step"]
    m2 = _model(seed=3)
    opt2 = zk.ZeroOptimizer(m2, stage=2, optimizer="ademamix", **HP)
    opt2.load_state_dict(sd)
    _train(m, opt, steps=3)
    _train(m2, opt2, steps=3)
    assert _worst(m, m2) == 0.0


@pytest.mark.parametrize("form", [None, "bf16"])
def test_checkpoint_resumes_at_another_stage_and_offload(tmp_path, form):
    """zk.checkpoint saves the pieces' state under the definition's names with their step; it
    resumes at stage 3, with CPU offload and on NVMe as if never stopped (the warmups continue
    from the saved step), and the state is really restored."""
    m = _model()
    opt = zk.ZeroOptimizer(m, stage=2, optimizer="ademamix", state_dtype=form, **HP)
    _train(m, opt, steps=2)
    zk.checkpoint.save(opt, str(tmp_path / "ck"))
    _train(m, opt, steps=3)
    rungs = [(3, None, False), (2, "cpu", False), (3, None, True), (2, "nvme", False)]
    for stage, offload, zero in rungs:
        m2 = _model(seed=4)
        opt2 = zk.ZeroOptimizer(m2, stage=stage, optimizer="ademamix", state_dtype=form,
                                **_rung_kw(offload, tmp_path), **HP)
        zk.checkpoint.load(opt2, str(tmp_path / "ck"))
        if zero:
            for rec in opt2.shard_update.states:
                for t in rec.rule.flat.values():
                    t.zero_()
        _train(m2, opt2, steps=3)
        worst = _worst(m, m2, opt2)
        assert (worst > 1e-6) if zero else (worst <= tol(torch.float32)["atol"]), \
            (stage, offload, zero, worst)
        opt2.close()
