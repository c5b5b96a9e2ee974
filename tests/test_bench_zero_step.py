"""benchmarks/zero_step.py's method table (benchmarks/_zero_step_methods.py): every row builds
what it hands its library, the flags name only rows, and the before/after comparison's ratios.
No ranks are spawned here except in the slow end-to-end run."""
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")


BENCH_MODULES = ("zero_step", "_zero_step_methods", "_zero_step_report", "_zero_step_trees",
                 "_comm_meter")


@pytest.fixture
def bench(monkeypatch):
    """The benchmark's modules, imported from benchmarks/; sys.path restored and the modules
    dropped afterwards."""
    monkeypatch.setattr(sys, "path", [BENCH] + sys.path)

    def load(name):
        spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, name + ".py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod

    yield load
    for name in BENCH_MODULES:
        sys.modules.pop(name, None)


def _ctx(methods):
    return methods.Context(lr=1e-3, world_size=4, batch_size=8, shard_size=2,
                           offload_dir="/tmp/zk-bench-test-unused", nvme_budget=4096)


def test_every_row_configures(bench):
    m = bench("_zero_step_methods")
    accepted = m.zero_keywords()
    for name, spec in m.METHODS.items():
        assert spec.lib in m.LIBRARIES, name
        ctx = _ctx(m)
        wanted = m.resolve(name, ctx.shard_size)
        assert m.K not in wanted.values(), name
        if spec.lib == "zk":
            missing = [k for k in wanted if k not in accepted]
            if missing:  # issue 17's options, until the tree has them
                with pytest.raises(m.MethodUnavailable, match=f"needs {missing[0]}"):
                    m.configure(name, ctx)
                continue
            kw = m.configure(name, ctx)
            assert set(kw) <= set(accepted), name
            assert kw["lr"] == 1e-3 and all(kw[k] == v for k, v in wanted.items()), name
            assert ("offload_config" in kw) == ("offload" in wanted), name
            assert kw.get("offload_dir") == (ctx.offload_dir if wanted.get("offload") == "nvme"
                                             else None), name
        elif spec.lib == "deepspeed":
            cfg = m.configure(name, ctx)
            zo = cfg["zero_optimization"]
            assert zo["stage"] == wanted["stage"] and cfg["gradient_clipping"] == 0, name
            assert cfg["train_micro_batch_size_per_gpu"] == 8, name
            assert (zo.get("stage3_param_persistence_threshold") == 0) == (zo["stage"] == 3)
            assert ("optimizer" in cfg) == ("offload_optimizer" in wanted), name
            for key in ("zero_quantized_weights", "zero_quantized_gradients",
                        "zero_hpz_partition_size"):
                assert zo.get(key) == wanted.get(key), (name, key)
        else:
            assert m.configure(name, ctx) == wanted, name


def test_rows_refuse_what_they_cannot_build(bench):
    m = bench("_zero_step_methods")
    ctx = m.Context(lr=1e-3, world_size=2)  # no --shard-size
    for name in ("fsdp2_hsdp", "fsdp2_hpz", "zk_stage3_hybrid", "zk_stage3_hpz", "ds_stage3_hpz"):
        with pytest.raises(ValueError, match="needs --shard-size"):
            m.configure(name, ctx)
    with pytest.raises(ValueError, match="method must be one of"):
        m.configure("zk_stage4", ctx)
    m.METHODS["bad_row"] = m.Spec("fsdp2", {"no_such_keyword": 1})
    try:
        with pytest.raises(TypeError, match="no_such_keyword"):
            m.configure("bad_row", ctx)
    finally:
        del m.METHODS["bad_row"]


def test_flags_and_docs_name_only_rows(bench):
    m = bench("_zero_step_methods")
    zs = bench("zero_step")
    for group in (zs.ALL_METHODS, zs.OFFLOAD_SET, zs.HYBRID_SET, zs.QUANT_SET,
                  zs.BASELINE_SET):
        assert set(group) <= set(m.METHODS)
    named = set()
    docs = sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                  if f.endswith(".md"))
    for doc in ["README.md", os.path.join("benchmarks", "README.md")] + docs:
        with open(os.path.join(ROOT, doc)) as f:
            named |= {n for arg in re.findall(r"--methods[ =]+([\w,]+)", f.read())
                      for n in arg.split(",") if n}
    assert named and named <= set(m.METHODS), sorted(named - set(m.METHODS))
    assert zs._parse_args(["--dtype", "bfloat16"]).methods == [
        "ddp", "torch_zero", "fsdp2", "zk_stage1", "zk_stage2"]
    assert zs._parse_args(["--quantized"]).methods == list(zs.QUANT_SET)
    assert zs._parse_args(["--baseline-tree", ROOT]).methods == list(zs.BASELINE_SET)
    assert zs._parse_args(["--methods", "zk_stage2"]).methods == ["ddp", "zk_stage2"]
    with pytest.raises(SystemExit):
        zs._parse_args(["--baseline-tree", os.path.join(ROOT, "benchmarks")])
    with pytest.raises(SystemExit):
        zs._parse_args(["--methods", "zk_stage9"])


def _row(method, times, mem=10, sent=5, loss=1.0):
    return {"method": method, "step_times_s": times,
            "memory_bytes_per_rank": {"params": mem, "grads": 0, "master": 0,
                                      "optimizer_states": 0, "buffers": 0, "total": mem},
            "comm_bytes_per_rank": {"total": sent}, "final_loss": loss}


def test_compare_trees_ratios(bench):
    r = bench("_zero_step_report")
    qw = {"method": "zk_stage3_qw", "error": "needs quantize_weights (not in this tree)"}
    qwb = dict(qw, method="zk_stage3_qw@before")
    # each step of the row over its twin's step in the same round: 2, 2, 3, 1 -> median 2
    runs = [[_row("ddp", [1, 1]), _row("zk_stage2", [2, 4], 100, 8), qw,
             _row("zk_stage2@before", [1, 2], 80, 4, 2.0), qwb],
            [_row("ddp", [2, 2]), _row("zk_stage2", [3, 1], 100, 8), _row("zk_stage3_qw", [1]),
             _row("zk_stage2@before", [1, 1], 80, 4, 2.0), qwb]]
    cmp = r.compare_trees(runs)
    assert set(cmp) == {"zk_stage2", "zk_stage3_qw"}
    z = cmp["zk_stage2"]
    assert z["step_time_ratio"] == 2.0 and z["step_time_ratio_medians"] == 2.5 / 1.0
    assert z["memory_ratio"] == 1.25 and z["memory_equal"] is False
    assert z["traffic_ratio"] == 2.0 and z["final_loss"] == {"after": 1.0, "before": 2.0}
    assert cmp["zk_stage3_qw"]["error"] == "after: needs quantize_weights (not in this tree)"
    text = r.format_baseline(cmp, "/base", 2)
    assert "zk_stage2" in text and "not compared: after: needs quantize_weights" in text


@pytest.mark.slow  # a launch of 2 gloo ranks (~30-60 s on the shared 2-core machine)
def test_before_after_run_end_to_end(tmp_path):
    """This tree against a copy of its zkernels package: the before/after columns of the same
    code agree to the byte (memory, traffic) and the loss to the bit; each rank imported each
    tree from where it was told (the run checks it)."""
    out, base = tmp_path / "zs.json", tmp_path / "base"
    shutil.copytree(os.path.join(ROOT, "zkernels"), base / "zkernels",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, PYTHONPATH=ROOT)
    subprocess.run([sys.executable, os.path.join(BENCH, "zero_step.py"), "--config", "tiny",
                    "--steps", "2", "--warmup", "1", "--methods", "zk_stage2,zk_stage3",
                    "--baseline-tree", str(base), "--json", str(out), "--timeout-s", "300"],
                   check=True, env=env, cwd=str(tmp_path), capture_output=True, timeout=600)
    data = json.loads(out.read_text())
    assert data["meta"]["baseline_tree"] == str(base)
    for name in ("zk_stage2", "zk_stage3"):
        c = data["baseline"][name]
        assert c["memory_equal"] and c["memory_ratio"] == 1.0 and c["traffic_ratio"] == 1.0
        assert c["final_loss"]["after"] == c["final_loss"]["before"]
        assert c["step_time_ratio"] > 0


@pytest.mark.slow  # imports deepspeed (~10 s here); a peer, in .[test] since the drop-in's tests
def test_deepspeed_rows_pass_deepspeeds_config_check(bench):
    zero_config = pytest.importorskip("deepspeed.runtime.zero.config")
    m = bench("_zero_step_methods")
    for name, spec in m.METHODS.items():
        if spec.lib == "deepspeed":
            cfg = m.configure(name, _ctx(m))
            # extra="forbid": a misspelt key fails here, not silently in DeepSpeed
            zero_config.DeepSpeedZeroConfig(**cfg["zero_optimization"])


def test_quant_verdict_pairs_each_quantized_row_with_its_plain_row(bench):
    bench("_zero_step_methods")
    zs = bench("zero_step")

    def row(name, sent, t, loss):
        return {"method": name, "comm_bytes_per_rank": {"total": sent},
                "step_time_s": {"median": t}, "final_loss": loss}

    rows = [row("zk_stage3", 6.0, 2.0, 5.0), row("zk_stage3_qw_qg4", 2.0, 1.0, 5.05),
            row("zk_stage2", 4.0, 2.0, 5.0), row("zk_stage2_qg8", 2.0, 3.0, 4.95),
            row("deepspeed_stage3", 8.0, 1.0, 5.0), {"method": "ds_stage3_qw", "error": "x"},
            row("zk_stage3@before", 4.0, 2.0, 5.0), row("zk_stage3_qw@before", 3.0, 2.0, 5.0)]
    zs._quant_verdict(rows)
    assert rows[1]["quantized_vs"] == {"method": "zk_stage3", "traffic_ratio": 2.0 / 6.0,
                                       "step_time_ratio": 0.5,
                                       "final_loss_rel_diff": pytest.approx(0.01)}
    assert rows[3]["quantized_vs"]["method"] == "zk_stage2"
    assert rows[3]["quantized_vs"]["final_loss_rel_diff"] == pytest.approx(-0.01)
    assert not any("quantized_vs" in r for r in rows[:1] + rows[2:3] + rows[4:6])
    assert rows[7]["quantized_vs"]["method"] == "zk_stage3@before"  # its own tree's row
    assert rows[7]["quantized_vs"]["traffic_ratio"] == 0.75 and "quantized_vs" not in rows[6]


def test_loss_check_spares_only_the_quantized_rows(bench):
    r = bench("_zero_step_report")
    bench("_zero_step_methods")
    zs = bench("zero_step")

    def row(name, loss):
        return {"method": name, "step_time_s": {"median": 1.0}, "step_times_s": [1.0],
                "comm_bytes_per_rank": {"total": 1.0}, "final_loss": loss, "notes": []}

    rows = [row("ddp", 5.0), row("zk_stage3", 5.01), row("zk_stage3_qw", 5.01),
            row("zk_stage3_qw_qg4@before", 5.01), row("ds_stage3_qg", 5.01)]
    r.add_ratios(rows, lossy=zs._quantized)
    assert ["final loss differs" in " ".join(x["notes"]) for x in rows] == [
        False, True, False, False, False]


def test_optimizer_option(bench, capsys):
    """--optimizer sgd|muon: the default rows put stages 1-3 beside ZeroRedundancyOptimizer and
    DeepSpeed's stages 1-3, every library is handed that optimizer, a name outside the list
    is refused naming the flag."""
    import dataclasses

    import torch

    m = bench("_zero_step_methods")
    zs = bench("zero_step")
    assert set(zs.OPTIMIZER_SET) <= set(m.METHODS)
    assert {p for pair in zs.OPTIMIZER_PEERS for p in pair} <= set(zs.OPTIMIZER_SET)
    assert zs._parse_args(["--optimizer", "sgd"]).methods == list(zs.OPTIMIZER_SET)
    assert zs._parse_args([]).methods == list(zs.ALL_METHODS)
    with pytest.raises(SystemExit):
        zs._parse_args(["--optimizer", "lion"])
    assert "--optimizer must be one of adamw,sgd,muon, got 'lion'" in capsys.readouterr().err
    sgd, muon = (dataclasses.replace(_ctx(m), optimizer=o) for o in ("sgd", "muon"))
    kw = m.configure("zk_stage2", sgd)
    assert kw["optimizer"] is torch.optim.SGD and kw["momentum"] == 0.9
    assert "optimizer" not in m.configure("zk_stage3", muon)   # Muon per group (its matrices)
    assert "optimizer" not in m.configure("zk_stage2", _ctx(m))  # adamw: today's default
    ds = m.configure("deepspeed_stage1", sgd)
    assert ds["zero_allow_untested_optimizer"] and "optimizer" not in ds  # client SGD
    ds3 = m.configure("deepspeed_stage3", muon)
    assert ds3["optimizer"]["type"] == "Muon"
    assert ds3["zero_optimization"]["reduce_scatter"] is False
    from zkernels.demo.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=16, block_size=8))
    opt = m.torch_optimizer(model, sgd)
    assert type(opt) is torch.optim.SGD and opt.defaults["momentum"] == 0.9
    # MuonAdamW: Muon on exactly the 2-D non-embedding matrices, AdamW on the rest, bit for bit
    groups = m.muon_groups(model)
    mats = {id(p) for p in groups[0]["params"]}
    assert mats and all(p.ndim == 2 for p in groups[0]["params"])
    assert id(model.wte.weight) not in mats and id(model.wpe.weight) not in mats
    twin = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=16, block_size=8))
    twin.load_state_dict(model.state_dict())
    ours = m.torch_optimizer(model, muon)
    tm = [p for p, q in zip(twin.parameters(), model.parameters()) if id(q) in mats]
    rest = [p for p, q in zip(twin.parameters(), model.parameters()) if id(q) not in mats]
    ref = [torch.optim.Muon(tm, lr=m.MUON_LR), torch.optim.AdamW(rest, lr=1e-3)]
    x = torch.randint(0, 64, (2, 8))
    for _ in range(2):
        for net, step in ((model, ours.step), (twin, lambda: [o.step() for o in ref])):
            net.zero_grad()
            net(x, x).backward()
            step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    assert len(ours.state) == len(list(model.parameters()))  # one state for both parts


@pytest.mark.slow  # spawns 2 ranks (~15 s)
def test_muon_run_trains_zkernels_muon(tmp_path):
    """--optimizer muon end to end: the zkernels row runs torch.optim.Muon on the matrices
    (each on its owner rank) and lands on the torch peer's loss (the same update)."""
    out = tmp_path / "zs.json"
    subprocess.run([sys.executable, os.path.join(BENCH, "zero_step.py"), "--config", "tiny",
                    "--steps", "1", "--warmup", "0", "--optimizer", "muon", "--methods",
                    "torch_zero,zk_stage2", "--json", str(out), "--timeout-s", "300"],
                   check=True, env=dict(os.environ, PYTHONPATH=ROOT), cwd=str(tmp_path),
                   capture_output=True, timeout=600)
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert "error" not in rows["zk_stage2"], rows["zk_stage2"].get("error")
    assert "error" not in rows["torch_zero"] and rows["torch_zero"]["final_loss"] > 0
    assert abs(rows["zk_stage2"]["final_loss"] - rows["torch_zero"]["final_loss"]) < 1e-4
