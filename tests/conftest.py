"""Shared test configuration.

Triton kernels run on CPU tensors under the interpreter: TRITON_INTERPRET must be set before
``triton.jit`` decorates anything, so it is set here, before any test module imports
zkernels.kernels, unless a CUDA device is present (then the compiled kernels run; see
benchmarks/gpu_check.sh).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# [Note: tolerance table]
# One table for every arithmetic comparison (data movement and casts are compared bit for bit
# with torch.equal instead). rtol/atol per dtype of the *result* being compared, against a
# reference computed in fp32 (or fp64) with the same recipe. A low-precision backend may err at
# most twice as much as PyTorch itself in that dtype (flash-attention's rule): the bf16/fp16
# entries are 2x the dtype's unit roundoff, scaled for a few chained ops.
TOLERANCES = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.bfloat16: dict(rtol=2 * 2**-8, atol=1e-2),
    torch.float16: dict(rtol=2 * 2**-11, atol=1e-3),
}


def tol(dtype: torch.dtype) -> dict:
    """rtol/atol for comparing results of ``dtype`` (see [Note: tolerance table])."""
    return TOLERANCES[dtype]


def devices():
    """Devices the op tests run on: CPU always (Triton via the interpreter), CUDA when present."""
    return ["cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.fixture(params=devices())
def device(request):
    return torch.device(request.param)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# [Note: the quick suite and the full suite]
# `python -m pytest -q` (the README's test command) runs the quick suite: every op and backend,
# every rung at world sizes 1 and 2, parity, traffic, memory, errors, checkpoints. Tests marked
# `slow` (world size 4 batteries, soaks, fault timing, the two-agent launch, torch.compile,
# repeated clean-exit runs) are deselected there and run with `--full` (everything) or
# `-m slow` (only them); .ci/run runs the quick suite and then `-m slow`, so CI runs every
# test. An explicit `-m` expression is left alone.
def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="also run the tests marked slow (CI runs them: .ci/run)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full") or config.getoption("markexpr"):
        return
    keep = [item for item in items if item.get_closest_marker("slow") is None]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep


def _zkernels_env():
    return {k: v for k, v in os.environ.items() if k.startswith("ZKERNELS_")}


_ENV_AT_START = _zkernels_env()


@pytest.fixture(autouse=True)
def zkernels_env_unchanged():
    """Fail a test that leaves a ZKERNELS_* variable changed in the pytest process: the
    backend and ISA choices read them, so a leak would run every later test on another
    backend (tests set them in subprocesses, or with monkeypatch, which restores them)."""
    yield
    now = _zkernels_env()
    if now != _ENV_AT_START:
        changed = sorted(k for k in set(now) | set(_ENV_AT_START)
                         if now.get(k) != _ENV_AT_START.get(k))
        for k in changed:  # restore, so one leak fails one test, not every later one
            if k in _ENV_AT_START:
                os.environ[k] = _ENV_AT_START[k]
            else:
                os.environ.pop(k, None)
        pytest.fail(f"the test left {changed} changed in the pytest process (set them in a "
                    f"subprocess or with monkeypatch.setenv)", pytrace=False)

