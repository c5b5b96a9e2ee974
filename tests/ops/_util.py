"""Helpers shared by the op tests: bit-level comparison and awkward inputs."""
import pytest
import torch

# Under the interpreter kernels compute in numpy, which warns when a product overflows to inf
# or meets a NaN: expected with these inputs, and PyTorch computes the same values silently.
NUMPY_WARNINGS = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
                  pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, nan_payload=True) -> None:
    """Bit-for-bit equality: stricter than torch.equal (tells -0 from +0, NaN == NaN).

    Args:
        nan_payload: compare NaN bits too. Pass False when the source of a cast was bf16/fp16:
            PyTorch's CPU upcasts of NaN give different bits in the vectorized body and in the
            scalar tail of one tensor, so only NaN positions are defined there. Every
            fp32 -> bf16/fp16 cast is checked with NaN bits (see zkernels/kernels/_rounding.py).
    """
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a = actual.contiguous().view(INT_VIEW[actual.dtype]).cpu()
    e = expected.contiguous().view(INT_VIEW[expected.dtype]).cpu()
    differ = a != e
    if not nan_payload:
        an = torch.isnan(actual).cpu().reshape(a.shape)
        en = torch.isnan(expected).cpu().reshape(a.shape)
        differ = (differ & ~(an & en)) | (an != en)
    bad = differ.nonzero().flatten()
    assert bad.numel() == 0, (f"{bad.numel()} of {a.numel()} elements differ, first at "
                              f"{bad[:5].tolist()}: {a[bad[:5]].tolist()} vs {e[bad[:5]].tolist()}")


def special_values(device) -> torch.Tensor:
    """fp32 values where rounding goes wrong: NaNs, infinities, overflow, ties, subnormals."""
    bits = torch.tensor([
        0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FBFFFFF,              # NaNs (quiet, signalling)
        0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF,              # +-inf, +-max
        0x477FEFFF, 0x477FF000, 0x477FF001, 0x47800000,              # around fp16 overflow
        0x3F808000, 0x3F818000, 0x3F808001, 0x3F80FFFF,              # bf16 ties and neighbours
        0x3F801000, 0x3F803000, 0x3F801001, 0x00000001, 0x80000001,  # fp16 ties, fp32 subnormal
        0x33000000, 0x33000001, 0x337FFFFF, 0x38800000, 0x387FFFFF,  # fp16 subnormal range
        0x00000000, 0x80000000, 0x3F800000, 0xBF800000,              # +-0, +-1
    ], dtype=torch.int64)
    return bits.to(torch.int32).view(torch.float32).to(device)


def awkward_values(n: int, device, seed: int = 0) -> torch.Tensor:
    """``n`` fp32 values: full-mantissa normals of many magnitudes, with the special values
    sprinkled in, so that every cast exercises rounding."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 20, (n,), generator=g).float())
    sv = special_values("cpu")
    if n:
        idx = torch.randint(0, n, (min(n, sv.numel()),), generator=g)
        x[idx] = sv[:idx.numel()]
    return x.to(device)


def integer_values(n: int, device, dtype=torch.float32, seed: int = 0, high: int = 8):
    """Small integers, exact in every dtype, so sums of them are exact in any order."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-high, high + 1, (n,), generator=g).to(dtype).to(device)
