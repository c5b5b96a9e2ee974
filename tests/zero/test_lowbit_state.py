"""Low-bit optimizer state (issue 28) in one process: the bytes stats() measures against the
formula and estimate_memory, non-finite gradients skipped, per-group formats, bad input named,
and opt.state_dict() resuming bit for bit or converting with a warning. Parity on ranks is
the battery's (``state=`` rows in tests/zero/_battery.py)."""
import copy
import logging

import pytest
import torch

from zkernels import ZeroOptimizer, estimate_memory
from zkernels.demo.model import GPT, GPTConfig
from zkernels.reference.adamw_lowbit import LowbitAdamW
from zkernels.zero.planning.state_format import StateFormat, state_bytes

# n_embd 128: biases and norms are half a 256-block, so padding stays ~2% of the moments.
CFG = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=128)
FORMATS = {None: None, "bf16": StateFormat(torch.bfloat16), "int8": StateFormat("int8")}


def _gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(CFG)


def _steps(model, opt, n, seed=1, poison=None):
    gen = torch.Generator().manual_seed(seed)
    for i in range(n):
        x = torch.randint(256, (2, CFG.block_size), generator=gen)
        opt.backward(model(x, x))
        if poison == i:
            next(model.parameters()).grad[0, 0] = float("inf")   # stage 1 keeps .grad
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("state", [None, "bf16", "int8"])
@pytest.mark.parametrize("stage", [1, 2])
def test_stats_match_the_formula_and_estimate_memory(stage, state):
    model = _gpt()
    opt = ZeroOptimizer(model, stage=stage, state_dtype=state)
    _steps(model, opt, 1)
    held = opt.stats()["memory_bytes"]["optimizer_states"]
    # Exact: the formula over the (padded) shards: fp32 8 B/element, bf16 4, int8 2 + 8/block.
    assert held == sum(state_bytes(u.layout.shard_numel, FORMATS[state]) for u in opt.units)
    est = estimate_memory(model, 1, stage, state_dtype=state).optimizer_states_bytes
    assert abs(held - est) <= 0.03 * est, (held, est)
    psi = sum(p.numel() for p in model.parameters())
    per_param = {None: 8, "bf16": 4, "int8": 2 + 8 / 256}[state]
    assert est == pytest.approx(per_param * psi, rel=1e-3)


def test_nonfinite_gradient_skips_the_step_bit_for_bit():
    model = _gpt()
    opt = ZeroOptimizer(model, stage=1, state_dtype="int8")
    _steps(model, opt, 2)
    before = copy.deepcopy(opt.state_dict()["state"])
    params = [p.detach().clone() for p in model.parameters()]
    _steps(model, opt, 1, seed=5, poison=0)
    assert opt.stats()["overflow_skips"] == 1
    after = opt.state_dict()["state"]
    for i, s in before.items():
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, after[i][k]), k
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))


def test_per_group_formats_and_the_oracle():
    """One group int8, one bf16, one fp32: each unit keeps its group's format, and the int8
    and bf16 groups step exactly as LowbitAdamW on the same parameters."""
    model = torch.nn.Sequential(torch.nn.Linear(40, 70), torch.nn.Linear(70, 30),
                                torch.nn.Linear(30, 5))
    ref = copy.deepcopy(model)
    groups = [{"params": model[0].parameters(), "state_dtype": "int8"},
              {"params": model[1].parameters(), "state_dtype": torch.bfloat16},
              {"params": model[2].parameters(), "state_dtype": None}]
    # The default ops (the native CPU step where built): bit for bit LowbitAdamW's, whose
    # reference takes a correctly rounded sqrt ([Note: correctly rounded sqrt]).
    opt = ZeroOptimizer(model, stage=2, lr=1e-2, weight_decay=0.1, param_groups=groups,
                        state_dtype="bf16", state_block_size=32)
    assert "state_dtype" not in opt.param_groups[0]
    dtypes = {u.group_index: opt.shard_update.states[u.index].exp_avg.dtype for u in opt.units}
    assert dtypes == {0: torch.int8, 1: torch.bfloat16, 2: torch.float32}
    oracles = [LowbitAdamW(ref[0].parameters(), "int8", lr=1e-2, weight_decay=0.1,
                           block_size=32),
               LowbitAdamW(ref[1].parameters(), torch.bfloat16, lr=1e-2, weight_decay=0.1)]
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        x = torch.randn(8, 40, generator=gen)
        opt.backward(model(x).square().mean())
        opt.step()
        opt.zero_grad()
        ref(x).square().mean().backward()
        for o in oracles:
            o.step()
        ref.zero_grad(set_to_none=True)
        ref[2].weight.data.copy_(model[2].weight)   # the fp32 group: torch's AdamW's business
        ref[2].bias.data.copy_(model[2].bias)
    for i in (0, 1):
        for p, q in zip(model[i].parameters(), ref[i].parameters()):
            assert torch.equal(p, q), i


def test_bad_input_is_named(tmp_path):
    m = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="state_dtype must be None"):
        ZeroOptimizer(m, state_dtype="int4")
    with pytest.raises(ValueError, match="state_block_size must be a power of two"):
        ZeroOptimizer(m, state_dtype="int8", state_block_size=100)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['state_dtype'\]"):
        ZeroOptimizer(m, param_groups=[{"params": m.parameters(), "state_dtype": "int2"}])
    with pytest.raises(ValueError, match=r"state_dtype='bf16' is not supported by "
                                         r"optimizer='sgd': no low-bit SGD body"):
        ZeroOptimizer(m, optimizer="sgd", lr=0.1, state_dtype="bf16")
    with pytest.raises(ValueError, match="applies to the fused AdamW only"):   # a torch class
        ZeroOptimizer(m, optimizer=torch.optim.SGD, lr=0.1, state_dtype="bf16")


@pytest.mark.parametrize("state", ["bf16", "int8"])
def test_state_dict_resumes_bit_for_bit(state):
    model, twin = _gpt(), _gpt(1)
    opt = ZeroOptimizer(model, stage=2, state_dtype=state, lr=1e-2)
    _steps(model, opt, 2)
    sd = copy.deepcopy(opt.state_dict())
    assert sd["state"][0]["state_format"]["dtype"] == state
    _steps(model, opt, 2, seed=7)
    opt2 = ZeroOptimizer(twin, stage=2, state_dtype=state, lr=1e-2)
    opt2.load_state_dict(sd)
    _steps(twin, opt2, 2, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_state_dict_converts_between_formats_and_says_so(caplog):
    """bf16 <-> fp32 (same layout) converts with a WARNING; int8 <-> fp32 has another layout
    (blocks aligned), refused by name in favour of zkernels.checkpoint."""
    model = _gpt()
    opt = ZeroOptimizer(model, stage=1, state_dtype="bf16")
    _steps(model, opt, 2)
    sd = opt.state_dict()
    fp32 = ZeroOptimizer(_gpt(1), stage=1)
    with caplog.at_level(logging.WARNING, logger="zkernels.zero"):
        fp32.load_state_dict(sd)
    assert "bf16 -> fp32" in caplog.text
    m = fp32.zero_units[0].read_state()[1][1]
    assert torch.equal(m, sd["state"][0]["exp_avg"].float())
    caplog.clear()
    back = ZeroOptimizer(_gpt(2), stage=1, state_dtype="bf16")
    with caplog.at_level(logging.WARNING, logger="zkernels.zero"):
        back.load_state_dict(fp32.state_dict())
    assert "fp32 -> bf16" in caplog.text
    assert torch.equal(back.zero_units[0].read_lowbit_state()["exp_avg"],
                       sd["state"][0]["exp_avg"])
    int8 = ZeroOptimizer(_gpt(3), stage=1, state_dtype="int8")
    with pytest.raises(ValueError, match="convert through zkernels.checkpoint"):
        int8.load_state_dict(sd)


def test_plan_takes_the_state_dtype(capsys):
    from zkernels.plan import main
    rows = {}
    for state in ("fp32", "int8"):
        assert main(["--params", "1e9", "--world-size", "8", "--state-dtype", state,
                     "--unit", "B"]) == 0
        rows[state] = capsys.readouterr().out
    assert "int8 adamw" in rows["int8"] and "nvme" in rows["fp32"]
    assert "nvme" in rows["int8"].split("\n", 1)[1]   # NVMe rungs keep low-bit files too
    optim = {s: int(float(next(line for line in out.splitlines()
                               if line.strip().startswith("stage 2 ")).split()[5]))
             for s, out in rows.items()}
    assert optim["int8"] == pytest.approx(optim["fp32"] * (2 + 8 / 256) / 8, rel=1e-3)
