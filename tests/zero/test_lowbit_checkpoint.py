"""Low-bit moments in ``zkernels.checkpoint`` ([Note: low-bit moments in a checkpoint] in
zkernels/checkpoint/_lowbit.py): kept as trained, resumed bit for bit at another world size
and stage, converted (with a warning) into another format, exported in fp32."""
import logging
import os

import pytest
import torch

from tests._dist import run_ranks
from zkernels import ZeroOptimizer, checkpoint
from zkernels.checkpoint import manifest
from zkernels.checkpoint._lowbit import read_lowbit, saved_format
from zkernels.checkpoint._read import CheckpointFiles
from zkernels.demo.model import GPT, GPTConfig
from zkernels.reference.adamw_lowbit import moments_from_codes, quantize_exp_avg

CFG = GPTConfig(vocab_size=128, block_size=8, n_layer=1, n_head=2, n_embd=48)
BLOCK = 32


def _model(seed=0):
    torch.manual_seed(seed)
    return GPT(CFG)


def _train(model, opt, steps, seed=1, rank=0, ws=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(128, (2 * ws, CFG.block_size), generator=gen)[2 * rank:2 * rank + 2]
        opt.backward(model(x, x))
        opt.step()
        opt.zero_grad()


def _raw(path):
    """Every parameter's saved moments, whole: ``{name: (format, raw tensors)}``."""
    m = manifest.read(path)
    out = {}
    with CheckpointFiles(path, m) as files:
        for name, p in m["params"].items():
            desc = saved_format(m, name)
            numel = torch.Size(p["shape"]).numel()
            out[name] = (desc, read_lowbit(files, name, 0, numel, desc))
    return out


def _save_on_ranks(rank, ws, path, state):
    model = _model()
    opt = ZeroOptimizer(model, stage=2, lr=1e-2, state_dtype=state, state_block_size=BLOCK)
    _train(model, opt, 3, rank=rank, ws=ws)
    checkpoint.save(opt, path)
    opt.close()


@pytest.mark.parametrize("state", ["int8", pytest.param("bf16", marks=pytest.mark.slow)])
def test_the_state_moves_bit_for_bit_to_another_world_size_and_stage(tmp_path, state):
    """Saved by 2 ranks at stage 2, loaded by 1 at stage 3 and saved again: every parameter's
    codes and scales (or bf16 moments) are the same bits (no block is split: every shard
    starts at a multiple of the block size)."""
    a, b = str(tmp_path / "two"), str(tmp_path / "one")
    run_ranks(_save_on_ranks, 2, a, state)
    opt = ZeroOptimizer(_model(5), stage=3, state_dtype=state, state_block_size=BLOCK)
    checkpoint.load(opt, a)
    checkpoint.save(opt, b)
    saved, again = _raw(a), _raw(b)
    assert saved.keys() == again.keys()
    for name, (desc, (_, _, raw)) in saved.items():
        assert desc == {"dtype": state, "block_size": BLOCK,
                        **({"code": "float8"} if state == "int8" else {})}
        assert again[name][0] == desc
        for k, t in raw.items():
            assert torch.equal(t, again[name][1][2][k]), (name, k)


def _run(state, block, stage, steps_before, path=None, load=None):
    model = _model()
    opt = ZeroOptimizer(model, stage=stage, lr=1e-2, state_dtype=state, state_block_size=block)
    if load is not None:
        checkpoint.load(opt, load)
    _train(model, opt, steps_before, seed=2 if load else 1)
    if path is not None:
        checkpoint.save(opt, path)
    with opt.gathered():
        return [p.detach().clone() for p in model.parameters()], opt


def test_resume_continues_bit_for_bit(tmp_path):
    path = str(tmp_path / "c")
    model = _model()
    opt = ZeroOptimizer(model, stage=1, lr=1e-2, state_dtype="int8", state_block_size=BLOCK)
    _train(model, opt, 2)
    checkpoint.save(opt, path)
    _train(model, opt, 2, seed=2)
    resumed, _ = _run("int8", BLOCK, 2, 2, load=path)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed))


def test_other_formats_convert_and_say_so(tmp_path, caplog):
    """int8 blocks of 32 into int8 blocks of 16 (requantized: each moment moves by at most
    half a step of its new code), into fp32 (dequantized exactly), and fp32 into int8."""
    path, fp32_path = str(tmp_path / "int8"), str(tmp_path / "fp32")
    _run("int8", BLOCK, 1, 3, path=path)
    saved = _raw(path)
    with caplog.at_level(logging.WARNING, logger="zkernels.checkpoint"):
        _, small = _run("int8", 16, 2, 0, load=path)
    assert "int8 (blocks of 32), this optimizer keeps int8 (blocks of 16)" in caplog.text
    with caplog.at_level(logging.WARNING, logger="zkernels.checkpoint"):
        _, wide = _run(None, BLOCK, 2, 0, load=path, path=fp32_path)
    assert "int8 (blocks of 32), this optimizer keeps fp32" in caplog.text
    exported = checkpoint.consolidate_moments(fp32_path)
    for name, (_, (m, v, _)) in saved.items():   # int8 -> fp32: the dequantized values
        assert torch.equal(exported[name]["exp_avg"].reshape(-1), m), name
        assert torch.equal(exported[name]["exp_avg_sq"].reshape(-1), v), name
    moved = _requantized_move(small, saved)
    assert moved["exp_avg"] <= 1 + 1e-3 and moved["exp_avg_sq"] <= 1 + 1e-3, moved
    assert moved["exp_avg"] > 0.5 and moved["exp_avg_sq"] > 0.5, moved   # tight: can fail
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zkernels.checkpoint"):
        _run("int8", BLOCK, 1, 0, load=fp32_path)
    assert "holds AdamW moments in fp32, this optimizer keeps int8" in caplog.text


def _requantized_move(opt, saved):
    """The largest move of a requantized moment in units of half a step of its new code
    (``2**-(mant+1)`` of the value, ``2**(-14-mant-1)`` of the block's absmax below
    ``2**-14`` of it; the sqrt domain for ``exp_avg_sq``)."""
    worst = {"exp_avg": 0.0, "exp_avg_sq": 0.0}
    for u in opt.units:
        low = opt.zero_units[u.index].read_lowbit_state()
        for name, a, s, n in u.param_slices_in_shard():
            _, (m, v, _) = saved[name]
            bs = 16
            sm = low["exp_avg_scales"].repeat_interleave(bs)[s:s + n]
            sv = low["exp_avg_sq_scales"].repeat_interleave(bs)[s:s + n]
            got_m, got_v = moments_from_codes(low["exp_avg"][s:s + n],
                                              low["exp_avg_sq"][s:s + n], sm, sv)
            for k, ref, got, sc, mant in (("exp_avg", m[a:a + n], got_m, sm, 3),
                                          ("exp_avg_sq", v[a:a + n].sqrt(), got_v.sqrt(), sv,
                                           4)):
                half = torch.maximum(ref.abs() * 2.0 ** -(mant + 1),
                                     sc * 2.0 ** (-14 - mant - 1)) * (1 + 1e-5)
                err = (got - ref).abs() / half.clamp_min(1e-30)
                worst[k] = max(worst[k], float(err.max()))
    return worst


def _edit_manifest(path, change):
    m = manifest.read(path)
    for p in m["params"].values():
        for piece in p["pieces"]:
            if "state_format" in piece:
                change(piece["state_format"])
    with open(os.path.join(path, manifest.MANIFEST), "wb") as f:
        f.write(manifest.dumps({k: v for k, v in m.items() if k != "manifest_crc32"}))


def test_linear_codes_of_earlier_versions_convert_and_unknown_codes_are_refused(tmp_path,
                                                                                caplog):
    """An int8 state_format without "code" (written before the float codes) is read with the
    linear map (m = q * scale, sqrt(v) = q * scale) and requantized, saying so; a code this
    version does not know is refused by name."""
    path = str(tmp_path / "c")
    _run("int8", BLOCK, 1, 3, path=path)
    _edit_manifest(path, lambda desc: desc.pop("code"))
    old = _raw(path)
    name, (desc, (m, v, raw)) = next(iter(old.items()))
    assert "code" not in desc
    sm = raw["exp_avg_scales"].repeat_interleave(BLOCK)[:m.numel()]
    sv = raw["exp_avg_sq_scales"].repeat_interleave(BLOCK)[:m.numel()]
    assert torch.equal(m, raw["exp_avg"].float() * sm)
    assert torch.equal(v, (raw["exp_avg_sq"].float() * sv) ** 2)
    with caplog.at_level(logging.WARNING, logger="zkernels.checkpoint"):
        _, opt = _run("int8", BLOCK, 2, 0, load=path)
    assert ("int8 (blocks of 32, linear codes of an earlier zkernels), this optimizer keeps "
            "int8 (blocks of 32)") in caplog.text
    for u in opt.units:   # requantized from the linear values, in the float codes
        low = opt.zero_units[u.index].read_lowbit_state()
        for pname, a, s, n in u.param_slices_in_shard():
            want_q, want_s = quantize_exp_avg(old[pname][1][0][a:a + n], BLOCK)
            assert torch.equal(low["exp_avg"][s:s + n], want_q), pname
            assert torch.equal(low["exp_avg_scales"][s // BLOCK:s // BLOCK + want_s.numel()],
                               want_s), pname
    _edit_manifest(path, lambda desc: desc.update(code="nf4"))
    with pytest.raises(ValueError, match="int8 moment code 'nf4'"):
        _run("int8", BLOCK, 2, 0, load=path)


def test_consolidate_moments_exports_fp32(tmp_path):
    path = str(tmp_path / "c")
    _, opt = _run("bf16", BLOCK, 2, 2, path=path)
    exported = checkpoint.consolidate_moments(path)
    u = opt.units[0]
    _, (_, m, v) = opt.zero_units[u.index].read_state()
    for name, a, s, n in u.param_slices_in_shard():
        assert exported[name]["exp_avg"].dtype == torch.float32
        assert torch.equal(exported[name]["exp_avg"].reshape(-1)[a:a + n], m[s:s + n])
        assert torch.equal(exported[name]["exp_avg_sq"].reshape(-1)[a:a + n], v[s:s + n])
    assert os.path.isfile(os.path.join(path, "manifest.json"))
