"""The native CPU copy / cast / unscale / sum-of-squares ops (zkernels._C through zkernels._cpu)
against zkernels.reference, bit for bit, every SIMD path forced in turn; the paths and thread
counts against each other. (tests/ops runs the whole op suite on the best path too.)"""
import math

import pytest
import torch

from zkernels import _cpu, reference
from zkernels.layout import FlatLayout
from tests.native._copy_checks import (FLOATS, bucket_pack_unpack_bit_exact,
                                       flatten_unflatten_bit_exact, values)
from tests.ops._util import assert_bits_equal, awkward_values, integer_values, special_values

# Not multiples of any vector width or of the 16K-element OpenMP tile; empty ones too.
NUMELS = [0, 1, 7, 15, 17, 33, 4097, 16_383, 16_385, 0, 40_009]


@pytest.mark.parametrize("src", FLOATS)
@pytest.mark.parametrize("dst", FLOATS)
def test_flatten_unflatten_bit_exact(isa, src, dst):
    flatten_unflatten_bit_exact(_cpu, values(NUMELS, src),
                                FlatLayout.build(NUMELS, world_size=3, align=8), dst)


@pytest.mark.parametrize("src", FLOATS)
@pytest.mark.parametrize("dst", FLOATS)
@pytest.mark.parametrize("scale", [1.0, 0.125, 3.0])
def test_bucket_pack_unpack_bit_exact(isa, src, dst, scale):
    bucket_pack_unpack_bit_exact(_cpu, values(NUMELS, src, seed=3),
                                 FlatLayout.build(NUMELS, world_size=4, align=8), dst, scale)


@pytest.mark.parametrize("src", FLOATS)
@pytest.mark.parametrize("dst", FLOATS)
def test_cast_bit_exact(isa, src, dst):
    x = torch.cat([special_values("cpu"), awkward_values(40_009, "cpu")]).to(src)
    out = torch.full((x.numel(),), 9.0, dtype=dst)
    assert _cpu.cast(x, out=out) is out
    assert_bits_equal(out, x.to(dst), nan_payload=src in (torch.float32, dst))


def test_cast_nan_patterns(isa):
    # torch's CPU NaN patterns: fp32 -> bf16 0xFFFF, fp16 -> bf16 0x7FC0, -> fp16 the payload.
    h = torch.tensor([0x7E00, 0xFE00, 0x7E01, 0x3C00] * 9, dtype=torch.int32)
    h = h.to(torch.int16).view(torch.float16)
    assert_bits_equal(_cpu.cast(h, torch.bfloat16), h.to(torch.bfloat16))
    x = special_values("cpu").repeat(3)
    for dtype in (torch.bfloat16, torch.float16):
        assert_bits_equal(_cpu.cast(x, dtype), x.to(dtype))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("inv", [1.0, 1.0 / 3.0, "tensor"])
def test_unscale_bit_exact(isa, dtype, inv):
    x = awkward_values(40_009, "cpu", seed=4)
    x = torch.where(torch.isfinite(x), x, torch.ones_like(x)).to(dtype)
    x = torch.where(torch.isfinite(x), x, torch.ones_like(x))
    inv_scale = torch.tensor([0.25]) if inv == "tensor" else inv
    expected, exp_found = x.clone(), torch.zeros(1)
    reference.unscale_and_check_(expected, inv_scale, exp_found)
    found = torch.zeros(1)
    assert _cpu.unscale_and_check_(x, inv_scale, found) is found
    assert_bits_equal(x, expected)
    assert found.item() == 0.0 == exp_found.item()


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("where", [0, 7, 15, 16, 16_383, 16_384, 40_008])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_unscale_flags_non_finite_anywhere(isa, dtype, where, bad):
    x = torch.full((40_009,), 2.0, dtype=dtype)
    x[where] = bad
    expected, exp_found = x.clone(), torch.zeros(1)
    reference.unscale_and_check_(expected, 0.5, exp_found)
    found = torch.zeros(1)
    _cpu.unscale_and_check_(x, 0.5, found)
    assert found.item() == 1.0 == exp_found.item()
    assert_bits_equal(x, expected, nan_payload=dtype == torch.float32)


@pytest.mark.parametrize("dtype", FLOATS)
def test_sum_squares_exact_where_fp32_is(isa, dtype):
    sizes = [0, 1, 15, 17, 4097, 16_384, 16_385, 100_003]
    ts = [integer_values(n, "cpu", dtype, seed=i, high=3) for i, n in enumerate(sizes)]
    assert torch.equal(_cpu.sum_squares(ts), reference.sum_squares(ts))


def test_sum_squares_mixed_dtypes_and_tolerance(isa):
    g = torch.Generator().manual_seed(2)
    ts = [(torch.randn(n, generator=g) * 10).to(dt) for n, dt in
          ((100_003, torch.float32), (7, torch.bfloat16), (40_009, torch.float16))]
    exact = sum(float(t.double().pow(2).sum()) for t in ts)
    got = _cpu.sum_squares(ts)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert math.isclose(float(got), exact, rel_tol=1e-6)
    torch.testing.assert_close(got, reference.sum_squares(ts), rtol=1e-5, atol=0)


def test_sum_squares_non_finite(isa):
    assert math.isinf(float(_cpu.sum_squares([torch.tensor([1.0, float("inf")])])))
    assert math.isnan(float(_cpu.sum_squares([torch.ones(20), torch.tensor([float("nan")])])))
    assert math.isinf(float(_cpu.sum_squares([torch.full((10,), 3e38)])))  # fp32 overflow


def test_paths_and_threads_agree_bit_for_bit(native_C):
    """Every path and thread count: same copies, same flag, and the same sum (its order is
    fixed: [Note: sum_squares order])."""
    # 670K elements: two threads really split the copies (one per 256K elements, see
    # [Note: when the list ops go parallel] in csrc/cpu_ops/cpu_ops.cpp).
    numels = [600_007, 5, 70_001]
    ts = values(numels, torch.float32, seed=8)
    layout = FlatLayout.build(numels, world_size=2, align=8)
    results = []
    for isa in ("scalar", "avx2", "avx512"):
        if not native_C.cpu_isa_supported(isa):
            continue
        for threads in (1, 2):
            bucket = torch.zeros(layout.padded_numel, dtype=torch.bfloat16)
            native_C.cpu_copy_segments(ts, bucket, layout.offsets, True, 0.125, True, isa,
                                       threads)
            x = bucket.clone()
            found = torch.zeros(1)
            native_C.cpu_unscale_and_check(x, 8.0, found, isa, threads)
            total = torch.zeros(())
            native_C.cpu_sum_squares(ts + [bucket], total, isa, threads)
            results.append((isa, threads, bucket, x, found, total))
    for isa, threads, *bufs in results[1:]:
        for a, b in zip(bufs, results[0][2:]):
            assert_bits_equal(a, b), (isa, threads)


def test_copy_offsets_are_bounds_checked(native_C):
    ts = [torch.ones(4), torch.ones(3)]
    with pytest.raises(ValueError, match=r"offsets\[1\]"):
        native_C.cpu_copy_segments(ts, torch.zeros(6), [0, 4], True)
    with pytest.raises(ValueError, match=r"offsets\[0\]"):
        native_C.cpu_copy_segments(ts, torch.zeros(8), [-1, 4], True)
    with pytest.raises(ValueError, match="offsets"):
        native_C.cpu_copy_segments(ts, torch.zeros(8), [0], True)
    with pytest.raises(ValueError, match="flat"):
        native_C.cpu_copy_segments(ts, torch.zeros(16)[::2], [0, 4], True)
    with pytest.raises(TypeError, match=r"tensors\[0\]"):
        native_C.cpu_copy_segments([torch.ones(4, dtype=torch.int32)], torch.zeros(8), [0], True)


def test_forced_path_through_env_is_checked(native_C, monkeypatch):
    monkeypatch.setenv("ZKERNELS_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="isa"):
        _cpu.cast(torch.ones(4), torch.bfloat16)
