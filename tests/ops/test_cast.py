"""cast and unscale_and_check_ on every backend against zkernels.reference, bit for bit."""
import pytest
import torch

from zkernels import reference
from .conftest import FLOATS
from ._util import NUMPY_WARNINGS, assert_bits_equal, awkward_values, special_values

pytestmark = NUMPY_WARNINGS


def rounding_boundaries() -> torch.Tensor:
    """fp32 bit patterns at every rounding decision of fp32 -> bf16 and fp32 -> fp16.

    For each of the 2**16 bf16 values: itself, +1 ulp, just below / at / just above the tie
    with its successor, and the last pattern before the next value. For each of the 2**16
    fp16 values (NaN and inf included): its fp32 value +-1 ulp, and the exact midpoint to its
    successor +-1 ulp (ties, subnormals, overflow to inf). 786,432 patterns in all.
    """
    h = torch.arange(1 << 16, dtype=torch.int32)
    base = h << 16
    bf16 = torch.cat([base + d for d in (0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF)])
    hv = h.to(torch.int16).view(torch.float16).float()
    hb = hv.view(torch.int32)
    nxt = (h + 1).to(torch.int16).view(torch.float16).float()
    mid = ((hv.double() + nxt.double()) / 2).float().view(torch.int32)
    fp16 = torch.cat([hb, hb + 1, hb - 1, mid, mid + 1, mid - 1])
    return torch.cat([bf16, fp16]).view(torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cast_rounding_boundaries_bit_exact(impl, device, dtype):
    x = rounding_boundaries().to(device)
    out = torch.empty(x.numel(), dtype=dtype, device=device)
    impl("cast")(x, out=out)
    assert_bits_equal(out, x.to(dtype))


@pytest.mark.parametrize("src", FLOATS)
@pytest.mark.parametrize("dst", FLOATS)
def test_cast_dtype_pairs_bit_exact(impl, device, src, dst):
    # Not a multiple of the block, special values included; see also the 278,011 test below.
    x = awkward_values(12_289, device).to(src)
    out = torch.full((12_289,), 3.0, dtype=dst, device=device)
    result = impl("cast")(x, out=out)
    assert result is out
    assert_bits_equal(out, x.to(dst), nan_payload=src in (torch.float32, dst))


@pytest.mark.parametrize("numel", [0, 1, 4095, 4097, 278_011])
def test_cast_sizes_and_new_output(impl, device, numel):
    x = awkward_values(numel, device).reshape(numel, 1)
    y = impl("cast")(x, torch.bfloat16)
    assert y.shape == x.shape
    assert_bits_equal(y, x.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("inv_kind", ["float", "tensor"])
def test_unscale_finite(impl, device, dtype, inv_kind):
    x = awkward_values(278_011, device)
    x = torch.where(torch.isfinite(x), x, torch.ones_like(x)).to(dtype)
    x = torch.where(torch.isfinite(x), x, torch.ones_like(x))  # no fp16 overflow either
    inv = 1.0 / 3.0 if inv_kind == "float" else torch.tensor([1.0 / 3.0], device=device)
    expected, exp_found = x.clone(), torch.zeros(1, device=device)
    reference.unscale_and_check_(expected, inv, exp_found)
    found = torch.zeros(1, device=device)
    assert impl("unscale_and_check_")(x, inv, found) is found
    assert_bits_equal(x, expected)
    assert found.item() == 0.0 and exp_found.item() == 0.0


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_unscale_non_finite_sets_flag(impl, device, dtype, bad):
    x = torch.ones(10_000, dtype=dtype, device=device)
    x[9_999] = bad  # in the last, partial block
    expected, exp_found = x.clone(), torch.zeros(1, device=device)
    reference.unscale_and_check_(expected, 0.5, exp_found)
    found = torch.zeros(1, device=device)
    impl("unscale_and_check_")(x, 0.5, found)
    assert found.item() == 1.0 and exp_found.item() == 1.0
    assert_bits_equal(x, expected)


def test_unscale_never_clears_flag(impl, device):
    x = torch.ones(5000, device=device)
    found = torch.ones(1, device=device)
    impl("unscale_and_check_")(x, 0.5, found)
    assert found.item() == 1.0
    assert torch.equal(x, torch.full_like(x, 0.5))


def test_unscale_checks_before_scaling(impl, device):
    # Like torch's fused unscale: a finite value that the scale overflows is not flagged.
    x = torch.full((100,), 3e38, device=device)
    found = torch.zeros(1, device=device)
    impl("unscale_and_check_")(x, 10.0, found)
    assert found.item() == 0.0
    assert torch.isinf(x).all()


def test_special_values_cast(impl, device):
    x = special_values(device)
    for dtype in (torch.bfloat16, torch.float16):
        assert_bits_equal(impl("cast")(x, dtype), x.to(dtype))


def test_cast_bad_arguments(ops):
    x = torch.ones(8)
    with pytest.raises(ValueError, match="out"):
        ops.cast(x, out=torch.empty(7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x"):
        ops.cast(torch.ones(4, 4).t(), torch.bfloat16)
    with pytest.raises(ValueError, match="out"):
        ops.cast(x, out=torch.empty(8, dtype=torch.bfloat16, device="meta"))
    with pytest.raises(TypeError, match="dtype"):
        ops.cast(x, torch.float16, out=torch.empty(8, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="x"):
        ops.cast(torch.ones(8, dtype=torch.int32), torch.float16)


def test_unscale_bad_arguments(ops):
    x = torch.ones(8)
    with pytest.raises(TypeError, match="found_inf"):
        ops.unscale_and_check_(x, 0.5, torch.zeros(1, dtype=torch.float16))
    with pytest.raises(ValueError, match="found_inf"):
        ops.unscale_and_check_(x, 0.5, torch.zeros(2))
    with pytest.raises(ValueError, match="inv_scale"):
        ops.unscale_and_check_(x, torch.ones(1, device="meta"), torch.zeros(1))
    with pytest.raises(ValueError, match="x"):
        ops.unscale_and_check_(torch.ones(4, 4).t(), 0.5, torch.zeros(1))


def test_nan_bits_half_to_bfloat16(impl, device):
    # PyTorch's half -> bfloat16 NaN differs from its float -> bfloat16 NaN on CPU; both kept.
    x = torch.tensor([0x7E00, 0xFE00, 0x7E01, 0x3C00] * 1000, dtype=torch.int32)
    x = x.to(torch.int16).view(torch.float16).to(device)
    assert_bits_equal(impl("cast")(x, torch.bfloat16), x.to(torch.bfloat16))
