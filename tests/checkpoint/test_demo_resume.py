"""``python -m zkernels demo --ckpt-dir D`` saves each ZeRO rung; ``--resume`` continues them,
here on 1 rank after saving on 2 (same global batch): the continued losses are the
uninterrupted run's, to the demo's round-off tolerance."""
import json
import os
import subprocess
import sys

import pytest

from tests.test_demo import LOSS_ATOL, ROOT, TINY


def _demo(cwd, *extra):
    out = cwd / f"demo{len(list(cwd.glob('demo*.json')))}.json"
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "zkernels", "demo", *TINY, "--rungs", "1,2",
                           "--json", str(out), *extra], capture_output=True, text=True,
                          env=env, timeout=180, cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {r["name"]: r for r in json.loads(out.read_text())["rungs"]}


@pytest.mark.slow  # three demo runs; resume at another world size is in test_resume
def test_demo_saves_and_resumes_at_another_world_size(tmp_path):
    straight = _demo(tmp_path, "--steps", "6")
    _demo(tmp_path, "--steps", "3", "--ckpt-dir", "ck")
    assert sorted(os.listdir(tmp_path / "ck")) == ["stage1", "stage2"]
    resumed = _demo(tmp_path, "--steps", "3", "--ckpt-dir", "ck", "--resume", "--nproc", "1",
                    "--batch-size", "4")
    for name in ("stage 1", "stage 2"):
        assert resumed[name]["first_step"] == 3
        want, got = straight[name]["losses"][3:], resumed[name]["losses"]
        assert max(abs(a - b) for a, b in zip(want, got)) <= LOSS_ATOL, (name, want, got)


def test_demo_resume_needs_zero_rungs_and_a_folder(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    for extra in (["--resume"], ["--resume", "--ckpt-dir", "ck", "--rungs", "ddp,1"]):
        proc = subprocess.run([sys.executable, "-m", "zkernels", "demo", *extra],
                              capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
        assert proc.returncode == 2 and "--resume" in proc.stderr
