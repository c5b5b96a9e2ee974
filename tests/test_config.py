"""ZeroConfig: one frozen description of a run, validated once, read by the optimizer, the
estimator, the ladder and plan (issue 24 item 3); plan's --trainable crash and stage-3
transient column (issue 25 item 5)."""
import dataclasses
import json

import pytest
import torch
import torch.nn as nn

import zkernels as zk
from zkernels.hf_params import gathered_from_hf_config, params_from_hf_config
from zkernels.plan import main as plan_main
from zkernels.zero.planning.ladder import choose_rung
from zkernels.zero.planning.offload_config import OffloadConfig


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(16, 16) for _ in range(4)))


def test_parts_are_frozen_and_exported():
    cfg = zk.ZeroConfig.from_kwargs(stage=3, param_dtype="bf16", shard_size=2)
    assert cfg.precision.param_dtype is torch.bfloat16   # names become dtypes
    assert cfg == zk.ZeroConfig(sharding=zk.ShardingConfig(3, 2),
                                precision=zk.PrecisionConfig(torch.bfloat16))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.sharding.stage = 2
    for part in (zk.ShardingConfig, zk.PrecisionConfig, zk.OffloadSpec, zk.QuantizeConfig,
                 zk.BucketConfig):
        assert dataclasses.is_dataclass(part) and part.__dataclass_params__.frozen


@pytest.mark.parametrize("build, exc, match", [
    (lambda: zk.ShardingConfig(stage=5), ValueError, r"stage must be one of \(1, 2, 3\)"),
    (lambda: zk.ShardingConfig(shard_size=1.5), TypeError, "shard_size must be an int"),
    (lambda: zk.ShardingConfig(reshard_after_forward="yes"), TypeError,
     "reshard_after_forward must be a bool or an int"),
    (lambda: zk.PrecisionConfig(param_dtype="int8"), ValueError,
     "param_dtype must be None, torch.float32, torch.bfloat16 or torch.float16, got 'int8'"),
    (lambda: zk.PrecisionConfig(reduce_dtype=torch.float64), ValueError, "reduce_dtype"),
    (lambda: zk.OffloadSpec(kind="tape"), ValueError, "offload must be None, 'cpu' or 'nvme'"),
    (lambda: zk.OffloadSpec(params=1), TypeError, "offload_params must be a bool, got int"),
    (lambda: zk.QuantizeConfig(grads="fp8"), ValueError, "quantize_grads"),
    (lambda: zk.QuantizeConfig(block=100), ValueError, "quantize_block"),
    (lambda: zk.BucketConfig(bucket_bytes=-1), ValueError, "bucket_bytes must be None or an int"),
    (lambda: zk.ZeroConfig(sharding=2), TypeError,
     "ZeroConfig.sharding must be a ShardingConfig, got int"),
    (lambda: zk.ZeroConfig.from_kwargs(stage=1, offload="cpu"), ValueError,
     "offload='cpu' needs stage 2 or 3, got stage 1"),
    (lambda: zk.ZeroConfig.from_kwargs(stage=2, offload="cpu", offload_params=True),
     ValueError, "offload_params=True applies only to stage=3, got stage=2"),
    (lambda: zk.ZeroConfig.from_kwargs(stage=2, quantize_weights="int8"), ValueError,
     "quantize_weights='int8' applies to stage 3"),
    (lambda: zk.ZeroConfig.from_kwargs(stage=2, reshard_after_forward=2), ValueError,
     "reshard_after_forward=2 applies only to stage=3"),
    (lambda: zk.ZeroConfig.from_kwargs(stage=3, offload_dir="/tmp"), ValueError,
     "offload_dir applies only to offload='nvme'"),
])
def test_validation_names_the_argument(build, exc, match):
    with pytest.raises(exc, match=match):
        build()


def test_optimizer_takes_a_config_or_its_keywords():
    cfg = zk.ZeroConfig.from_kwargs(stage=2, bucket_bytes=4096, reduce_dtype=torch.bfloat16)
    a = zk.ZeroOptimizer(_model(), config=cfg)
    b = zk.ZeroOptimizer(_model(), stage=2, bucket_bytes=4096, reduce_dtype=torch.bfloat16)
    assert a.config == b.config == cfg
    assert a.stage == b.stage == 2 and a.precision == b.precision
    assert a.stats()["memory_bytes"] == b.stats()["memory_bytes"]
    # A keyword naming a field of config= wins ([Note: config-first constructor]).
    c = zk.ZeroOptimizer(_model(), stage=3, config=cfg)
    assert c.config == zk.ZeroConfig.from_kwargs(stage=3, bucket_bytes=4096,
                                                 reduce_dtype=torch.bfloat16) != cfg
    with pytest.raises(TypeError, match="config must be a zkernels.ZeroConfig"):
        zk.ZeroOptimizer(_model(), config={"stage": 2})
    with pytest.raises(ValueError, match="got 0"):
        zk.ZeroOptimizer(_model(), config=zk.ZeroConfig.from_kwargs(stage=0))


def test_auto_resolves_the_config_to_a_rung():
    model = _model()
    need = zk.estimate_memory(model, 1, 1, bucket_bytes=4096).device_bytes
    opt = zk.ZeroOptimizer(model, config=zk.ZeroConfig.from_kwargs(stage="auto",
                                                                   bucket_bytes=4096),
                           memory_budget_bytes=need)
    assert opt.config.stage == opt.stage == 1
    assert opt.config.buckets.bucket_bytes == 4096


def test_at_rung_keeps_what_applies():
    cfg = zk.ZeroConfig.from_kwargs(stage="auto", offload_dir="/tmp",
                                    offload_config=OffloadConfig(pin_memory=False))
    assert cfg.at_rung(3, "nvme", True).offload == zk.OffloadSpec(
        "nvme", "/tmp", True, OffloadConfig(pin_memory=False))
    assert cfg.at_rung(2, "cpu", False).offload.dir is None
    assert cfg.at_rung(1, None, False).offload == zk.OffloadSpec()


@pytest.mark.parametrize("kw", [dict(stage=2, param_dtype="bf16", bucket_bytes=2**20),
                                dict(stage=3, offload="nvme", offload_params=True,
                                     param_dtype=torch.bfloat16),
                                dict(stage=3, shard_size=4, reshard_after_forward=2,
                                     quantize_grads="int4")])
def test_estimate_reads_the_same_config(kw):
    cfg = zk.ZeroConfig.from_kwargs(**kw)
    assert zk.estimate_memory(7e9, 8, config=cfg) == zk.estimate_memory(7e9, 8, **kw)
    model = _model()
    assert zk.estimate_memory(model, 8, config=cfg) == zk.estimate_memory(model, 8, **kw)
    with pytest.raises(TypeError, match="not both"):
        zk.estimate_memory(7e9, 8, config=cfg, bucket_bytes=0)
    with pytest.raises(ValueError, match="explicit stage"):
        zk.estimate_memory(7e9, 8, config=zk.ZeroConfig.from_kwargs(stage="auto"))


def test_choose_rung_passes_the_model_keywords_on():
    """choose_rung forwards every estimate keyword (the frozen dtype crashed plan)."""
    psi, frozen = 7_000_000_000, 6_965_000_000
    (stage, offload), est, _ = choose_rung(psi, 8, 24 * 2**30, param_dtype="bf16",
                                           frozen_numel=frozen, frozen_dtype="bf16")
    assert est == zk.estimate_memory(psi, 8, stage, offload=offload, param_dtype="bf16",
                                     frozen_numel=frozen, frozen_dtype="bf16")
    # A bf16 base (14 GB) fits beside stage 1's states; an fp32 one (28 GB) needs stage 3.
    fp32 = choose_rung(psi, 8, 24 * 2**30, param_dtype="bf16", frozen_numel=frozen)[0]
    assert (stage, offload) == (1, None) and fp32 == (3, None)


def _plan_json(tmp_path, *argv):
    out = tmp_path / "plan.json"
    assert plan_main([*argv, "--json", str(out)]) == 0
    return {row["name"]: row for row in json.loads(out.read_text())["rows"]}


@pytest.mark.parametrize("frozen_dtype", [[], ["--frozen-dtype", "bf16"]])
def test_plan_trainable_with_device_memory(tmp_path, capsys, frozen_dtype):
    rows = _plan_json(tmp_path, "--params", "7e9", "--world-size", "8", "--trainable", "0.5%",
                      "--device-memory", "24GiB", *frozen_dtype)
    assert rows["stage 1"]["frozen_numel"] == 7e9 - 35e6
    assert "chosen for" in capsys.readouterr().out


LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 160,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 500, "tie_word_embeddings": False, "hidden_act": "silu"}


def test_plan_stage3_transient_counts_the_gathered_units(tmp_path):
    """The root unit (embeddings, head, final norm) plus two layers, in the compute dtype, as
    estimate_memory counts a module's units."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    rows = _plan_json(tmp_path, "--model", str(path), "--world-size", "4")
    h, layers = 64, 3
    layer = 2 * h * 64 + 2 * h * 32 + 3 * h * 160 + 2 * h   # attention, gated MLP, two norms
    root = 2 * 500 * h + h
    assert params_from_hf_config(LLAMA) == root + layers * layer
    assert gathered_from_hf_config(LLAMA, root + layers * layer) == root + 2 * layer
    assert rows["stage 3"]["transient_bytes"] == 2 * (root + 2 * layer)    # bf16
    assert rows["stage 3 + cpu offload"]["transient_bytes"] == 2 * (root + 2 * layer)
    assert rows["stage 2"]["transient_bytes"] == 0
    # The same count as a module's units: transformers' model for this config.
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM
    from zkernels.zero.planning.unit_plan import gathered_peak_numel
    cfg = AutoConfig.for_model("llama", **{k: v for k, v in LLAMA.items()
                                           if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert gathered_peak_numel(model) == root + 2 * layer
