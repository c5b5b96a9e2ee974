"""examples/hf_causal_lm.py under torchrun (2 gloo ranks): a few steps of a tiny GPT-2 and a
tiny Llama from the command line, loss going down, and a greedy sample at the end."""
import os
import re
import subprocess
import sys

import pytest

from tests._stages import ALL_STAGES

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "hf_causal_lm.py")
MODELS = {
    "GPT2LMHeadModel": '{"n_embd": 32, "n_layer": 2, "n_head": 2}',
    "LlamaForCausalLM": '{"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, '
                        '"num_attention_heads": 4, "num_key_value_heads": 2}',
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model", [pytest.param("GPT2LMHeadModel", marks=pytest.mark.slow),
                                   "LlamaForCausalLM"])
def test_hf_example_trains(model):
    stage = max(ALL_STAGES)  # the highest rung: the most hooks on the HF model
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", EXAMPLE, "--model", model, "--config", MODELS[model], "--stage", str(stage),
         "--steps", "12", "--log-every", "11", "--block-size", "32", "--batch-size", "4",
         "--lr", "3e-3", "--generate", "8", "--timeout", "60"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert f"stage {stage}, 2 ranks" in out, out[-2000:]
    losses = [float(v) for v in re.findall(r"step +\d+  loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 2 and losses[1] < losses[0] - 0.3, proc.stdout
    sample = re.search(r"sample: (['\"])(ROMEO:.*)\1", proc.stdout)  # repr of the text
    assert sample and len(sample.group(2)) > len("ROMEO:"), proc.stdout
    assert "done: 12 steps" in proc.stdout
