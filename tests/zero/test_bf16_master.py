"""``master_dtype=torch.bfloat16`` ([Note: bf16 master] in zkernels/zero/state/bf16_master.py)
in one process: the master bytes stats() measures against the formula and estimate_memory,
low-bit moments beside a bf16 master against LowbitAdamW rounded the same way, the known
failure mode (an update under half an ulp is lost), state_dict resumes, bad input named.
Parity with fp32 moments on ranks is the battery's (``master=`` rows in
tests/zero/_battery.py)."""
import re

import pytest
import torch

from zkernels import ZeroOptimizer, estimate_memory
from zkernels.demo.model import GPT, GPTConfig
from zkernels.reference.adamw_lowbit import LowbitAdamW

CFG = GPTConfig(vocab_size=128, block_size=8, n_layer=1, n_head=2, n_embd=64)
BF16 = torch.bfloat16
HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _model(seed=0):
    torch.manual_seed(seed)
    return GPT(CFG)


def _train(model, opt, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(128, (2, CFG.block_size), generator=gen)
        opt.backward(model(x, x))
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("stage, offload, params", [
    (1, None, False), (2, None, False), (3, None, False), (2, "cpu", False),
    (3, "cpu", True)])
def test_master_bytes_match_the_formula_and_estimate(stage, offload, params):
    """0 bytes where the bf16 parameter shard is the master, 2 per element where it is
    apart (a host master beside the device's shard); fp32 master: 4."""
    model = _model()
    est = estimate_memory(_model(), 1, stage, param_dtype=BF16, master_dtype=BF16,
                          offload=offload, offload_params=params)
    fp32 = estimate_memory(_model(), 1, stage, param_dtype=BF16, offload=offload,
                           offload_params=params)
    opt = ZeroOptimizer(model, stage=stage, param_dtype=BF16, master_dtype=BF16,
                        offload=offload, offload_params=params, **HP)
    _train(model, opt, 1)
    held = opt.stats()["memory_bytes"]["master"]
    shard = sum(u.layout.shard_numel for u in opt.units)
    apart = offload == "cpu" and not params
    assert held == est.master_bytes == (2 * shard if apart else 0)
    assert fp32.master_bytes == 4 * shard
    opt.close()


@pytest.mark.parametrize("state", ["bf16", "int8"])
def test_lowbit_moments_with_a_bf16_master_match_the_oracle(state):
    """Stage 2 (fused low-bit kernel on the bf16 master) against LowbitAdamW on an fp32 copy
    of the bf16 weights, rounded to nearest even after each step: the same bits, on the
    default ops (the native CPU step where built: it and the reference both take a correctly
    rounded sqrt, [Note: correctly rounded sqrt])."""
    model, ref = _model(), _model().to(BF16)
    opt = ZeroOptimizer(model, stage=2, param_dtype=BF16, master_dtype=BF16, state_dtype=state,
                        state_block_size=32, **HP)
    masters = [p.detach().float().clone() for p in ref.parameters()]
    oracle = LowbitAdamW(masters, BF16 if state == "bf16" else "int8", lr=HP["lr"],
                         betas=HP["betas"], eps=HP["eps"], weight_decay=HP["weight_decay"],
                         block_size=32)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randint(128, (2, CFG.block_size), generator=gen)
        opt.backward(model(x, x))
        opt.step()
        opt.zero_grad()
        ref(x, x).backward()
        for q, c in zip(masters, ref.parameters()):
            q.grad, c.grad = c.grad.float(), None
        oracle.step()
        with torch.no_grad():
            for q, c in zip(masters, ref.parameters()):
                q.copy_(q.to(BF16).float())
                c.copy_(q)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_an_update_under_half_an_ulp_is_lost():
    """The cost of round-to-nearest-even: weights of 1.0 (bf16 ulp 2**-7) with AdamW updates
    of lr = 1e-3 < 2**-8 never move with a bf16 master; an fp32 master moves them."""
    moved = {}
    for master in (None, BF16):
        model = torch.nn.Linear(64, 1, bias=False)
        torch.nn.init.ones_(model.weight)
        opt = ZeroOptimizer(model, stage=1, param_dtype=BF16, master_dtype=master, lr=1e-3,
                            weight_decay=0.0)
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)).to(BF16)
        for _ in range(10):
            opt.backward(model(x).float().pow(2).mean())
            opt.step()
            opt.zero_grad()
        moved[master] = float((opt.zero_units[0].read_state()[1][0] - 1.0).abs().max())
    assert moved[BF16] == 0.0
    assert moved[None] == pytest.approx(1e-2, rel=0.1)   # ten updates of lr each


def test_state_dict_resumes_bit_for_bit_and_loads_into_an_fp32_master():
    model, twin, wide = _model(), _model(1), _model(2)
    kw = dict(stage=2, param_dtype=BF16, **HP)
    opt = ZeroOptimizer(model, master_dtype=BF16, **kw)
    _train(model, opt, 2)
    sd = opt.state_dict()
    master = sd["state"][0]["master"]
    assert master.dtype == torch.float32 and torch.equal(master, master.to(BF16).float())
    opt2 = ZeroOptimizer(twin, master_dtype=BF16, **kw)
    opt2.load_state_dict(sd)
    fp32 = ZeroOptimizer(wide, **kw)   # an fp32 master takes the bf16 values exactly
    fp32.load_state_dict(sd)
    assert all(torch.equal(a.read_state()[1][0], b.read_state()[1][0])
               for a, b in zip(fp32.zero_units, opt.zero_units))
    _train(model, opt, 2, seed=2)
    _train(twin, opt2, 2, seed=2)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_bad_input_is_named(tmp_path):
    m = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="master_dtype must be None"):
        ZeroOptimizer(m, param_dtype=BF16, master_dtype=torch.float16)
    with pytest.raises(ValueError, match="needs bf16 parameters"):
        ZeroOptimizer(m, param_dtype=torch.float16, master_dtype=BF16)
    with pytest.raises(ValueError, match="needs bf16 parameters"):
        ZeroOptimizer(m, master_dtype=BF16)   # fp32 parameters
    with pytest.raises(ValueError, match="applies to the fused AdamW only"):
        ZeroOptimizer(m, param_dtype=BF16, master_dtype=BF16, optimizer="sgd", lr=0.1)


def test_plan_takes_the_master_dtype(capsys):
    from zkernels.plan import main
    rows = {}
    for master in ("fp32", "bf16"):
        assert main(["--params", "1e9", "--world-size", "8", "--param-dtype", "bf16",
                     "--master-dtype", master, "--unit", "B"]) == 0
        rows[master] = capsys.readouterr().out.split("\n\n")[0]
    col = {}
    for m, out in rows.items():
        lines = out.splitlines()
        head = re.split(r"\s{2,}", next(x for x in lines if x.startswith("rung")))
        col[m] = {cells[0]: int(float(cells[head.index("master")]))
                  for cells in (re.split(r"\s{2,}", x.strip()) for x in lines
                                if x.startswith("  stage"))}
    assert col["fp32"]["stage 2"] == 4 * 10 ** 9 // 8   # the master column, bytes per rank
    assert col["bf16"]["stage 2"] == 0                   # the bf16 weights are the master
    assert col["bf16"]["stage 2 + cpu offload"] == 2 * 10 ** 9 // 8
    assert col["bf16"]["stage 2 + nvme offload"] == 2 * 10 ** 9 // 8   # (a bf16 file)


def test_nvme_keeps_a_bf16_master_file_and_resumes_it(tmp_path):
    """NVMe: the master's swap file is bf16 (2 bytes per element on disk, sub-groups of 2048
    elements: several per unit here), the steps are the bits of CPU offload's, and a kept
    folder resumes bit for bit."""
    from zkernels.zero.planning.offload_config import OffloadConfig
    budget = OffloadConfig(nvme_buffer_bytes=3 * 2048 * 22 + 2 * 4096)

    def nvme(folder, **config):
        model = _model()
        return model, ZeroOptimizer(model, stage=2, param_dtype=BF16, master_dtype=BF16,
                                    offload="nvme", offload_dir=str(tmp_path / folder),
                                    offload_config=OffloadConfig(
                                        nvme_buffer_bytes=budget.nvme_buffer_bytes,
                                        **config), **HP)
    model, opt = nvme("a")
    eng = opt.shard_update
    assert eng.place.sub_group_numel == 2048 < max(r.numel for r in eng.states)
    for rec in eng.states:
        f = rec.files["master"]
        assert f.dtype == BF16 and f.data_bytes == -(-2 * rec.numel // 4096) * 4096
    _train(model, opt, 2)
    kept = opt.close(keep_files=True)
    resumed, opt2 = nvme("b", resume_dir=kept)
    _train(resumed, opt2, 2, seed=2)
    twin = _model()
    ref = ZeroOptimizer(twin, stage=2, param_dtype=BF16, master_dtype=BF16, offload="cpu", **HP)
    _train(twin, ref, 2)
    _train(twin, ref, 2, seed=2)
    assert all(torch.equal(p, q) for p, q in zip(resumed.parameters(), twin.parameters()))
    opt2.close()
    ref.close()


def test_checkpoint_moves_a_bf16_master_to_another_stage(tmp_path):
    """zk.checkpoint: saved at stage 1, loaded at stage 3 (CPU offload, a bf16 host master):
    the same master values, and both continue to the same bits."""
    from zkernels import checkpoint
    path = str(tmp_path / "c")
    model = _model()
    opt = ZeroOptimizer(model, stage=1, param_dtype=BF16, master_dtype=BF16, **HP)
    _train(model, opt, 2)
    checkpoint.save(opt, path)
    other = _model(3)
    opt3 = ZeroOptimizer(other, stage=3, param_dtype=BF16, master_dtype=BF16, offload="cpu",
                         **HP)
    checkpoint.load(opt3, path)
    _train(model, opt, 2, seed=2)
    _train(other, opt3, 2, seed=2)
    with opt3.gathered():
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), other.parameters()))
    opt3.close()
