"""examples/hf_trainer.py: a few ZeroTrainer steps of a tiny Llama at stage 3 under torchrun (2
gloo ranks), checkpointed, saved and reloaded with from_pretrained; then resumed from its last
checkpoint in one process (another world size) for a few more steps."""
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers", minversion="5")  # ZeroTrainer needs Trainer 5's hooks
pytest.importorskip("accelerate")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "hf_trainer.py")
SMALL = ["--config", '{"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, '
                     '"num_attention_heads": 4, "num_key_value_heads": 2}',
         "--block-size", "32", "--save-steps", "4"]


def _run(cmd, env):
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return proc.stdout


@pytest.mark.slow  # the example under torchrun, then a resume (parity: tests/integrations)
@pytest.mark.timeout(420)
def test_hf_trainer_example(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    out_dir = str(tmp_path / "out")
    first = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc-per-node", "2", EXAMPLE, "--stage", "3", "--steps", "8",
                  "--batch-size", "4", "--output-dir", out_dir] + SMALL, env)
    assert "stage 3, offload None, 2 ranks: 8 steps" in first, first
    sample = re.search(r"sample: (['\"])(ROMEO:.*)\1", first)
    assert sample and len(sample.group(2)) > len("ROMEO:"), first
    assert sorted(os.listdir(out_dir)) == ["checkpoint-4", "checkpoint-8", "final"]
    # One process, twice the per-device batch: the same global batch, from checkpoint-8.
    second = _run([sys.executable, EXAMPLE, "--stage", "2", "--steps", "12", "--batch-size",
                   "8", "--output-dir", out_dir, "--resume"] + SMALL, env)
    assert "stage 2, offload None, 1 ranks: 12 steps" in second, second
    assert "checkpoint-12" in os.listdir(out_dir)
