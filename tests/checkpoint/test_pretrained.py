"""zk.checkpoint.load_pretrained / save_pretrained: Hugging Face-layout safetensors in and out
of the shards, at 2 gloo ranks and stages 1-3.

The oracle for a load is torch's own ``model.load_state_dict`` of the same files (every
shard's tensors, read with ``safetensors.torch.load_file``) into the same differently-seeded
model: fp32 files must come out bit for bit, bf16 files as their values widened (exact). The
bytes each rank reads are counted by wrapping ``pretrained._read_rows`` (the only place the
loader reads tensor bytes): over both ranks they must be about the files' tensor bytes once,
not twice.
"""
import glob
import json
import os

import pytest
import torch

import zkernels as zk
from tests._dist import run_ranks
from tests.checkpoint._ranks import offload_kwargs, plain, tensors

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

SHARD = "20KB"          # several files for these models (~50-130 KB of weights)
BUCKET = 6000           # bytes: many units, parameters cut mid-row by shard boundaries


def make_model(kind, seed):
    torch.manual_seed(seed)
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=40,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=32,
                                       tie_word_embeddings=False)
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4,
                                  n_positions=32, tie_word_embeddings=True)
    return transformers.GPT2LMHeadModel(cfg)


def file_state(folder):
    out = {}
    for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        out.update(safetensors_torch.load_file(f))
    return out


def expected(kind, folder, seed=1):
    """The same differently-seeded model after torch's load_state_dict of the files."""
    ref = make_model(kind, seed)
    sd = {k: v.float() for k, v in file_state(folder).items()}
    res = ref.load_state_dict(sd, strict=False)
    assert set(res.missing_keys) <= {"lm_head.weight"}, res.missing_keys   # tied in GPT-2
    if kind == "gpt2":
        assert ref.lm_head.weight is ref.transformer.wte.weight
    return {n: p.detach().clone() for n, p in ref.named_parameters()}


def counting():
    """Wrap the loader's only read of tensor bytes; return the running counts."""
    from zkernels.checkpoint import pretrained
    counts = {"bytes": 0, "reads": 0, "largest": 0}
    real = pretrained._read_rows

    def read_rows(sl, r0, r1):
        t = real(sl, r0, r1)
        n = t.numel() * t.element_size()
        counts["bytes"] += n
        counts["reads"] += 1
        counts["largest"] = max(counts["largest"], n)
        return t

    pretrained._read_rows = read_rows
    return counts


def params_of(model, opt):
    with opt.gathered():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def load_cases(rank, ws, cases):
    """Per ``(kind, dtype, stage, offload)``: load the saved files into a model built from
    another seed; return its parameters, the oracle's, the moments/step check and the bytes
    this rank read."""
    counts = counting()
    out = {}
    for kind, dtype, stage, offload, folder in cases:
        model = make_model(kind, 1)
        opt = zk.ZeroOptimizer(model, stage=stage, lr=1e-3, bucket_bytes=BUCKET,
                               ops_backend="reference", **offload_kwargs(offload))
        # A step first: the moments and step count are not zero before the load.
        model(torch.arange(8).view(1, 8), labels=torch.arange(8).view(1, 8)).loss.backward()
        opt.step()
        opt.zero_grad()
        before = dict(counts)
        counts["largest"] = 0
        result = zk.checkpoint.load_pretrained(opt, folder)
        state = [z.read_state() for z in opt.zero_units]
        out[(kind, dtype, stage, offload)] = plain({
            "params": params_of(model, opt), "expected": expected(kind, folder),
            "missing": result.missing_keys, "unexpected": result.unexpected_keys,
            "steps": [s for s, _ in state], "num_steps": opt.stats()["step"],
            "moments": max(float(t.abs().max()) for _, ts in state for t in ts[1:]),
            "bytes": counts["bytes"] - before["bytes"], "largest": counts["largest"],
            "shard_bytes": max(4 * ts[0].numel() for _, ts in state)})
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """``{(kind, dtype): folder}`` written by transformers' own save_pretrained."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for kind in ("llama", "gpt2"):
        for dtype in ("fp32", "bf16"):
            model = make_model(kind, 0)
            if dtype == "bf16":
                model = model.to(torch.bfloat16)
            folder = str(root / f"{kind}-{dtype}")
            model.save_pretrained(folder, max_shard_size=SHARD)
            assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
            assert len(glob.glob(os.path.join(folder, "*.safetensors"))) >= 3
            out[(kind, dtype)] = folder
    return out


def tensor_bytes(folder):
    return sum(t.numel() * t.element_size() for t in file_state(folder).values())


CASES = [("llama", "fp32", 1, None), ("llama", "bf16", 2, None), ("gpt2", "fp32", 3, None),
         ("gpt2", "bf16", 1, None), ("llama", "bf16", 3, None), ("gpt2", "fp32", 2, "cpu"),
         ("llama", "bf16", 3, "nvme"), ("gpt2", "fp32", 3, "cpu+params"),
         ("llama", "fp32", 3, "nvme+params")]


def test_load_pretrained_matches_load_state_dict_and_reads_each_byte_once(files):
    cases = [(k, d, s, o, files[(k, d)]) for k, d, s, o in CASES]
    results = [tensors(r) for r in run_ranks(load_cases, 2, cases, timeout=400.0)]
    for case in CASES:
        kind, dtype, stage, _ = case
        per_rank = [r[case] for r in results]
        for r in per_rank:
            assert r["params"].keys() == r["expected"].keys()
            for n, p in r["params"].items():
                # Bit for bit: fp32 files exactly, bf16 files as their exact widening.
                assert torch.equal(p, r["expected"][n]), (case, n)
            assert r["missing"] == [] and r["unexpected"] == [], case
            assert r["steps"] and set(r["steps"]) == {0} and r["num_steps"] == 0, case
            assert r["moments"] == 0.0, case
            # The read buffer: one piece of one shard at a time (plus a row at each end).
            assert r["largest"] <= r["shard_bytes"] + 2 * 96 * 4 * 2, case
        total = tensor_bytes(files[(kind, dtype)])
        read = [r["bytes"] for r in per_rank]
        # Each rank its half, and over the ranks the file's bytes about once (rows cut by a
        # shard boundary are read by both ranks), never twice.
        assert total * 0.99 <= sum(read) <= total * 1.15, (case, read, total)
        assert all(b <= total * 0.6 for b in read), (case, read, total)
        print(f"{case}: file tensor bytes {total}, read per rank {read}")


def train_and_save(rank, ws, kind, stage, folder):
    """A few steps from seed 0, then save_pretrained in fp32 (several files); return the
    trained parameters."""
    model = make_model(kind, 0)
    opt = zk.ZeroOptimizer(model, stage=stage, lr=1e-2, bucket_bytes=BUCKET,
                           ops_backend="reference")
    ids = torch.arange(8).view(1, 8) + rank
    for _ in range(2):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    zk.checkpoint.save_pretrained(opt, folder, max_shard_size=SHARD)
    return plain(params_of(model, opt))


def load_one(rank, ws, kind, stage, folder, strict=True):
    model = make_model(kind, 7)
    opt = zk.ZeroOptimizer(model, stage=stage, lr=1e-3, bucket_bytes=BUCKET,
                           ops_backend="reference")
    res = zk.checkpoint.load_pretrained(opt, folder, strict=strict)
    return plain({"params": params_of(model, opt), "missing": res.missing_keys,
                  "unexpected": res.unexpected_keys})


@pytest.mark.parametrize("kind,stage", [("gpt2", 3),
                                        pytest.param("llama", 2, marks=pytest.mark.slow)])
def test_save_pretrained_loads_with_from_pretrained_and_at_another_world_size(
        tmp_path, kind, stage):
    folder = str(tmp_path / "out")
    trained = tensors(run_ranks(train_and_save, 2, kind, stage, folder, timeout=300.0)[0])
    names = sorted(os.listdir(folder))
    assert "config.json" in names and "model.safetensors.index.json" in names, names
    assert not os.path.exists(folder + ".zk-tmp")
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all(s in names for s in shards)
    state = file_state(folder)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in state.values())
    if kind == "gpt2":   # tied: written once, as transformers writes it
        assert "transformer.wte.weight" in state and "lm_head.weight" not in state
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
    got = {n: p.detach() for n, p in hf.named_parameters()}
    assert got.keys() == trained.keys()
    for n, p in trained.items():
        assert torch.equal(got[n], p), n
    # The other way round: saved at 2 ranks, loaded at 1.
    back = tensors(run_ranks(load_one, 1, kind, 1, folder, timeout=200.0)[0])
    for n, p in trained.items():
        assert torch.equal(back["params"][n], p), n
    # Saving again replaces the folder whole.
    run_ranks(train_and_save, 2, kind, stage, folder, timeout=300.0)
    assert sorted(os.listdir(folder)) == names


def test_missing_unexpected_and_mismatched_keys(files, tmp_path):
    src = file_state(files[("llama", "fp32")])
    state = dict(src)
    dropped = "model.layers.1.mlp.up_proj.weight"
    del state[dropped]
    state["model.layers.9.extra.weight"] = torch.zeros(3)
    folder = tmp_path / "holey"
    folder.mkdir()
    safetensors_torch.save_file(state, str(folder / "model.safetensors"),
                                metadata={"format": "pt"})
    r = tensors(run_ranks(load_one, 2, "llama", 3, str(folder), False, timeout=200.0)[0])
    assert r["missing"] == [dropped] and r["unexpected"] == ["model.layers.9.extra.weight"]
    fresh = make_model("llama", 7)
    assert torch.equal(r["params"][dropped], fresh.state_dict()[dropped])   # kept its value
    assert torch.equal(r["params"]["model.embed_tokens.weight"], src["model.embed_tokens.weight"])
    with pytest.raises(AssertionError, match="missing keys.*up_proj"):
        run_ranks(load_one, 1, "llama", 1, str(folder), True, timeout=200.0)
    state = dict(src)
    state["model.norm.weight"] = torch.ones(31)
    safetensors_torch.save_file(state, str(folder / "model.safetensors"),
                                metadata={"format": "pt"})
    with pytest.raises(AssertionError, match=r"shapes differ.*model\.norm\.weight"):
        run_ranks(load_one, 1, "llama", 1, str(folder), False, timeout=200.0)


def load_peft(rank, ws, stage, folder):
    import peft
    model = peft.get_peft_model(make_model("llama", 7),
                                peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    opt = zk.ZeroOptimizer(model, stage=stage, lr=1e-3, bucket_bytes=BUCKET,
                           ops_backend="reference")
    res = zk.checkpoint.load_pretrained(opt, folder, strict=False)
    return plain({"params": params_of(model, opt), "missing": res.missing_keys,
                  "unexpected": res.unexpected_keys})


@pytest.mark.parametrize("stage", [1, 3])
def test_peft_prefix_maps_to_the_base_model(files, stage):
    pytest.importorskip("peft")
    folder = files[("llama", "bf16")]
    r = tensors(run_ranks(load_peft, 2, stage, folder, timeout=300.0)[0])
    assert r["unexpected"] == []
    assert r["missing"] and all("lora_" in k for k in r["missing"]), r["missing"]
    src = file_state(folder)
    base = 0
    for n, p in r["params"].items():
        if "lora_" in n:
            continue
        key = n[len("base_model.model."):].replace(".base_layer.", ".")
        assert torch.equal(p, src[key].float()), n
        base += 1
    assert base == len(src)


def test_shard_sizes_read_as_transformers_reads_them():
    from zkernels.checkpoint.pretrained import parse_size
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("20KB") == 20_000 and parse_size(1234) == 1234
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size("5 gigs")


def test_save_pretrained_refuses_to_replace_a_foreign_folder(tmp_path):
    """World size 1, in process: a folder holding anything but an earlier save_pretrained's
    files is left alone; a single-file save (no index) otherwise."""
    model = make_model("llama", 0)
    opt = zk.ZeroOptimizer(model, stage=1, lr=1e-3, ops_backend="reference")
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    with pytest.raises(zk.checkpoint.CheckpointError, match="refusing to replace"):
        zk.checkpoint.save_pretrained(opt, str(folder))
    assert os.listdir(folder) == ["notes.txt"]
    out = tmp_path / "single"
    zk.checkpoint.save_pretrained(opt, str(out), dtype="bf16")
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    state = safetensors_torch.load_file(str(out / "model.safetensors"))
    for n, p in model.named_parameters():
        assert torch.equal(state[n], p.detach().to(torch.bfloat16)), n
