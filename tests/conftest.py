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
