"""bucket_pack / bucket_unpack on every backend against zkernels.reference, bit for bit,
in rank-aligned buckets built by zkernels.layout.FlatLayout."""
import pytest
import torch

from zkernels import reference
from zkernels.layout import FlatLayout
from .conftest import FLOATS
from ._util import NUMPY_WARNINGS, assert_bits_equal, awkward_values

# The dtype x scale matrix runs on sizes around the 4096-element block; 278,011 (apex's
# awkward size) runs on the casts that matter most.
NUMELS = [0, 1, 4095, 4097, 12_289, 33, 0, 5]
BIG_NUMELS = [278_011, 3, 4097]

pytestmark = NUMPY_WARNINGS


def nan_payload(src, dst, scale):
    """Whether NaN bits are defined (see _util.assert_bits_equal): fp32 sources that are scaled
    or cast. A same-dtype copy at scale 1 keeps NaN bits where the reference's ``.mul(1.0)``
    quiets signalling NaNs."""
    return src == torch.float32 and (scale != 1.0 or dst != src)


def grads(dtype, device, numels=NUMELS):
    return [awkward_values(n, device, seed=i).to(dtype) for i, n in enumerate(numels)]


def check_pack(impl, device, src, dst, scale, numels):
    # world_size 3 and align 8: the padded size is not what the tensors fill, and there are
    # alignment gaps between tensors; neither may be written.
    layout = FlatLayout.build(numels, world_size=3, align=8)
    assert layout.padded_numel % 3 == 0 and layout.padded_numel > layout.numel
    ts = grads(src, device, numels)
    bucket = torch.full((layout.padded_numel,), 11.0, dtype=dst, device=device)
    expected = bucket.clone()
    reference.bucket_pack(ts, expected, layout.offsets, scale=scale)
    assert impl("bucket_pack")(ts, bucket, layout.offsets, scale=scale) is bucket
    assert_bits_equal(bucket, expected, nan_payload(src, dst, scale))
    covered = torch.zeros(layout.padded_numel, dtype=torch.bool)
    for o, n in zip(layout.offsets, layout.numels):
        covered[o:o + n] = True
    assert (bucket.cpu()[~covered] == 11.0).all()


@pytest.mark.parametrize("src", FLOATS)
@pytest.mark.parametrize("dst", FLOATS)
@pytest.mark.parametrize("scale", [1.0, 1.0 / 3.0])
def test_pack_into_rank_aligned_bucket(impl, device, src, dst, scale):
    check_pack(impl, device, src, dst, scale, NUMELS)


@pytest.mark.parametrize("src,dst", [(torch.float32, torch.bfloat16),
                                     (torch.float16, torch.float32)])
def test_pack_awkward_size(impl, device, src, dst):
    check_pack(impl, device, src, dst, 0.125, BIG_NUMELS)


@pytest.mark.parametrize("src", FLOATS)
@pytest.mark.parametrize("dst", FLOATS)
@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_unpack_from_bucket(impl, device, src, dst, scale):
    check_unpack(impl, device, src, dst, scale, NUMELS)


def test_unpack_awkward_size(impl, device):
    check_unpack(impl, device, torch.bfloat16, torch.float32, 0.25, BIG_NUMELS)


def check_unpack(impl, device, src, dst, scale, numels):
    layout = FlatLayout.build(numels, world_size=4, align=1)
    bucket = awkward_values(layout.padded_numel, device, seed=9).to(src)
    outs = [torch.full((n,), 2.0, dtype=dst, device=device) for n in numels]
    expected = [o.clone() for o in outs]
    reference.bucket_unpack(bucket, expected, layout.offsets, scale=scale)
    result = impl("bucket_unpack")(bucket, outs, layout.offsets, scale=scale)
    assert len(result) == len(outs) and all(r is o for r, o in zip(result, outs))
    for o, e in zip(outs, expected):
        assert_bits_equal(o, e, nan_payload(src, dst, scale))


def test_pack_mean_of_integers_is_exact(impl, device):
    # Power-of-two scale on integer gradients: exact in bf16, so pack -> unpack round-trips.
    ts = [torch.randint(-64, 64, (n,)).float().to(device) for n in (7, 4096, 10_001)]
    layout = FlatLayout.build([t.numel() for t in ts], world_size=2, align=4)
    bucket = torch.zeros(layout.padded_numel, dtype=torch.bfloat16, device=device)
    impl("bucket_pack")(ts, bucket, layout.offsets, scale=0.5)
    outs = [torch.empty_like(t) for t in ts]
    impl("bucket_unpack")(bucket, outs, layout.offsets, scale=2.0)
    for a, b in zip(outs, ts):
        assert torch.equal(a, b)


def test_pack_shards_cut_through_tensors(impl, device):
    # Each rank's contiguous shard of the bucket is exactly its slices of the tensors.
    numels = [10, 3, 25, 1]
    layout = FlatLayout.build(numels, world_size=4, align=2)
    ts = [torch.arange(n, dtype=torch.float32, device=device) + 100 * i
          for i, n in enumerate(numels)]
    bucket = torch.zeros(layout.padded_numel, device=device)
    impl("bucket_pack")(ts, bucket, layout.offsets)
    for rank in range(4):
        lo, _ = layout.shard_range(rank)
        for i, start_t, start_s, length in layout.tensor_slices_in_shard(rank):
            assert torch.equal(bucket[lo + start_s:lo + start_s + length],
                               ts[i][start_t:start_t + length])


def test_bucket_bad_arguments(ops):
    ts = [torch.ones(4), torch.ones(3)]
    with pytest.raises(ValueError, match="bucket"):
        ops.bucket_pack(ts, torch.zeros(6), [0, 4])
    with pytest.raises(ValueError, match="bucket"):
        ops.bucket_pack(ts, torch.zeros(4, 2), [0, 4])
    with pytest.raises(TypeError, match="scale"):
        ops.bucket_pack(ts, torch.zeros(8), [0, 4], scale=torch.tensor(0.5))
    with pytest.raises(TypeError, match=r"tensors\[1\]"):
        ops.bucket_pack([ts[0], ts[1].bfloat16()], torch.zeros(8), [0, 4])
    with pytest.raises(ValueError, match=r"tensors\[0\]"):
        ops.bucket_pack([torch.ones(2, 2).t()], torch.zeros(8), [0])
    with pytest.raises(ValueError, match=r"tensors\[0\]"):
        ops.bucket_pack([torch.ones(2, device="meta")], torch.zeros(8), [0])
    with pytest.raises(ValueError, match="offsets"):
        ops.bucket_pack(ts, torch.zeros(8), [0])
    with pytest.raises(ValueError, match="bucket"):
        ops.bucket_unpack(torch.zeros(6), [torch.empty(4), torch.empty(3)], [0, 4])
    with pytest.raises(TypeError, match=r"outs\[1\]"):
        ops.bucket_unpack(torch.zeros(8), [torch.empty(4), torch.empty(3).half()], [0, 4])
    with pytest.raises(TypeError, match="bucket"):
        ops.bucket_unpack(torch.zeros(8, dtype=torch.int32), [torch.empty(4)], [0])


@pytest.mark.parametrize("src", FLOATS)
@pytest.mark.parametrize("dst", FLOATS)
@pytest.mark.parametrize("numel", [1, 4095, 4097, 12_289])
def test_pack_one_tensor_without_table(impl, device, backend, monkeypatch, src, dst, numel):
    """One tensor (stage 2's per-gradient hook) packs with no block table, bit for bit as the
    reference, at an offset that is not 16-byte aligned too."""
    if backend != "reference":
        import zkernels.kernels._copy as copy

        def no_table(*args, **kwargs):
            raise AssertionError("a one-tensor pack must not build a block table")
        monkeypatch.setattr(copy, "build_table", no_table)
    for offset, scale in ((8, 0.5), (3, 1.0)):
        t = awkward_values(numel, device, seed=numel).to(src)
        bucket = torch.full((offset + numel + 5,), 11.0, dtype=dst, device=device)
        expected = bucket.clone()
        reference.bucket_pack([t], expected, [offset], scale=scale)
        assert impl("bucket_pack")([t], bucket, [offset], scale=scale) is bucket
        assert_bits_equal(bucket, expected, nan_payload(src, dst, scale))
