"""ZeroOptimizer on a meta-device model ([Note: meta-device build] in
zkernels/zero/parameters/meta_init.py): materialized unit by unit on ``device=``.

Oracles:
- the same meta model materialized eagerly in one process (``materialize_eagerly``, the
  per-unit seeds of rank 0's generator): every parameter and buffer bit for bit, at 1, 2 and 4
  gloo ranks, stages 1-3, cpu and NVMe offload (with the parameters offloaded too) and
  hybrid sharding (values are copied, never computed,
  so equality is exact). Each rank seeds its generator differently, so a build that drew the
  seed per rank instead of agreeing on rank 0's would fail here;
- transformers' own init for a meta Llama's rotary ``inv_freq`` buffer (non-persistent): the
  eagerly built model's buffer, exactly;
- a meta build + ``load_pretrained`` trained 2 steps against the eagerly built model +
  ``load_state_dict`` of the same files trained 2 steps in the same ranks: the same values go
  through the same units and ops, so bit for bit;
- at stage 3, when a unit is materialized no other unit's full parameters exist (counted by
  wrapping the materializer).
"""
import pytest
import torch
import torch.nn as nn

import zkernels as zk
from tests._dist import run_ranks
from tests.checkpoint._ranks import offload_kwargs, plain, tensors
from zkernels.zero.parameters import meta_init
from zkernels.zero.parameters.meta_init import materialize_eagerly

transformers = pytest.importorskip("transformers")

RANK_SEED = 1000  # rank r seeds RANK_SEED + r


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 12)
        self.norm = nn.LayerNorm(12)

    def forward(self, x):
        return x + self.norm(self.fc(x)).relu()


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(6, 12), nn.Linear(12, 5)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.register_buffer("scale", torch.full((12,), 0.5))  # reset by param_init below

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h * self.scale)


def toy_init(module):
    if isinstance(module, (nn.Linear, nn.LayerNorm)):
        module.reset_parameters()
    if isinstance(module, Toy):
        module.scale.fill_(0.5)


def hf(kind):
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=40,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=32,
                                       tie_word_embeddings=False)
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                  n_positions=32, tie_word_embeddings=True)
    return transformers.GPT2LMHeadModel(cfg)


def build(kind):
    with torch.device("meta"):
        return Toy() if kind == "toy" else hf(kind)


def values(model):
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    out.update({f"buffer:{n}": b.detach().clone() for n, b in model.named_buffers()})
    return out


# (kind, stage, offload, shard_size, param_init)
CASES = [("toy", 1, None, None, toy_init), ("toy", 2, None, None, toy_init),
         ("toy", 3, None, None, toy_init), ("toy", 3, "cpu", None, toy_init),
         ("llama", 3, None, None, None), ("gpt2", 2, None, None, None),
         ("toy", 3, "nvme", None, toy_init), ("llama", 3, "cpu+params", None, None),
         ("toy", 2, "nvme", None, toy_init)]
HYBRID = [("toy", 3, None, 2, toy_init), ("llama", 3, None, 2, None)]


def build_cases(rank, ws, cases):
    """Per case: build the meta model on cpu at this world size (rank r seeded RANK_SEED + r),
    take one training step, return the built values."""
    out = []
    for kind, stage, offload, shard_size, init in cases:
        torch.manual_seed(RANK_SEED + rank)
        model = build(kind)
        opt = zk.ZeroOptimizer(model, stage=stage, shard_size=shard_size, device="cpu",
                               param_init=init, lr=1e-2, ops_backend="reference",
                               **offload_kwargs(offload))
        with opt.gathered():
            built = values(model)
        x = (torch.randn(2, 6) if kind == "toy" else torch.arange(8).view(1, 8) % 64)
        loss = model(x).sum() if kind == "toy" else model(x, labels=x).loss
        loss.backward()
        opt.step()
        with opt.gathered():
            finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        out.append({"built": built, "finite": finite})
    return plain(out)


def eager(kind, init):
    """What rank 0 builds: its generator seeded RANK_SEED, the base seed its first draw after
    the meta model is built."""
    torch.manual_seed(RANK_SEED)
    model = build(kind)
    seed = int(torch.randint(0, 2 ** 62, (1,), dtype=torch.int64))
    return materialize_eagerly(model, "cpu", init, seed)


def check(results, cases):
    for case, per_rank in zip(cases, zip(*results)):
        ref = values(eager(case[0], case[4]))
        for r, res in enumerate(per_rank):
            got = tensors(res["built"])
            assert set(got) == set(ref), (case, set(got) ^ set(ref))
            for n, v in ref.items():
                assert torch.equal(got[n].to(v.dtype), v), (case, r, n)
            assert res["finite"], case


@pytest.mark.parametrize("ws", [2, pytest.param(1, marks=pytest.mark.slow)])
def test_meta_build_matches_eager_init_at_every_stage(ws):
    check(run_ranks(build_cases, ws, CASES, timeout=600.0), CASES)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_meta_build_at_four_ranks_and_hybrid():
    cases = [CASES[0], CASES[2], CASES[3]] + HYBRID
    check(run_ranks(build_cases, 4, cases, timeout=840.0), cases)


def test_hf_rotary_buffer_and_init_follow_transformers():
    """The non-persistent inv_freq comes from transformers' own _init_weights: equal to an
    eagerly constructed Llama's; GPT-2's tied head stays tied."""
    model = eager("llama", None)
    torch.manual_seed(0)
    real = hf("llama")
    for n, b in real.named_buffers():
        assert torch.equal(dict(model.named_buffers())[n], b), n
    norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    assert norms and all(torch.equal(p, torch.ones_like(p)) for p in norms)
    std = model.model.layers[0].self_attn.q_proj.weight.std().item()
    assert abs(std - real.config.initializer_range) < 0.005, std
    g = eager("gpt2", None)
    assert g.lm_head.weight is g.transformer.wte.weight


def test_stage3_materializes_one_unit_at_a_time(monkeypatch):
    """When a unit is materialized, every earlier unit's parameters are already freed
    (0-element storage) and later units' are still on meta."""
    seen, models = [], []
    real = meta_init.MetaMaterializer.materialize

    def spy(self, spec):
        full = [n for n, p in models[-1].named_parameters()
                if p.device.type != "meta" and p.numel() > 0 and p.data.numel() == p.numel()]
        seen.append((spec.name, full))
        real(self, spec)

    monkeypatch.setattr(meta_init.MetaMaterializer, "materialize", spy)
    models.append(build("toy"))
    zk.ZeroOptimizer(models[-1], stage=3, device="cpu", param_init=toy_init,
                     ops_backend="reference")
    assert len(seen) == 4, seen
    assert all(full == [] for _, full in seen), seen
    # catches: at stage 1 the replicated parameters stay, so the check above can fail
    seen.clear()
    models.append(build("toy"))
    zk.ZeroOptimizer(models[-1], stage=1, device="cpu", param_init=toy_init,
                     ops_backend="reference")
    assert any(full for _, full in seen[1:]), seen


class Bare(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.w


def test_bad_meta_arguments_raise_naming_them():
    with pytest.raises(ValueError, match="device="):
        zk.ZeroOptimizer(build("toy"), stage=3, param_init=toy_init)
    with pytest.raises(TypeError, match="param_init"):
        zk.ZeroOptimizer(build("toy"), stage=3, device="cpu", param_init="normal")
    with pytest.raises(ValueError, match="param_init"):
        zk.ZeroOptimizer(Toy(), stage=3, param_init=toy_init)
    with pytest.raises(ValueError, match="device must be"):
        zk.ZeroOptimizer(build("toy"), stage=1, device="meta")
    with torch.device("meta"):
        bare = Bare()
    with pytest.raises(ValueError, match="reset_parameters"):
        zk.ZeroOptimizer(bare, stage=3, device="cpu")
    # Toy's own buffer: Toy has no reset_parameters, so param_init= is asked for.
    with pytest.raises(ValueError, match=r"<root>.*\(Toy\).*reset_parameters"):
        zk.ZeroOptimizer(build("toy"), stage=1, device="cpu")
    with pytest.raises(ValueError, match="not fully initialized"):
        zk.ZeroOptimizer(build("toy"), stage=3, device="cpu", param_init=lambda m: None)


def test_materialized_model_is_taken_as_today():
    model = Toy()
    before = values(model)
    opt = zk.ZeroOptimizer(model, stage=1, device="cpu", ops_backend="reference")
    with opt.gathered():
        assert all(torch.equal(values(model)[n], v) for n, v in before.items())


SHARD = "20KB"


def load_and_train(rank, ws, stage, folder, shard_size=None):
    """Meta build + load_pretrained, and the eagerly built model + load_state_dict of the same
    files, both trained 2 steps on the same batches; return both."""
    from safetensors.torch import load_file
    import glob
    import os
    out = {}
    for path in ("meta", "eager"):
        torch.manual_seed(5)
        if path == "meta":
            model = build("llama")
            opt = zk.ZeroOptimizer(model, stage=stage, device="cpu", lr=1e-2,
                                   shard_size=shard_size, ops_backend="reference")
            zk.checkpoint.load_pretrained(opt, folder)
        else:
            model = hf("llama")
            sd = {}
            for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
                sd.update(load_file(f))
            model.load_state_dict({k: v.float() for k, v in sd.items()})
            opt = zk.ZeroOptimizer(model, stage=stage, lr=1e-2, shard_size=shard_size,
                                   ops_backend="reference")
        for step in range(2):
            ids = (torch.arange(8).view(1, 8) * (rank + 2) + step) % 64
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        with opt.gathered():
            out[path] = values(model)
    return plain(out)


@pytest.mark.parametrize("stage, ws, shard_size", [
    (3, 2, None), pytest.param(1, 2, None, marks=pytest.mark.slow),
    pytest.param(3, 4, 2, marks=pytest.mark.slow, id="3-hybrid")])
def test_meta_build_then_load_pretrained_trains_like_load_state_dict(tmp_path, stage, ws,
                                                                     shard_size):
    torch.manual_seed(3)
    src = hf("llama").to(torch.bfloat16)
    src.save_pretrained(str(tmp_path), max_shard_size=SHARD)
    res = tensors(run_ranks(load_and_train, ws, stage, str(tmp_path), shard_size,
                            timeout=600.0)[0])
    assert set(res["meta"]) == set(res["eager"])
    for n, v in res["eager"].items():
        assert torch.equal(res["meta"][n], v), n
    # catches: the loaded weights moved (trained), not left at the initial values
    assert not torch.equal(res["meta"]["lm_head.weight"],
                           src.lm_head.weight.float())
