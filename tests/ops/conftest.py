"""Fixtures of the op tests: every op runs on every backend and is compared with
``zkernels.reference``.

Backends:
    kernels    ``zkernels.kernels`` called directly (Triton: interpreter on CPU, compiled on CUDA)
    triton     ``zkernels.ops`` with ``ZKERNELS_BACKEND=triton`` (checks + dispatch + Triton)
    reference  ``zkernels.ops`` with ``ZKERNELS_BACKEND=reference`` (checks + dispatch + oracle)
    cpp        ``zkernels.ops`` with ``ZKERNELS_BACKEND=cpp`` (checks + the native CPU ops of
               ``zkernels._C``, best SIMD path; tests/native/test_cpu_ops.py forces each path)
"""
import importlib

import pytest
import torch

BACKENDS = ("kernels", "triton", "reference", "cpp")
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
def impl(backend):
    """``impl(name)``: the function under test for this backend."""
    module = importlib.import_module("zkernels.kernels" if backend == "kernels" else "zkernels.ops")
    return lambda name: getattr(module, name)


@pytest.fixture
def ops(monkeypatch):
    """``zkernels.ops`` on the reference backend, for argument-check tests."""
    monkeypatch.setenv("ZKERNELS_BACKEND", "reference")
    return importlib.import_module("zkernels.ops")
