"""The checked fast path of the CPU copy ops and the unscale (zkernels._C.cpu_copy_checked and
cpu_unscale_checked, tried first by zkernels.ops and OpSet: [Note: checked fast path of the
copy ops] in python/src/cpu_ops.cpp).

It must (1) give the reference's bits on every forced SIMD path, through the public ops and an
OpSet, (2) decline, writing nothing, every call the checked Python path would refuse or route
elsewhere, so that the public ops still raise their messages and honour ZKERNELS_BACKEND.
Both ways of reading the tensors run (the ``reads`` fixture): the stable C shim, and torch's
getters, which the fast paths use while a torch-function mode is active ([Note: tensor fields
through the stable C shim] in python/src/tensor_fast.h)."""
import ctypes
import os

import pytest
import torch
from torch.overrides import TorchFunctionMode

from zkernels import ops, reference
from zkernels.layout import FlatLayout
from tests.native._copy_checks import (FLOATS, bucket_pack_unpack_bit_exact,
                                       flatten_unflatten_bit_exact, values)
from tests.ops._util import assert_bits_equal, awkward_values

NUMELS = [0, 1, 17, 4097, 16_385, 40_009]


class _Seen(TorchFunctionMode):
    """Passes every call through, remembering the names of what it saw."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        owner = getattr(func, "__self__", None)  # a getter: the descriptor's __get__
        self.names.add(getattr(owner, "__name__", None) if getattr(func, "__name__", "") ==
                       "__get__" else getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


@pytest.fixture(params=["shim", "getters"])
def reads(request, native_C):
    """How the fast paths read the tensors in the test: through the shim, or (inside a
    pass-through torch-function mode) through torch's getters."""
    if request.param == "shim":
        if native_C.cpu_fast_reads() != "shim":
            pytest.skip("this torch does not export the shim functions (see the test below)")
        yield request.param
        return
    with _Seen():
        yield request.param


def _checked(native_C, tensors, flat, offsets=None, to_flat=True, scale=1.0, fp32_route=False,
             threads=1, obey_env=True, whole_flat=False):
    return native_C.cpu_copy_checked(tensors, flat, offsets, to_flat, scale, fp32_route, threads,
                                     obey_env, whole_flat)


@pytest.mark.parametrize("src", FLOATS)
@pytest.mark.parametrize("dst", FLOATS)
def test_public_copy_ops_bit_exact_on_every_path(isa, native_C, reads, src, dst):
    """ops.flatten / unflatten / bucket_pack / bucket_unpack (fast path taken: checked by
    calling it directly first) against the reference, NaN payloads as tests/native."""
    ts = values(NUMELS, src)
    layout = FlatLayout.build(NUMELS, world_size=3, align=8)
    flat = torch.full((layout.padded_numel,), 5.0, dtype=dst)
    assert _checked(native_C, ts, flat, list(layout.offsets))
    flatten_unflatten_bit_exact(ops, ts, layout, dst)
    for scale in (1.0, 0.125):
        bucket_pack_unpack_bit_exact(ops, ts, layout, dst, scale)


def test_back_to_back_and_threads(native_C):
    """offsets=None places tensors back to back; 1 and 2 threads (600K elements: really two)
    give the same bits."""
    ts = values([560_001, 5, 40_000], torch.float32, seed=4)
    results = []
    for threads in (1, 2):
        flat = torch.zeros(600_006, dtype=torch.bfloat16)
        assert _checked(native_C, ts, flat, None, scale=0.5, fp32_route=True, threads=threads)
        results.append(flat)
    expected = torch.zeros(600_006, dtype=torch.bfloat16)
    reference.bucket_pack(ts, expected, [0, 560_001, 560_006], scale=0.5)
    for r in results:
        assert_bits_equal(r, expected)


def test_opset_takes_the_fast_path_only_where_it_chose_cpp(native_C, monkeypatch):
    ts = values([33, 4097], torch.float32, seed=9)
    cpp = ops.for_device("cpu", "cpp")
    ref = ops.for_device("cpu", "reference")
    assert cpp._fast["bucket_pack"] and not any(ref._fast.values())
    calls = []
    real = ops._fast._native()
    monkeypatch.setattr(ops._fast, "_native",
                        lambda *name: lambda *a: calls.append(a[-2]) or real(*a))
    for opset in (cpp, ref):
        bucket = torch.zeros(4130, dtype=torch.bfloat16)
        opset.bucket_pack(ts, bucket, [0, 33], scale=0.25)
        expected = torch.zeros_like(bucket)
        reference.bucket_pack(ts, expected, [0, 33], scale=0.25)
        assert_bits_equal(bucket, expected)
    # Only the cpp OpSet offered the call, without obeying ZKERNELS_BACKEND (chosen once).
    assert calls == [False]


class _Sub(torch.Tensor):
    pass


def _declined_cases():
    f32 = lambda *s: torch.ones(*s)  # noqa: E731
    return {
        "empty list": ([], f32(8), None),
        "subclass": ([f32(4).as_subclass(_Sub)], f32(8), None),
        "flat subclass": ([f32(4)], f32(8).as_subclass(_Sub), None),
        "not contiguous": ([f32(8)[::2]], f32(8), None),
        "flat not contiguous": ([f32(4)], f32(16)[::2], None),
        "flat 2-D": ([f32(4)], f32(2, 4), None),
        "int dtype": ([torch.ones(4, dtype=torch.int32)], f32(8), None),
        "flat int dtype": ([f32(4)], torch.zeros(8, dtype=torch.int32), None),
        "mixed dtypes": ([f32(2), torch.ones(2, dtype=torch.bfloat16)], f32(8), None),
        "meta device": ([torch.ones(4, device="meta")], f32(8), None),
        "too long": ([f32(4), f32(5)], f32(8), None),
        "offset out of range": ([f32(4)], f32(8), [5]),
        "negative offset": ([f32(4)], f32(8), [-1]),
        "huge offset": ([f32(4)], f32(8), [1 << 70]),
        "float offset": ([f32(4)], f32(8), [0.0]),
        "bool offset": ([f32(4)], f32(8), [False]),
        "offsets count": ([f32(4), f32(2)], f32(8), [0]),
        "offsets not a list": ([f32(4)], f32(8), range(1)),
        "tensors not a list": ((t for t in [f32(4)]), f32(8), None),
    }


@pytest.mark.parametrize("case", sorted(_declined_cases()))
def test_declines_and_writes_nothing(native_C, reads, case):
    tensors, flat, offsets = _declined_cases()[case]
    before = flat.clone() if flat.device.type == "cpu" else None
    assert _checked(native_C, tensors, flat, offsets) is False
    torch.testing.assert_close(flat, before, rtol=0, atol=0, equal_nan=True)


def test_declines_what_the_environment_routes_elsewhere(native_C, monkeypatch):
    ts, flat = [torch.ones(4)], torch.zeros(8)
    monkeypatch.setenv("ZKERNELS_BACKEND", " Reference ")
    assert _checked(native_C, ts, flat) is False and not flat.any()
    assert _checked(native_C, ts, flat, obey_env=False) is True  # an OpSet that chose cpp
    monkeypatch.setenv("ZKERNELS_BACKEND", " CPP ")
    assert _checked(native_C, ts, torch.zeros(8)) is True
    monkeypatch.setenv("ZKERNELS_BACKEND", "")
    assert _checked(native_C, ts, torch.zeros(8)) is True
    monkeypatch.delenv("ZKERNELS_BACKEND")
    monkeypatch.setenv("ZKERNELS_CPU_ISA", "sse9")
    assert _checked(native_C, ts, torch.zeros(8)) is False
    with pytest.raises(ValueError, match="isa"):  # the checked path names the mistake
        ops.flatten(ts, out=torch.zeros(8))


def test_public_ops_keep_their_messages(native_C):
    """Declined calls reach the Python checks: the same errors as without the fast path."""
    with pytest.raises(ValueError, match=r"contiguous"):
        ops.flatten([torch.ones(8)[::2]], out=torch.zeros(8))
    with pytest.raises(ValueError, match=r"too small"):
        ops.bucket_pack([torch.ones(4)], torch.zeros(8), [5])
    with pytest.raises(TypeError, match=r"scale"):
        ops.bucket_pack([torch.ones(4)], torch.zeros(8), [0], scale=torch.ones(()))
    with pytest.raises(TypeError, match=r"dtype"):
        ops.unflatten(torch.zeros(8), out=[torch.ones(2), torch.ones(2, dtype=torch.float16)])
    # Not declined for being odd but valid: a subclass still runs, through the checked path.
    out = torch.zeros(4)
    ops.flatten([torch.arange(4.0).as_subclass(_Sub)], out=out)
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("src", FLOATS)
@pytest.mark.parametrize("dst", FLOATS)
def test_cast_bit_exact_on_every_path(isa, native_C, src, dst):
    x = awkward_values(40_019, "cpu", seed=5).to(src).view(7, 5_717)
    out = torch.empty(40_019, dtype=dst)
    assert _checked(native_C, (x,), out.clone(), whole_flat=True)
    assert ops.cast(x, out=out) is out
    assert_bits_equal(out, reference.cast(x, dst).view(-1), nan_payload=src == torch.float32)
    opset_out = torch.empty(5_717, 7, dtype=dst)  # any shape of the same numel
    assert ops.for_device("cpu", "cpp").cast(x, out=opset_out) is opset_out
    assert_bits_equal(opset_out.view(-1), out, nan_payload=src == torch.float32)


def test_cast_declines_what_is_not_one_whole_copy(native_C):
    x = torch.ones(6)
    for tensors, out, offsets in (((x,), torch.zeros(7), None), ((x, x), torch.zeros(12), None),
                                  ((x,), torch.zeros(6), [0])):
        before = out.clone()
        assert _checked(native_C, tensors, out, offsets, whole_flat=True) is False
        assert torch.equal(out, before)
    with pytest.raises(ValueError, match="out must have 6 elements"):
        ops.cast(x, out=torch.zeros(7))


@pytest.mark.parametrize("dtype", FLOATS)
def test_unscale_bit_exact_on_every_path(isa, native_C, reads, dtype):
    x = awkward_values(40_009, "cpu", seed=6).to(dtype)
    for inv in (0.5, torch.tensor([0.125]), 3):
        mine, ref = x.clone(), x.clone()
        found, found_ref = torch.zeros(1), torch.zeros(1)
        assert native_C.cpu_unscale_checked(mine.clone(), inv, found.clone(), 1, True)
        assert ops.unscale_and_check_(mine, inv, found) is found
        reference.unscale_and_check_(ref, inv, found_ref)
        assert_bits_equal(mine, ref, nan_payload=dtype == torch.float32)
        assert_bits_equal(found, found_ref)
        assert found.item() == 1.0  # awkward_values holds inf and NaN


def test_unscale_declines_and_touches_nothing(native_C, reads, monkeypatch):
    x = torch.full((5,), 2.0)
    f = torch.zeros(1)
    cases = [
        (torch.ones(4, dtype=torch.int32), 1.0, f),          # x not a float tensor
        (torch.ones(8)[::2], 1.0, f),                        # x not contiguous
        (torch.ones(0), 1.0, f),                             # nothing to do: the Python path
        (x, 1.0, torch.zeros(2)),                            # found_inf not one element
        (x, 1.0, torch.zeros(1, dtype=torch.float16)),       # found_inf not fp32
        (x, torch.ones(1, dtype=torch.float64), f),          # inv_scale tensor not fp32
        (x, torch.ones(2), f),                               # inv_scale not one element
        (x, True, f),                                        # a bool: the Python path decides
        (x, "2", f),
        (x.as_subclass(_Sub), 1.0, f),
    ]
    for xx, inv, found in cases:
        before = xx.clone()
        assert native_C.cpu_unscale_checked(xx, inv, found, 1, True) is False
        torch.testing.assert_close(xx, before, rtol=0, atol=0, equal_nan=True)
    monkeypatch.setenv("ZKERNELS_BACKEND", "reference")
    assert native_C.cpu_unscale_checked(x, 0.5, f, 1, True) is False
    assert x.eq(2.0).all()
    assert native_C.cpu_unscale_checked(x, 0.5, f, 1, False) is True
    assert x.eq(1.0).all() and f.item() == 0.0
    with pytest.raises(TypeError, match="found_inf"):
        ops.unscale_and_check_(x, 1.0, torch.zeros(1, dtype=torch.float16))


_SHIM = ("aoti_torch_get_data_ptr", "aoti_torch_get_numel", "aoti_torch_get_dim",
         "aoti_torch_get_dtype", "aoti_torch_get_device_type", "aoti_torch_is_contiguous")


def test_reads_through_the_shim_where_torch_exports_it(native_C):
    """Where this torch's libtorch_cpu exports the six shim functions, the fast paths use them
    (their check against the getters passed); a torch without them keeps the getters."""
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    exported = all(hasattr(lib, name) for name in _SHIM)
    assert native_C.cpu_fast_reads() == ("shim" if exported else "getters")


def test_a_torch_function_mode_sees_the_getters_it_always_saw(native_C):
    """Under a torch-function mode the reads go through torch's getters, which the mode sees,
    and never through _cdata (the shim's one binding read, which a mode could answer)."""
    ts, flat = [torch.arange(4.0), torch.arange(3.0)], torch.zeros(8)
    with _Seen() as seen:
        assert _checked(native_C, ts, flat, None) is True
    assert torch.equal(flat, torch.tensor([0., 1, 2, 3, 0, 1, 2, 0]))
    assert "_cdata" not in seen.names and {"dtype", "is_cpu", "data_ptr"} <= seen.names, \
        seen.names


def test_reads_follow_a_tensor_changed_in_place(native_C, reads):
    """Nothing read is kept between calls: ``t.data = other`` changes a tensor's dtype, size,
    storage and contiguity without a version bump, and the next call sees each change."""
    t, flat = torch.ones(4), torch.zeros(8)
    assert _checked(native_C, [t], flat, [2]) and flat.tolist() == [0, 0, 1, 1, 1, 1, 0, 0]
    t.data = torch.full((3,), 7.0)                       # another size and storage
    assert _checked(native_C, [t], flat, [5]) and flat[5:].tolist() == [7, 7, 7]
    t.data = torch.full((2,), 3.0, dtype=torch.bfloat16)  # another dtype: cast on the way
    assert _checked(native_C, [t], flat, [0]) and flat[:2].tolist() == [3, 3]
    t.data = torch.full((8,), 9.0)[::2]                  # not contiguous: declined
    before = flat.clone()
    assert _checked(native_C, [t], flat, [0]) is False and torch.equal(flat, before)
    t.data = torch.full((9,), 1.0)                       # too long for flat: declined
    assert _checked(native_C, [t], flat, [0]) is False and torch.equal(flat, before)
