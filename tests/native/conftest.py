"""Fixtures for the native-extension tests.

The extension must exist wherever these tests run (an editable install builds it); when it
is missing they build it in place once (``python setup.py build_ext --inplace``) and fail,
never skip, if that does not work. ``ZKERNELS_SKIP_EXT=1`` is the one explicit opt-out (an
install made without the extension): then only the fallback tests run.
"""
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def skip_ext_requested() -> bool:
    return os.environ.get("ZKERNELS_SKIP_EXT", "").strip().lower() in ("1", "on", "true", "yes")


def _build_in_place() -> str:
    env = dict(os.environ, ZKERNELS_CUDA=os.environ.get("ZKERNELS_CUDA", "0"))
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    return proc.stdout[-3000:] + proc.stderr[-3000:] if proc.returncode else ""


@pytest.fixture(scope="session")
def native_C():
    """The zkernels._C module, built in place first if it is missing."""
    if skip_ext_requested():
        pytest.skip("ZKERNELS_SKIP_EXT=1: installed without the native extension")
    try:
        return importlib.import_module("zkernels._C")
    except ImportError as exc:
        first_error = exc
    log = _build_in_place()
    try:
        return importlib.import_module("zkernels._C")
    except ImportError as exc:
        pytest.fail(f"zkernels._C is missing ({first_error}) and building it in place failed "
                    f"({exc}):\n{log}")


ISAS = ("scalar", "avx2", "avx512")


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """One intra-op thread per test (``ZKERNELS_TEST_THREADS``, see tests/_dist.py): the 2
    cores are shared, and a 2-thread parallel region waits for a descheduled thread (50x
    slower here under load). The threaded path is tested explicitly (num_threads=2) and by
    the C++ tests."""
    import torch
    from tests._dist import rank_threads
    before = torch.get_num_threads()
    torch.set_num_threads(rank_threads())
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=ISAS)
def isa(request, native_C, monkeypatch):
    """Each SIMD path in turn, forced through ZKERNELS_CPU_ISA (read by zkernels._cpu)."""
    if not native_C.cpu_isa_supported(request.param):
        pytest.skip(f"this CPU cannot run the {request.param} path")
    monkeypatch.setenv("ZKERNELS_CPU_ISA", request.param)
    return request.param
