"""examples/train_gpt.py under torchrun (2 gloo ranks): a run interrupted and resumed from its
per-rank checkpoint ends bit-identical to an uninterrupted one; checkpoints go to runs/train_gpt/
by default, a folder the repository ignores."""
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_gpt.py")
TINY = ["--n-layer", "1", "--n-embd", "32", "--block-size", "16", "--batch-size", "2",
        "--warmup-steps", "2", "--accum-steps", "2"]


def _run(cwd, *args):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", EXAMPLE, *TINY, *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def test_resume_matches_uninterrupted(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    straight.mkdir()
    resumed.mkdir()
    out = _run(straight, "--steps", "6", "--ckpt-every", "100")
    assert "done: 6 of 6 steps" in out
    _run(resumed, "--steps", "6", "--ckpt-every", "100", "--stop-at", "3")
    _run(resumed, "--steps", "6", "--ckpt-every", "100", "--resume")
    ckpts = os.path.join("runs", "train_gpt")     # the default --ckpt-dir
    for rank in range(2):
        a = _load(straight / ckpts / f"rank{rank}-of-2.pt")
        b = _load(resumed / ckpts / f"rank{rank}-of-2.pt")
        assert a["step"] == b["step"] == 6
        assert a["model"].keys() == b["model"].keys()
        for name in a["model"]:
            assert torch.equal(a["model"][name], b["model"][name]), name
        assert a["sched"]["last_epoch"] == b["sched"]["last_epoch"]
    # No temp file is left behind by the atomic writes.
    assert not any(p.suffix == ".tmp" for p in (resumed / ckpts).iterdir())
    assert not (straight / "checkpoints").exists()


def test_default_run_folder_is_ignored_by_git():
    git = subprocess.run(["git", "check-ignore", "-q", "runs/train_gpt/rank0-of-2.pt"],
                         cwd=ROOT, capture_output=True)
    if git.returncode == 128:
        pytest.skip("not a git checkout (an sdist): nothing to ignore")
    assert git.returncode == 0, "runs/ is not in .gitignore"
