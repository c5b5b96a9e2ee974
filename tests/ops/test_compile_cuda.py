"""Every Triton kernel compiles for an sm_90 GPU (H100/H200), checked without one.

Triton compiles to PTX and cubin on the host (its bundled LLVM and ptxas need no driver), so a
kernel that only the interpreter has run cannot reach a GPU machine broken. The full-block
paths must also use 128-bit global accesses: that is what the unmasked branch and the
alignment hints are for (see [Note: multi-tensor launches] in zkernels/kernels/_tables.py).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
from ._compile_sm90 import CASES, NO_FMA  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def results():
    # A fresh process: here TRITON_INTERPRET=1 already made every kernel an interpreted one.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "tests.ops._compile_sm90"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_compiles_for_sm90(results, case):
    result = results[case]
    assert result["ok"], result.get("error")
    if CASES[case][3]:
        assert result["wide"], f"{case}: no 128-bit global access in the PTX"
    if case in NO_FMA:   # bit-exact arithmetic: no contraction, IEEE divisions only
        assert not result["fma"] and not result["approx_div"], result
