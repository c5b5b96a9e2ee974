"""``python -m zkernels plan``: the ZeRO paper's example in the right rows, the marked choice,
config.json counting, and the dispatcher's errors."""
import json
import os
import subprocess
import sys

import pytest

from zkernels.__main__ import main as zk_main
from zkernels.plan import params_from_hf_config, parse_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rows(text):
    """{rung name: [column strings]} from the printed table, and the chosen rung name."""
    rows, chosen = {}, None
    for line in text.splitlines():
        if line[:2] in ("* ", "  ") and any(w in line for w in ("data parallel", "stage")):
            name = line[2:26].strip()
            rows[name] = line[26:].split()
            if line.startswith("*"):
                chosen = name
    return rows, chosen


def test_plan_paper_example_subprocess():
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-m", "zkernels", "plan", "--params", "7.5e9",
                          "--world-size", "64", "--paper",
                          "--device-memory", "24GiB"], capture_output=True, text=True,
                         env=env, timeout=120, check=True).stdout
    rows, chosen = _rows(out)
    states = {name: cols[4] for name, cols in rows.items()}   # the "states" column
    assert states["data parallel"] == "120.0"
    assert states["stage 1"] == "31.4"
    assert states["stage 2"] == "16.6"
    assert states["stage 3"] == "1.9"
    # 24 GiB = 25.8 GB, 90% usable = 23.2 GB: stage 1 (31.4 GB + buffers) does not fit.
    assert chosen == "stage 2"
    assert "stage 2 is the lowest rung that fits" in out


@pytest.mark.parametrize("memory, expected", [("40GB", "stage 1"), ("20GB", "stage 2"),
                                              ("4GB", "stage 3"),
                                              ("100MB", "stage 3 + cpu offload")])
def test_plan_marks_the_lowest_rung_that_fits(capsys, tmp_path, memory, expected):
    path = tmp_path / "plan.json"
    rc = zk_main(["plan", "--params", "7.5e9", "--world-size", "64", "--device-memory", memory,
                  "--paper", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert _rows(out)[1] == expected
    data = json.loads(path.read_text())
    assert data["rows"][2]["model_states_bytes"] == 16_640_625_000
    if expected == "stage 3 + cpu offload":
        assert "not available in this version" in out
    else:
        assert "not available in this version" not in out


def test_plan_nothing_fits(capsys):
    rc = zk_main(["plan", "--params", "7.5e9", "--world-size", "64", "--device-memory", "1MB"])
    assert rc == 1
    assert "nothing fits" in capsys.readouterr().out


def test_plan_bad_input(capsys):
    assert zk_main(["plan", "--params", "1e6", "--world-size", "2", "--device-memory",
                    "lots"]) == 2
    assert "--device-memory" in capsys.readouterr().err
    assert zk_main(["plan", "--model", "nosuchfile", "--world-size", "2"]) == 2
    assert "--model" in capsys.readouterr().err


def test_plan_model_factory_and_hf_config(capsys, tmp_path):
    assert zk_main(["plan", "--model", "tests.test_cli:tiny_gpt", "--world-size", "2"]) == 0
    from zkernels.plan import load_model_spec
    num = sum(p.numel() for p in tiny_gpt().parameters())
    assert f"{num:,} params" in capsys.readouterr().out
    assert load_model_spec("tests.test_cli:tiny_gpt").cfg.n_layer == 1
    # Llama-2-7B and GPT-2 (124M): known totals (GPT-2's biases, 0.1M, are not counted).
    llama = dict(model_type="llama", vocab_size=32000, hidden_size=4096, num_hidden_layers=32,
                 num_attention_heads=32, intermediate_size=11008, tie_word_embeddings=False,
                 rope_theta=10000.0)
    assert params_from_hf_config(llama) == 6_738_415_616
    gpt2 = dict(model_type="gpt2", vocab_size=50257, n_embd=768, n_layer=12, n_head=12,
                n_positions=1024)
    assert abs(params_from_hf_config(gpt2) - 124_439_808) < 0.001 * 124_439_808
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(llama))
    assert zk_main(["plan", "--model", str(cfg), "--world-size", "8"]) == 0
    assert "6,738,415,616 params" in capsys.readouterr().out


def tiny_gpt():
    from zkernels.demo.model import GPT, GPTConfig
    return GPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, block_size=8))


def test_parse_bytes():
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("24GiB") == 24 * 2**30
    assert parse_bytes("1.5e9") == 1_500_000_000
    with pytest.raises(ValueError, match="--device-memory"):
        parse_bytes("12 parsecs")


def test_dispatcher(capsys):
    assert zk_main([]) == 2
    assert zk_main(["frobnicate"]) == 2
    assert "unknown subcommand" in capsys.readouterr().err


def test_dispatcher_missing_subcommand_module(capsys, monkeypatch):
    import zkernels.__main__ as zm
    monkeypatch.setitem(zm.SUBCOMMANDS, "bench", ("zkernels.no_such_bench.__main__", "x"))
    assert zm.main(["bench"]) == 2
    assert "not available" in capsys.readouterr().err
