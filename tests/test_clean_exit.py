"""Two-rank runs of examples/train_gpt.py and of the demo's ranks end cleanly, 30 times in a
row: no rank aborts at interpreter exit ("terminate called without an active exception") and
none keeps a gloo thread past its main() (see [Note: process group teardown] in
zkernels/comm/select.py and tests/_exit_zygote.py for how the runs are made cheap)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = 30


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork") or not os.path.isdir("/proc/self/task"),
                    reason="forks ranks and reads their threads from /proc (Linux)")
def test_two_rank_runs_exit_cleanly(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "tests._exit_zygote", "--runs", str(RUNS),
                           "--out", str(tmp_path)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    report = "\n".join(line for line in proc.stdout.splitlines() if line.startswith("run"))
    assert proc.returncode == 0, report + "\n" + proc.stderr[-4000:]
    assert f"{RUNS} of {RUNS} runs exited cleanly" in proc.stdout
    assert "terminate called" not in proc.stderr
