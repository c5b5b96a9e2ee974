"""The config-first constructor ``ZeroOptimizer(model, config=None, **overrides)`` ([Note:
config-first constructor] in zkernels/zero/config_keywords.py): a short signature, every
ZeroConfig field and every keyword taken before still taken by name through one table, an
unknown name refused with the closest one, and a keyword over ``config=`` winning.
"""
import dataclasses
import inspect
import re

import pytest
import torch
import torch.nn as nn

import zkernels as zk
from zkernels.zero import OffloadConfig, ZeroConfig, ZeroOptimizer
from zkernels.zero.config_keywords import KEYWORDS, NAMED, RUN_OPTIONS, read_keywords
from zkernels.zero.planning import config as config_module

README = __file__.rsplit("/tests/", 1)[0] + "/README.md"

# The 39 keywords ZeroOptimizer.__init__ named besides the model before the config-first
# constructor (cb5705e), frozen here: every one must still be taken by name.
BEFORE = (
    "stage", "lr", "betas", "eps", "weight_decay", "param_groups", "param_dtype",
    "reduce_dtype", "offload", "offload_dir", "bucket_bytes", "max_grad_norm",
    "process_group", "loss_scale", "memory_budget_bytes", "comm_backend", "ops_backend",
    "timeout", "nonfinite", "unused_grads", "units", "reshard_after_forward", "check_paths",
    "offload_config", "offload_params", "overlap_param_gather", "shard_size", "mesh",
    "quantize_weights", "quantize_grads", "quantize_block", "state_dtype", "state_block_size",
    "master_dtype", "config", "device", "param_init", "optimizer", "elementwise")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _named_keywords(fn) -> list:
    """The keywords ``fn``'s signature names besides self and the model (``**`` aside)."""
    return [n for n, p in inspect.signature(fn).parameters.items()
            if n not in ("self", "model") and p.kind is not p.VAR_KEYWORD]


def _readme_keywords() -> set:
    """The keywords of README.md's ``ZeroOptimizer(...)`` example."""
    text = open(README).read()
    calls = re.findall(r"ZeroOptimizer\((.*?)\)\n", text, re.S)
    assert calls, "README.md has no ZeroOptimizer(...) example"
    return {k for call in calls for k in re.findall(r"(\w+)=", call)}


def test_signature_names_at_most_12_keywords():
    named = _named_keywords(ZeroOptimizer.__init__)
    assert len(named) <= 12, named
    assert tuple(sorted(named)) == tuple(sorted(NAMED))
    assert "config" in named and _readme_keywords() <= set(named), (
        sorted(_readme_keywords() - set(named)))


def test_catches_a_signature_of_13_keywords():
    def wide(self, model, a=0, b=0, c=0, d=0, e=0, f=0, g=0, h=0, i=0, j=0, k=0, m=0, n=0,
             **rest):
        pass
    assert len(_named_keywords(wide)) == 13 > 12


def test_every_keyword_taken_before_is_taken():
    assert set(BEFORE) <= KEYWORDS, sorted(set(BEFORE) - KEYWORDS)
    assert len(set(BEFORE)) == 39
    from zkernels.integrations.lightning import _ZERO_KWARGS   # ZeroStrategy's check
    assert set(BEFORE) - {"stage"} <= set(_ZERO_KWARGS)


def _table_gaps(table) -> list:
    """ZeroConfig's leaf fields with no keyword, or with more than one, in ``table``."""
    gaps = []
    for part in dataclasses.fields(ZeroConfig):
        for leaf in dataclasses.fields(part.default_factory):
            names = [k for k, where in table.items() if where == (part.name, leaf.name)]
            if len(names) != 1:
                gaps.append((part.name, leaf.name, names))
    return gaps


def test_every_config_field_has_one_keyword():
    assert _table_gaps(config_module.KEYWORDS) == []
    leaves = sum(len(dataclasses.fields(p.default_factory)) for p in dataclasses.fields(ZeroConfig))
    assert len(config_module.KEYWORDS) == leaves


def test_catches_a_field_without_a_keyword_and_one_with_two():
    table = dict(config_module.KEYWORDS)
    del table["master_dtype"]
    assert _table_gaps(table) == [("state", "master_dtype", [])]
    table = dict(config_module.KEYWORDS, stage_=("sharding", "stage"))
    assert _table_gaps(table) == [("sharding", "stage", ["stage", "stage_"])]


# keyword -> (the field it names, a value other than its default, the keywords it needs beside
# it, the value the config stores), written out here apart from the table it checks. A field
# without a row fails test_every_config_field_lands_in_the_config.
SAMPLES = {
    "stage": ("sharding.stage", 3, {}, 3),
    "shard_size": ("sharding.shard_size", 1, {}, 1),
    "reshard_after_forward": ("sharding.reshard_after_forward", False, dict(stage=3), False),
    "param_dtype": ("precision.param_dtype", "bf16", {}, torch.bfloat16),
    "reduce_dtype": ("precision.reduce_dtype", torch.bfloat16, {}, torch.bfloat16),
    "offload": ("offload.kind", "cpu", dict(stage=2), "cpu"),
    "offload_dir": ("offload.dir", "TMP", dict(stage=2, offload="nvme"), "TMP"),
    "offload_params": ("offload.params", True, dict(stage=3, offload="cpu"), True),
    "offload_config": ("offload.config", OffloadConfig(pin_memory=False),
                       dict(stage=2, offload="cpu"), OffloadConfig(pin_memory=False)),
    "quantize_weights": ("quantization.weights", "int8", dict(stage=3), "int8"),
    "quantize_grads": ("quantization.grads", "int8", {}, "int8"),
    "quantize_block": ("quantization.block", 128, {}, 128),
    "bucket_bytes": ("buckets.bucket_bytes", 4096, {}, 4096),
    "state_dtype": ("state.state_dtype", "bf16", {}, torch.bfloat16),
    "state_block_size": ("state.block_size", 128, {}, 128),
    "master_dtype": ("state.master_dtype", torch.bfloat16, dict(param_dtype=torch.bfloat16),
                     torch.bfloat16),
}


def _sample(name, tmp_path):
    _, value, needs, stored = SAMPLES[name]
    fix = (lambda v: str(tmp_path) if v == "TMP" else v)
    return fix(value), {k: fix(v) for k, v in needs.items()}, fix(stored)


def _landed(cfg: ZeroConfig, name: str):
    """The value of the field SAMPLES says ``name`` names."""
    part, leaf = SAMPLES[name][0].split(".")
    return getattr(getattr(cfg, part), leaf)


def _check_lands(name, tmp_path):
    """``ZeroOptimizer(model, name=value)`` stores the value in the field ``name`` names and
    leaves every other field as the keywords it needs set them (or at its default)."""
    value, needs, stored = _sample(name, tmp_path)
    opt = ZeroOptimizer(_model(), **needs, **{name: value})
    try:
        assert _landed(opt.config, name) == stored, (name, _landed(opt.config, name))
        for other in SAMPLES:
            if other != name:
                want = needs.get(other, config_module.CONFIG_KWARGS[other])
                assert _landed(opt.config, other) == want, (name, other)
    finally:
        opt.close()


@pytest.mark.parametrize("name", sorted(config_module.KEYWORDS))
def test_every_config_field_lands_in_the_config(name, tmp_path):
    assert name in SAMPLES, f"{name}: add a row to SAMPLES"
    assert config_module.KEYWORDS[name] == tuple(SAMPLES[name][0].split("."))
    _check_lands(name, tmp_path)


def test_catches_two_keywords_swapped_in_the_table(monkeypatch, tmp_path):
    """A table mapping state_block_size to quantize's block (and back) fails the check."""
    table = config_module.KEYWORDS
    monkeypatch.setitem(table, "state_block_size", ("quantization", "block"))
    monkeypatch.setitem(table, "quantize_block", ("state", "block_size"))
    with pytest.raises(AssertionError, match="state_block_size"):
        _check_lands("state_block_size", tmp_path)
    with pytest.raises(AssertionError, match="quantize_block"):
        _check_lands("quantize_block", tmp_path)


@pytest.mark.parametrize("name", sorted(config_module.KEYWORDS))
def test_a_keyword_wins_over_config(name, tmp_path):
    """Over a config holding the sample, the keyword at its default wins, and the reverse."""
    value, needs, stored = _sample(name, tmp_path)
    default = config_module.CONFIG_KWARGS[name]
    with_sample = ZeroConfig.from_kwargs(**needs, **{name: value})
    without = ZeroConfig.from_kwargs(**needs)
    assert _landed(with_sample.with_keywords(**{name: default}), name) == default
    assert with_sample.with_keywords(**{name: default}) == without
    assert without.with_keywords(**{name: value}) == with_sample


def test_the_constructor_merges_config_and_keywords():
    cfg = ZeroConfig.from_kwargs(stage=2, offload="cpu", param_dtype=torch.bfloat16,
                                 bucket_bytes=4096)
    kept = ZeroOptimizer(_model(), cfg)   # config positional: FROM_CONFIG for stage/param_dtype
    assert kept.config == cfg
    opt = ZeroOptimizer(_model(), config=cfg, stage=3, bucket_bytes=8192)
    assert opt.config == ZeroConfig.from_kwargs(stage=3, offload="cpu", bucket_bytes=8192,
                                                param_dtype=torch.bfloat16)
    # None is given too: over a bf16 / offloading config it computes in fp32, on the device.
    fp32 = ZeroOptimizer(_model(), config=cfg, param_dtype=None, offload=None)
    assert fp32.config == ZeroConfig.from_kwargs(stage=2, bucket_bytes=4096)
    assert fp32.config.precision.param_dtype is None and fp32.offload is None
    # The merged config is checked as a whole: stage 1 keeps no gradient shard to offload.
    with pytest.raises(ValueError, match="offload='cpu' needs stage 2 or 3"):
        ZeroOptimizer(_model(), config=cfg, stage=1)
    with pytest.raises(ValueError, match="stage must be one of"):
        ZeroOptimizer(_model(), config=cfg, stage=None)
    for opt in (kept, opt, fp32):
        opt.close()


@pytest.mark.parametrize("kw, message", [
    (dict(stag=2), "ZeroOptimizer() got an unexpected keyword 'stag'; did you mean 'stage'?"),
    (dict(ofload="cpu", stage=2),
     "ZeroOptimizer() got an unexpected keyword 'ofload'; did you mean 'offload'?"),
    (dict(bucket_byte=4096),
     "ZeroOptimizer() got an unexpected keyword 'bucket_byte'; did you mean 'bucket_bytes'?"),
    (dict(optimizer=torch.optim.SGD, momentun=0.9),
     "ZeroOptimizer() got an unexpected keyword 'momentun'; did you mean 'momentum'?"),
    (dict(alpha_warmpu=100),   # AdEMAMix's, from its definition (zkernels/optimizers)
     "ZeroOptimizer() got an unexpected keyword 'alpha_warmpu'; did you mean 'alpha_warmup'?"),
    (dict(zzzzzz=1),
     "ZeroOptimizer() got an unexpected keyword 'zzzzzz'; no keyword of that name is close"),
    (dict(stag=2, ofload="cpu"), "ZeroOptimizer() got unexpected keywords 'stag' (did you mean "
                                 "'stage'?), 'ofload' (did you mean 'offload'?)"),
], ids=str)
def test_an_unknown_keyword_names_the_closest(kw, message):
    model = _model()
    before = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(TypeError) as info:
        ZeroOptimizer(model, **kw)
    assert str(info.value) == message
    assert [p.data_ptr() for p in model.parameters()] == before   # refused before building


def test_config_must_be_a_config():
    with pytest.raises(TypeError, match=r"got int \(pass the stage by name: stage=...\)"):
        ZeroOptimizer(_model(), 2)
    with pytest.raises(TypeError, match="from_kwargs.. got an unexpected keyword 'stag'; did "
                                        "you mean 'stage'"):
        ZeroConfig.from_kwargs(stag=2)


def test_hyperparameters_pass_through_to_the_optimizer():
    kw = read_keywords(None, dict(alpha=5.0, beta3_warmup=10, alpha_warmup=10, momentum=0.9,
                                  offload_params=False, units=None, betas=(0.8, 0.9)))
    assert kw.optimizer_kwargs == dict(alpha=5.0, beta3_warmup=10, alpha_warmup=10,
                                       momentum=0.9)
    assert kw.options == dict(RUN_OPTIONS, betas=(0.8, 0.9)) and kw.config == ZeroConfig()
    opt = ZeroOptimizer(_model(), stage=2, optimizer=torch.optim.SGD, lr=0.1, momentum=0.9,
                        dampening=0.1)
    assert opt.param_groups[0]["momentum"] == 0.9 and opt.param_groups[0]["dampening"] == 0.1
    # A name some optimizer takes but the chosen one does not: the optimizer's own refusal.
    with pytest.raises(TypeError, match="optimizer='adamw' takes lr, betas.*momentum"):
        ZeroOptimizer(_model(), momentum=0.9)


def test_a_class_taking_any_keyword_gets_every_other_name():
    class Loose(torch.optim.SGD):
        def __init__(self, params, lr=0.1, **extra):
            self.extra = extra
            super().__init__(params, lr=lr)
    kw = read_keywords(None, dict(optimizer=Loose, elementwise=True, anything=1))
    assert kw.optimizer_kwargs == dict(anything=1)


def test_readme_example_runs():
    """README.md's keywords, as its example passes them."""
    opt = zk.ZeroOptimizer(_model(), stage=2, lr=3e-4, weight_decay=0.1,
                           param_dtype=torch.bfloat16, max_grad_norm=1.0)
    assert opt.config == ZeroConfig.from_kwargs(stage=2, param_dtype=torch.bfloat16)
    assert opt.max_grad_norm == 1.0 and opt.defaults["lr"] == 3e-4
