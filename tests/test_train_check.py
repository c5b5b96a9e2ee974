"""benchmarks/train_check.py (gpu_check.sh's training step) on CPU: the demo's model at world
size 1 through ZeroOptimizer on torch.distributed against torch.optim.AdamW, one line per
check; and a check it cannot run is a FAIL line and a non-zero exit, never a silent pass."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = "1 2 3"
TINY = ["--device", "cpu", "--steps", "3", "--n-layer", "1", "--n-embd", "32",
        "--block-size", "16", "--batch-size", "2", "--bucket-bytes", "16384"]


@pytest.fixture(scope="module")
def train_check():
    spec = importlib.util.spec_from_file_location("train_check",
                                                  ROOT / "benchmarks" / "train_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_stage_matches_adamw_on_cpu(train_check, capsys, tmp_path):
    out = tmp_path / "rows.json"
    rc = train_check.main(TINY + ["--stages", STAGES, "--backends", "torch",
                                  "--json", str(out)])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0, lines
    checks = [line for line in lines if line.startswith("train stage=")]
    assert len(checks) == len(STAGES.split())
    assert all(" PASS " in line and "engine TorchComm" in line for line in checks), checks
    assert lines[-1] == f"train_check: {len(checks)}/{len(checks)} passed"
    assert out.exists()


def test_a_check_that_cannot_run_fails(train_check, capsys, monkeypatch):
    from zkernels.comm import nccl
    monkeypatch.setattr(nccl, "_C_nccl", None)  # as on a machine without the engine
    rc = train_check.main(TINY + ["--stages", "1", "--backends", "nccl"])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 1 and " FAIL RuntimeError" in lines[0] and "_C_nccl" in lines[0], lines
    assert lines[-1] == "train_check: 0/1 passed"


def test_bad_arguments(train_check):
    with pytest.raises(SystemExit):
        train_check.main(["--device", "cpu", "--backends", "mpi"])
    with pytest.raises(SystemExit):
        train_check.main(["--device", "cpu", "--steps", "0"])
