"""``python -m zkernels plan``: the ZeRO paper's example in the right rows, the marked choice,
rungs compared at one reduce dtype, config.json counting (against transformers' own models),
bad options refused before any work, and the dispatcher's errors."""
import json
import os
import re
import subprocess
import sys

import pytest

from zkernels import hf_params
from zkernels.__main__ import main as zk_main
from zkernels.plan import params_from_hf_config, parse_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rows(text):
    """{rung name: [column strings]} from the printed table, and the chosen rung name."""
    rows, chosen = {}, None
    for line in text.splitlines():
        if line[:2] in ("* ", "  ") and any(w in line for w in ("data parallel", "stage")):
            # the name column is as wide as the longest rung name; columns are 2+ spaces apart
            name, *cols = re.split(r"\s{2,}", line[2:].strip())
            rows[name] = cols
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


def test_plan_module_runs_as_the_subcommand():
    """``python -m zkernels.plan`` prints the same table as ``python -m zkernels plan`` (it
    printed nothing and exited 0)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    args = ["--params", "7.5e9", "--world-size", "64", "--paper", "--optimizer", "sgd"]
    outs = [subprocess.run([sys.executable, "-m", *mod, *args], capture_output=True,
                           text=True, env=env, timeout=120, check=True).stdout
            for mod in (["zkernels.plan"], ["zkernels", "plan"])]
    assert "stage 3" in outs[0] and outs[0] == outs[1]


@pytest.mark.parametrize("memory, expected", [("40GB", "stage 1"), ("20GB", "stage 2"),
                                              ("4GB", "stage 3"),
                                              ("1GB", "stage 3 + cpu offload"),
                                              # 7.5e9 bf16 params / 64 ranks: 234 MB of
                                              # parameter shards, which only offload_params
                                              # takes off the device
                                              ("100MB", "stage 3 + cpu offload + params on host")])
def test_plan_marks_the_lowest_rung_that_fits(capsys, tmp_path, memory, expected):
    path = tmp_path / "plan.json"
    rc = zk_main(["plan", "--params", "7.5e9", "--world-size", "64", "--device-memory", memory,
                  "--paper", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert _rows(out)[1] == expected
    data = json.loads(path.read_text())
    assert data["rows"][2]["model_states_bytes"] == 16_640_625_000


def test_plan_nothing_fits(capsys):
    rc = zk_main(["plan", "--params", "7.5e9", "--world-size", "64", "--device-memory", "1MB"])
    assert rc == 1
    assert "nothing fits" in capsys.readouterr().out


def _usage_error(capsys, *argv):
    """argparse's refusal: exit status 2 and one 'error:' line naming the option."""
    with pytest.raises(SystemExit) as exc:
        zk_main(list(argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    return err.strip().splitlines()[-1]


def test_plan_bad_input(capsys):
    err = _usage_error(capsys, "plan", "--params", "1e6", "--world-size", "2",
                       "--device-memory", "lots")
    assert "argument --device-memory" in err
    assert zk_main(["plan", "--model", "nosuchfile", "--world-size", "2"]) == 2
    assert "--model" in capsys.readouterr().err
    # A bare number is refused (16 what?), naming the flag and the units it takes.
    err = _usage_error(capsys, "plan", "--params", "1e6", "--world-size", "2",
                       "--device-memory", "16")
    assert "argument --device-memory: needs a unit" in err and "16GB or 16GiB" in err
    for bad in ("-5", "0", "1.5", "nan", "inf", "many"):
        err = _usage_error(capsys, "plan", "--params", bad, "--world-size", "2")
        assert "argument --params" in err and "model_or_num_params" not in err
    assert "argument --world-size" in _usage_error(capsys, "plan", "--params", "1e6",
                                                   "--world-size", "0")
    assert "argument --headroom" in _usage_error(capsys, "plan", "--params", "1e6",
                                                 "--world-size", "2", "--headroom", "1")


def test_plan_help_says_sizes_need_a_unit(capsys):
    with pytest.raises(SystemExit):
        zk_main(["plan", "-h"])
    out = " ".join(capsys.readouterr().out.split())
    assert "a bare number is refused" in out and "24GiB" in out


def test_plan_json_into_a_missing_folder_is_refused_first(capsys, tmp_path, monkeypatch):
    import zkernels.plan as plan
    monkeypatch.setattr(plan, "ladder_table", lambda *a, **k: pytest.fail("did the work"))
    err = _usage_error(capsys, "plan", "--params", "1e6", "--world-size", "2", "--json",
                       str(tmp_path / "missing" / "plan.json"))
    assert "argument --json" in err and "does not exist" in err
    assert not (tmp_path / "missing").exists()
    assert "is a folder" in _usage_error(capsys, "plan", "--params", "1e6", "--world-size",
                                         "2", "--json", str(tmp_path))


def _comm(out):
    rows, _ = _rows(out)
    return {name: (float(cols[10]), cols[11]) for name, cols in rows.items()}


def test_plan_compares_rungs_at_one_reduce_dtype(capsys):
    # The same reduce dtype as the compute dtype: data parallel's all-reduce and stages 1-2's
    # reduce-scatter + all-gather send the same bytes (the paper's 2Ψ); the table says which.
    assert zk_main(["plan", "--params", "1.5e9", "--world-size", "8", "--reduce-dtype",
                    "bf16"]) == 0
    comm = _comm(capsys.readouterr().out)
    assert comm["data parallel"] == comm["stage 1"] == comm["stage 2"] == (5.2, "bf16")
    # ZeroOptimizer's default fp32 reduction: data parallel reduces in fp32 too (2·4Ψ·7/8 =
    # 10.5 GB), stages 1-2 reduce-scatter fp32 and all-gather bf16 ((4 + 2)Ψ·7/8 = 7.9 GB).
    assert zk_main(["plan", "--params", "1.5e9", "--world-size", "8"]) == 0
    comm = _comm(capsys.readouterr().out)
    assert comm["data parallel"] == (10.5, "fp32")
    assert comm["stage 1"] == comm["stage 2"] == (7.9, "fp32")


def test_plan_model_factory_and_hf_config(capsys, tmp_path):
    assert zk_main(["plan", "--model", "tests.test_cli:tiny_gpt", "--world-size", "2"]) == 0
    from zkernels.plan import load_model_spec
    num = sum(p.numel() for p in tiny_gpt().parameters())
    assert f"{num:,} params" in capsys.readouterr().out
    assert load_model_spec("tests.test_cli:tiny_gpt")[0].cfg.n_layer == 1
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA2_7B))
    assert zk_main(["plan", "--model", str(cfg), "--world-size", "8"]) == 0
    assert "6,738,415,616 params" in capsys.readouterr().out


# The sizes of published models as their config.json files give them (keys left out take
# transformers' defaults), and the parameter counts of the real models.
LLAMA2_7B = dict(model_type="llama", vocab_size=32000, hidden_size=4096, num_hidden_layers=32,
                 num_attention_heads=32, intermediate_size=11008, tie_word_embeddings=False,
                 rope_theta=10000.0)
GPT2_SMALL = dict(model_type="gpt2", vocab_size=50257, n_embd=768, n_layer=12, n_head=12,
                  n_positions=1024, n_ctx=1024, activation_function="gelu_new")
MISTRAL_7B = dict(model_type="mistral", vocab_size=32000, hidden_size=4096,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=14336, tie_word_embeddings=False, rope_theta=10000.0)
MIXTRAL_8X7B = dict(MISTRAL_7B, model_type="mixtral", num_local_experts=8,
                    num_experts_per_tok=2, rope_theta=1e6)


@pytest.mark.parametrize("cfg, expected", [(GPT2_SMALL, 124_439_808),
                                           (LLAMA2_7B, 6_738_415_616),
                                           (MISTRAL_7B, 7_241_732_096),
                                           (MIXTRAL_8X7B, 46_702_792_704)])
def test_hf_config_formula_known_models(cfg, expected, capsys, tmp_path, monkeypatch):
    assert params_from_hf_config(cfg) == expected
    # Without transformers, plan counts with the formula and says so.
    monkeypatch.setattr(hf_params, "params_from_transformers",
                        lambda cfg: (None, "transformers is not installed"))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert zk_main(["plan", "--model", str(path), "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert f"{expected:,} params" in out and "config.json formula" in out


def _small(kind):
    """transformers' default config of ``kind``, shrunk (odd sizes, GQA, a head_dim that is
    not hidden/heads), as a config.json dict."""
    from transformers import AutoConfig
    cfg = AutoConfig.for_model(kind).to_dict()
    small = dict(hidden_size=64, n_embd=64, num_hidden_layers=3, n_layer=3,
                 num_attention_heads=4, n_head=4, num_key_value_heads=2, intermediate_size=96,
                 vocab_size=101, max_position_embeddings=128, n_positions=128,
                 moe_intermediate_size=48, shared_expert_intermediate_size=80, num_experts=4,
                 num_local_experts=4, head_dim=24, decoder_sparse_step=1)
    cfg.update((k, v) for k, v in small.items() if k in cfg)
    for k in ("layer_types", "transformers_version", "architectures"):
        cfg.pop(k, None)
    return dict(cfg, pad_token_id=None, bos_token_id=None, eos_token_id=None)


@pytest.mark.parametrize("kind", hf_params.CHECKED_MODEL_TYPES)
def test_hf_config_formula_matches_transformers(kind):
    # transformers' own model, built from the config (random init, meta device: nothing
    # downloaded, no memory), has exactly the parameters the formula counts.
    pytest.importorskip("transformers")
    for cfg in (_small(kind), _full(kind)):
        real, how = hf_params.params_from_transformers(cfg)
        assert real is not None, how
        assert params_from_hf_config(cfg) == real, (kind, cfg)
    if kind == "qwen2_moe":    # dense layers between the sparse ones
        cfg = dict(_small(kind), decoder_sparse_step=2, mlp_only_layers=[1])
        assert params_from_hf_config(cfg) == hf_params.params_from_transformers(cfg)[0]


def _full(kind):
    from transformers import AutoConfig
    cfg = AutoConfig.for_model(kind).to_dict()
    for k in ("transformers_version", "architectures"):
        cfg.pop(k, None)
    return cfg


def test_plan_counts_gpt2_as_transformers_does(capsys, tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GPT2_SMALL))
    assert zk_main(["plan", "--model", str(path), "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "124,439,808 params" in out and "GPT2LMHeadModel" in out


def tiny_gpt():
    from zkernels.demo.model import GPT, GPTConfig
    return GPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, block_size=8))


def test_parse_bytes():
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("24GiB") == 24 * 2**30
    assert parse_bytes("1.5e9B") == 1_500_000_000
    assert parse_bytes("1.5e9", "--bucket-bytes", bare_unit="B") == 1_500_000_000
    with pytest.raises(ValueError, match="--device-memory"):
        parse_bytes("12 parsecs")
    with pytest.raises(ValueError, match="--device-memory needs a unit"):
        parse_bytes("16")


def test_dispatcher(capsys):
    assert zk_main([]) == 2
    assert zk_main(["frobnicate"]) == 2
    assert "unknown subcommand" in capsys.readouterr().err


def test_dispatcher_missing_subcommand_module(capsys, monkeypatch):
    import zkernels.__main__ as zm
    monkeypatch.setitem(zm.SUBCOMMANDS, "bench", ("zkernels.no_such_bench.__main__", "x"))
    assert zm.main(["bench"]) == 2
    assert "not available" in capsys.readouterr().err


def _python_m(*args, **kw):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          env=env, timeout=120, **kw)


def test_version():
    import tomllib

    import zkernels
    proc = _python_m("zkernels", "--version")
    assert proc.returncode == 0 and proc.stdout == f"zkernels {zkernels.__version__}\n"
    # The version the package reports is the one it is built with.
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        assert tomllib.load(f)["project"]["version"] == zkernels.__version__
    assert "--version" in _python_m("zkernels", "--help").stdout


def test_checkpoint_subcommand_is_the_checkpoint_module(tmp_path, capsys):
    # `python -m zkernels checkpoint` and `python -m zkernels.checkpoint`: one main.
    import zkernels as zk
    import zkernels.checkpoint.__main__ as ck_main
    from zkernels.__main__ import SUBCOMMANDS
    assert SUBCOMMANDS["checkpoint"][0] == ck_main.__name__
    model = tiny_gpt()
    opt = zk.ZeroOptimizer(model, stage=1, lr=1e-3)
    zk.checkpoint.save(opt, tmp_path / "ck")
    proc = _python_m("zkernels", "checkpoint", "verify", str(tmp_path / "ck"))
    assert proc.returncode == 0, proc.stderr
    assert "every checksum matches" in proc.stdout
    out = tmp_path / "w.pt"
    assert zk_main(["checkpoint", "consolidate", str(tmp_path / "ck"), str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    import torch
    got = torch.load(out, weights_only=True)
    assert set(got) == set(model.state_dict())
    # Its errors name the subcommand as typed (exit 1, one line, no traceback).
    proc = _python_m("zkernels", "checkpoint", "verify", str(tmp_path / "missing"))
    assert proc.returncode == 1 and proc.stderr.startswith("zkernels checkpoint: error: ")
    assert "Traceback" not in proc.stderr
    with pytest.raises(SystemExit):
        zk_main(["checkpoint", "-h"])
    assert "usage: python -m zkernels checkpoint" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["plan", "--params", "7.5e9", "--world-size", "64", "--link-gbps", "100"],
    ["--help"], ["--version"], ["checkpoint", "verify", "{ck}"]])
def test_output_into_a_closed_pipe_ends_quietly(argv, tmp_path):
    # `python -m zkernels plan ... | head`: the reader exits before the output is written
    # (`true` reads nothing; the import of torch takes far longer than its exit), so every
    # write meets a closed pipe: status 1 and nothing on stderr, never a BrokenPipeError
    # traceback or "Exception ignored ... BrokenPipeError" at exit. (argparse's -h swallows
    # the error of its own write.)
    if "{ck}" in argv:
        import zkernels as zk
        zk.checkpoint.save(zk.ZeroOptimizer(tiny_gpt(), stage=1, lr=1e-3), tmp_path / "ck")
        argv = [a.format(ck=tmp_path / "ck") for a in argv]
    cmd = " ".join([sys.executable, "-m", "zkernels", *argv]) + " | (exec 0<&-; true)"
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(["bash", "-c", "set -o pipefail; " + cmd + "; echo rc=$?"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert "BrokenPipe" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr == "" and proc.stdout == "rc=1\n", (proc.stdout, proc.stderr)


def test_output_through_head_is_whole_up_to_its_line():
    # The same with the reader of the issue: `head -n 1` takes the first line and exits.
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(f"{sys.executable} -m zkernels plan --params 7.5e9 --world-size 64 "
                          f"| head -n 1", shell=True, capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("7,500,000,000 params")
    assert proc.stdout.count("\n") == 1 and proc.stderr == "", proc.stderr
