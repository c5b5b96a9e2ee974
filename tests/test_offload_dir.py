"""``offload_dir`` is checked by writing before any work: a folder that exists but takes no
file (``/proc``; as root, permission bits say nothing) is one clear error naming offload_dir,
from ``ZeroOptimizer`` itself before its communicator is built, and one usage line from the
command lines that take ``--offload-dir`` (the demo's is in tests/test_demo.py)."""
import argparse
import os
import subprocess
import sys

import pytest
import torch

import zkernels as zk
from zkernels._cli import writable_folder
from zkernels.zero.state.swap import OffloadIOError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("stage", [2, "auto"])
def test_zero_optimizer_probes_offload_dir_up_front(stage, monkeypatch):
    import zkernels.zero.optimizer as optimizer
    monkeypatch.setattr(optimizer, "make_metered_comm",
                        lambda *a, **k: pytest.fail("built the communicator first"))
    kw = dict(offload="nvme") if stage == 2 else {}
    for folder in ("/proc", "/proc/new"):   # an existing one, and one to create in it
        with pytest.raises(OffloadIOError, match=rf"offload_dir='{folder}' is not writable: "
                                                 r"cannot create files there \(\[Errno"):
            zk.ZeroOptimizer(torch.nn.Linear(4, 4), stage=stage, offload_dir=folder, **kw)


def test_the_probe_leaves_nothing_behind(tmp_path):
    opt = zk.ZeroOptimizer(torch.nn.Linear(4, 4), stage=2, offload="nvme",
                           offload_dir=str(tmp_path))
    # Only the run's own folder (removed by close()): no probe folder or file.
    assert [p.name.startswith("zkernels-offload-rank0-") for p in tmp_path.iterdir()] == [True]
    opt.close()
    assert list(tmp_path.iterdir()) == []
    # A missing folder is probed in its parent (where it will be made), and not made by the
    # check alone.
    spec = zk.ZeroConfig.from_kwargs(stage=2, offload="nvme",
                                     offload_dir=str(tmp_path / "new")).offload
    assert zk.zero.state.placement.check_offload_dir(spec) is None
    assert list(tmp_path.iterdir()) == []


def test_writable_folder_type(tmp_path):
    assert writable_folder(str(tmp_path)) == str(tmp_path)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(argparse.ArgumentTypeError, match="'/proc' is not writable: cannot "
                                                         "create files there"):
        writable_folder("/proc")
    with pytest.raises(argparse.ArgumentTypeError, match="is not an existing folder"):
        writable_folder(str(tmp_path / "missing"))
    assert not (tmp_path / "missing").exists()


def test_hf_trainer_example_refuses_an_unwritable_offload_dir():
    # Under torchrun each rank parses its own arguments: one usage line, before the model.
    pytest.importorskip("transformers")
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "hf_trainer.py"),
                           "--stage", "2", "--offload", "nvme", "--offload-dir", "/proc"],
                          capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "argument --offload-dir: '/proc' is not writable" in proc.stderr
    assert "Traceback" not in proc.stderr
