"""Frozen parameters in ``estimate_memory`` and ``python -m zkernels plan``: gradients, states,
buffers and the reduce-scatter scale with the trainable count; frozen parameters add their
whole bytes at data parallel and stages 1-2 and a shard at stage 3 (in param_dtype where it is
narrower); a module counts its own, a count takes ``frozen_numel=`` / ``--trainable``; the
estimate matches what ``ZeroOptimizer.stats()`` measures on a model with frozen layers."""
import json

import pytest
import torch

import zkernels as zk
from tests.test_cli import _rows
from tests.zero._harness import freeze_layers, make_model
from zkernels.__main__ import main as zk_main

T, F, N = 1_000_000, 9_000_000, 8


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_frozen_rows_by_formula(stage, param_dtype):
    e = zk.estimate_memory(T + F, N, stage, param_dtype=param_dtype, frozen_numel=F,
                           bucket_bytes=0)
    t = zk.estimate_memory(T, N, stage, param_dtype=param_dtype, bucket_bytes=0)
    assert (e.num_params, e.frozen_numel, e.trainable_numel) == (T + F, F, T)
    # Everything but the parameters is the trainable model's.
    for kind in ("grads_bytes", "master_bytes", "optimizer_states_bytes", "buffers_bytes"):
        assert getattr(e, kind) == getattr(t, kind), kind
    p = 2 if param_dtype else 4
    frozen = 4 * F if stage < 3 else p * F // N
    assert e.params_bytes == t.params_bytes + frozen
    if stage == 3:   # gathered twice per step with the unit: (N-1)/N of 2 p F more
        assert e.comm_bytes == pytest.approx(t.comm_bytes + 2 * p * F * (N - 1) / N, abs=1)
    else:
        assert e.comm_bytes == t.comm_bytes


def test_frozen_dtype_and_validation():
    e = zk.estimate_memory(T + F, N, 2, param_dtype="bf16", frozen_numel=F, frozen_dtype="bf16",
                           bucket_bytes=0)
    assert e.params_bytes == 2 * (T + F)
    model = freeze_layers(make_model())
    for kwargs, match in [
        (dict(frozen_numel=-1), r"frozen_numel must be a whole number in \[0, num_params"),
        (dict(frozen_numel=T + F + 1), "frozen_numel must be a whole number"),
        (dict(frozen_numel=1.5), "frozen_numel must be a whole number"),
        (dict(frozen_numel=True), "frozen_numel must be a whole number"),
        (dict(frozen_dtype="bf16"), "frozen_dtype applies only with frozen_numel"),
        (dict(frozen_numel=F, frozen_dtype="int8"), "frozen_dtype must be"),
    ]:
        with pytest.raises(ValueError, match=match):
            zk.estimate_memory(T + F, N, 3, **kwargs)
    with pytest.raises(ValueError, match="frozen_numel and frozen_dtype apply to a parameter "
                                         "count"):
        zk.estimate_memory(model, N, 3, frozen_numel=10)


def test_module_counts_its_frozen_parameters():
    model = freeze_layers(make_model())
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    for stage in (1, 2, 3):
        e = zk.estimate_memory(model, 2, stage)
        c = zk.estimate_memory(total, 2, stage, frozen_numel=frozen,
                               max_tensor_numel=e.num_params, bucket_bytes=0)
        assert e.frozen_numel == frozen and e.num_params == total
        assert (e.params_bytes, e.grads_bytes, e.optimizer_states_bytes) == \
            (c.params_bytes, c.grads_bytes, c.optimizer_states_bytes)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_estimate_matches_stats_with_frozen_layers(stage):
    """One process: the estimate's params, grads and optimizer states equal the bytes
    ``stats()`` measures after a step (padding aside: at most 64 elements per flat unit)."""
    model = freeze_layers(make_model())
    est = zk.estimate_memory(model, 1, stage)
    opt = zk.ZeroOptimizer(model, stage=stage, lr=1e-3)
    idx = torch.randint(0, 97, (2, 13))
    model(idx, idx).backward()
    opt.step()
    if stage == 1:
        opt.zero_grad()
    mem = opt.stats()["memory_bytes"]
    slack = 4 * 64 * (len(opt.units) + len(opt.frozen_units))
    assert est.params_bytes <= mem["params"] <= est.params_bytes + slack
    assert est.optimizer_states_bytes <= mem["optimizer_states"] <= \
        est.optimizer_states_bytes + 2 * slack
    if stage > 1:
        assert est.grads_bytes <= mem["grads"] <= est.grads_bytes + slack


def test_plan_trainable_fraction_and_count(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert zk_main(["plan", "--params", "7e9", "--trainable", "0.01", "--world-size", "8",
                    "--param-dtype", "bf16", "--unit", "GB", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "70,000,000 trainable, 6,930,000,000 frozen" in text
    rows, _ = _rows(text)
    # params: data parallel 2 B x 7e7 + 4 B x 6.93e9 (the base as loaded, fp32) = 27.86 GB;
    # stage 3 (2 B x 7e7 + 2 B x 6.93e9) / 8 = 1.75 GB; optimizer states 8 B x 7e7 / 8.
    assert rows["data parallel"][0] == "27.9" and rows["stage 3"][0] == "1.8"
    assert rows["stage 2"][3] == "0.07"
    data = json.loads(out.read_text())["rows"]
    assert {r["frozen_numel"] for r in data} == {6_930_000_000}
    assert {r["trainable_numel"] for r in data} == {70_000_000}
    assert zk_main(["plan", "--params", "7e9", "--trainable", "7e7", "--world-size", "8",
                    "--frozen-dtype", "bf16", "--unit", "GB"]) == 0
    rows, _ = _rows(capsys.readouterr().out)
    assert rows["data parallel"][0] == "14.0"


def lora_gpt():
    return freeze_layers(make_model())


def test_plan_module_with_frozen_parts(capsys):
    assert zk_main(["plan", "--model", "tests.test_estimate_frozen:lora_gpt",
                    "--world-size", "2"]) == 0
    model = lora_gpt()
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert f"{frozen:,} frozen" in capsys.readouterr().out
    assert zk_main(["plan", "--model", "tests.test_estimate_frozen:lora_gpt", "--trainable",
                    "0.5", "--world-size", "2"]) == 2
    assert "--trainable applies to --params or a config.json" in capsys.readouterr().err
    for bad in ("0", "1.5", "-3", "x", "150%"):
        with pytest.raises(SystemExit):
            zk_main(["plan", "--params", "7e9", "--trainable", bad, "--world-size", "8"])
        assert "--trainable: must be a fraction" in capsys.readouterr().err


def test_plan_trainable_small_count_needs_p(capsys):
    # `--trainable 2` on 7.5e9 parameters: two parameters, or 2% mistyped? A bare count below
    # 1% of the model is refused, saying how to write either; `2p` is the count, taken.
    assert zk_main(["plan", "--params", "7.5e9", "--trainable", "2", "--world-size", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zkernels plan: error: --trainable 2 means 2 parameters, under 1% "
                          "of the model's 7,500,000,000: write 2p if you mean that count, or "
                          "a fraction (0.02 or 2%)"), err
    assert zk_main(["plan", "--params", "7.5e9", "--trainable", "2p", "--world-size", "8"]) == 0
    assert "2 trainable, 7,499,999,998 frozen" in capsys.readouterr().out
    assert zk_main(["plan", "--params", "7.5e9", "--trainable", "1P", "--world-size", "8"]) == 0
    assert "1 trainable, 7,499,999,999 frozen" in capsys.readouterr().out
    # The same count is fine where it is 1% or more of the model; percentages as before.
    assert zk_main(["plan", "--params", "200", "--trainable", "2", "--world-size", "2"]) == 0
    assert "2 trainable, 198 frozen" in capsys.readouterr().out
    assert zk_main(["plan", "--params", "7.5e9", "--trainable", "2%", "--world-size", "8"]) == 0
    assert "150,000,000 trainable" in capsys.readouterr().out
    assert zk_main(["plan", "--params", "7.5e9", "--trainable", "7.5e7", "--world-size",
                    "8"]) == 0          # exactly 1%
    assert "75,000,000 trainable" in capsys.readouterr().out
    # More than the model has, p or not, is refused as before.
    assert zk_main(["plan", "--params", "7.5e9", "--trainable", "8e9p", "--world-size",
                    "8"]) == 2
    assert "exceeds the model's 7,500,000,000 parameters" in capsys.readouterr().err
    for bad in ("0p", "1.5p", "-2p", "p", "2%p"):
        with pytest.raises(SystemExit):
            zk_main(["plan", "--params", "7e9", f"--trainable={bad}", "--world-size", "8"])
        assert "argument --trainable: a count of parameters written with p must be a whole " \
            "number >= 1" in capsys.readouterr().err


def test_plan_trainable_small_count_of_a_config(capsys, tmp_path):
    # A config.json's count is known only once counted: the same check, after counting.
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(model_type="gpt2", vocab_size=50257, n_embd=768,
                                    n_layer=12, n_head=12, n_positions=1024)))
    argv = ["plan", "--model", str(path), "--world-size", "8", "--trainable"]
    assert zk_main(argv + ["3"]) == 2
    assert "--trainable 3 means 3 parameters, under 1% of the model's 124,439,808" in \
        capsys.readouterr().err
    assert zk_main(argv + ["3p"]) == 0
    assert "3 trainable, 124,439,805 frozen" in capsys.readouterr().out


def test_plan_help_says_small_counts_need_p(capsys):
    with pytest.raises(SystemExit):
        zk_main(["plan", "-h"])
    out = " ".join(capsys.readouterr().out.split())
    assert "A count below 1% of the model's parameters is refused unless written with p " \
        "(2p: two parameters)" in out
