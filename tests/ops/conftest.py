"""Fixtures of the op tests: every op runs on every backend and is compared with
``zkernels.reference``.

Backends:
    kernels    ``zkernels.kernels`` called directly (Triton: interpreter on CPU, compiled on CUDA)
    triton     ``zkernels.ops`` with ``ZKERNELS_BACKEND=triton`` (checks + dispatch + Triton)
    reference  ``zkernels.ops`` with ``ZKERNELS_BACKEND=reference`` (checks + dispatch + oracle)
    cpp        ``zkernels.ops`` with ``ZKERNELS_BACKEND=cpp`` (checks + the native CPU ops of
               ``zkernels._C``, best SIMD path; tests/native/test_cpu_ops.py forces each path)

``ZKERNELS_OPS_TEST_BACKENDS=kernels`` (a comma list) restricts the parametrization: CI's
passes with the oldest and newest triton run the kernels only (.ci/run says why).
"""
import importlib
import os

import pytest
import torch

ALL_BACKENDS = ("kernels", "triton", "reference", "cpp")


def _backends():
    raw = os.environ.get("ZKERNELS_OPS_TEST_BACKENDS", ",".join(ALL_BACKENDS))
    chosen = tuple(b.strip() for b in raw.split(",") if b.strip())
    unknown = [b for b in chosen if b not in ALL_BACKENDS]
    if unknown or not chosen:
        raise ValueError(f"ZKERNELS_OPS_TEST_BACKENDS must list some of {ALL_BACKENDS}, "
                         f"got {raw!r}")
    return chosen


BACKENDS = _backends()
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    if request.param == "cpp":
        from zkernels import ops
        if torch.cuda.is_available():
            pytest.skip("the cpp backend runs on CPU tensors; these tests run on CUDA here")
        if not ops.available("cpp"):
            pytest.skip("zkernels._C is not built (ZKERNELS_SKIP_EXT=1 install)")
    elif request.param != "reference":
        pytest.importorskip("triton")
    if request.param != "kernels":
        monkeypatch.setenv("ZKERNELS_BACKEND", request.param)
    return request.param


@pytest.fixture
def impl(backend, monkeypatch):
    """``impl(name)``: the function under test for this backend. The per-optimizer keyword ops
    (``lion_step``, ``sgd_step``) exist in ``zkernels.ops`` only (they run the generic
    ``optimizer_step``): the kernels backend runs them there on Triton."""
    module = importlib.import_module("zkernels.kernels" if backend == "kernels" else "zkernels.ops")

    def get(name):
        if backend == "kernels" and not hasattr(module, name):
            monkeypatch.setenv("ZKERNELS_BACKEND", "triton")
            return getattr(importlib.import_module("zkernels.ops"), name)
        return getattr(module, name)
    return get


@pytest.fixture
def ops(monkeypatch):
    """``zkernels.ops`` on the reference backend, for argument-check tests."""
    monkeypatch.setenv("ZKERNELS_BACKEND", "reference")
    return importlib.import_module("zkernels.ops")
