"""flatten / unflatten on every backend against zkernels.reference, bit for bit."""
import pytest
import torch

from zkernels import reference
from .conftest import FLOATS
from ._util import NUMPY_WARNINGS, assert_bits_equal, awkward_values

# Sizes that hurt: empty, one element, around the 4096-element block, not a multiple of
# anything (278,011), and 2-D shapes.
SHAPES = [(0,), (1,), (4095,), (4096,), (4097,), (12_289,), (3, 0), (17, 33), (1, 5)]
BIG_SHAPES = [(278_011,), (7,), (64, 64)]

pytestmark = NUMPY_WARNINGS


def sources(dtype, device, shapes=SHAPES, seed=0):
    return [awkward_values(int(torch.Size(s).numel()), device, seed + i).to(dtype).reshape(s)
            for i, s in enumerate(shapes)]


def gapped_offsets(tensors, gap=3):
    """Offsets with ``gap`` padding elements before every tensor."""
    offs, pos = [], 0
    for t in tensors:
        pos += gap
        offs.append(pos)
        pos += t.numel()
    return offs, pos + gap


def check_flatten(impl, device, src, dst, shapes):
    ts = sources(src, device, shapes)
    offs, total = gapped_offsets(ts)
    out = torch.full((total,), -7.0, dtype=dst, device=device)
    expected = out.clone()
    reference.flatten(ts, out=expected, offsets=offs)
    assert impl("flatten")(ts, out=out, offsets=offs) is out
    nan_payload = src in (torch.float32, dst)
    assert_bits_equal(out, expected, nan_payload)
    # The padding is untouched, the data is each tensor cast like Tensor.to.
    assert (out[:offs[0]] == -7).all() and (out[-3:] == -7).all()
    for t, o in zip(ts, offs):
        assert_bits_equal(out[o:o + t.numel()], t.reshape(-1).to(dst), nan_payload)


@pytest.mark.parametrize("src", FLOATS)
@pytest.mark.parametrize("dst", FLOATS)
def test_flatten_into_out_with_padding(impl, device, src, dst):
    check_flatten(impl, device, src, dst, SHAPES)


@pytest.mark.parametrize("src,dst", [(torch.float32, torch.bfloat16),
                                     (torch.float32, torch.float16)])
def test_flatten_awkward_size(impl, device, src, dst):
    check_flatten(impl, device, src, dst, BIG_SHAPES)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_flatten_allocates(impl, device, dtype):
    ts = sources(torch.float32, device, [(5, 7), (0,), (4097,)])
    flat = impl("flatten")(ts, dtype=dtype)
    assert_bits_equal(flat, reference.flatten(ts, dtype=dtype))
    assert flat.dtype == (dtype or torch.float32) and flat.device.type == device.type


def test_flatten_many_small_tensors(impl, device):
    # 300 tensors of mixed sizes: many table rows and blocks of different tensors.
    g = torch.Generator().manual_seed(1)
    numels = torch.randint(0, 3000, (300,), generator=g).tolist()
    ts = [awkward_values(n, device, seed=i) for i, n in enumerate(numels)]
    out = torch.zeros(sum(numels), dtype=torch.bfloat16, device=device)
    impl("flatten")(ts, out=out)
    assert_bits_equal(out, torch.cat(ts).to(torch.bfloat16))


@pytest.mark.parametrize("src", FLOATS)
@pytest.mark.parametrize("dst", FLOATS)
def test_unflatten_into_out(impl, device, src, dst):
    check_unflatten(impl, device, src, dst, SHAPES)


def test_unflatten_awkward_size(impl, device):
    check_unflatten(impl, device, torch.bfloat16, torch.float32, BIG_SHAPES)


def check_unflatten(impl, device, src, dst, shapes):
    numels = [int(torch.Size(s).numel()) for s in shapes]
    offs, total = gapped_offsets([torch.empty(n) for n in numels])
    flat = awkward_values(total, device).to(src)
    outs = [torch.full(s, 5.0, dtype=dst, device=device) for s in shapes]
    expected = [o.clone() for o in outs]
    reference.unflatten(flat, out=expected, offsets=offs)
    result = impl("unflatten")(flat, out=outs, offsets=offs)
    assert len(result) == len(outs) and all(r is o for r, o in zip(result, outs))
    for o, e in zip(outs, expected):
        assert_bits_equal(o, e, nan_payload=src in (torch.float32, dst))


def test_unflatten_views_share_storage(impl, device):
    flat = torch.arange(20, dtype=torch.float32, device=device)
    views = impl("unflatten")(flat, [(2, 3), (0,), (4,)], offsets=[1, 7, 9])
    assert [tuple(v.shape) for v in views] == [(2, 3), (0,), (4,)]
    assert torch.equal(views[0], torch.arange(1, 7, dtype=torch.float32, device=device).view(2, 3))
    views[2].fill_(-1)
    assert (flat[9:13] == -1).all()


def test_roundtrip_is_identity(impl, device):
    ts = sources(torch.float32, device)
    flat = impl("flatten")(ts)
    back = impl("unflatten")(flat, out=[torch.empty_like(t) for t in ts])
    for a, b in zip(back, ts):
        assert_bits_equal(a, b)


def test_flatten_bad_arguments(ops):
    a, b = torch.ones(4), torch.ones(3)
    with pytest.raises(TypeError, match=r"tensors\[1\]"):
        ops.flatten([a, b.half()])
    with pytest.raises(ValueError, match="out"):
        ops.flatten([a, b], out=torch.empty(6))
    with pytest.raises(ValueError, match=r"tensors\[1\]"):
        ops.flatten([a, torch.ones(3, 2).t()])
    with pytest.raises(ValueError, match=r"tensors\[1\]"):
        ops.flatten([a, torch.ones(3, device="meta")])
    with pytest.raises(ValueError, match="out"):
        ops.flatten([a, b], out=torch.empty(7, device="meta"))
    with pytest.raises(ValueError, match="out"):
        ops.flatten([a, b], out=torch.empty(7, 1))
    with pytest.raises(ValueError, match="offsets"):
        ops.flatten([a, b], offsets=[0, -1])
    with pytest.raises(ValueError, match="offsets"):
        ops.flatten([a, b], offsets=[0])
    with pytest.raises(TypeError, match="tensors"):
        ops.flatten(a)


def test_unflatten_bad_arguments(ops):
    flat = torch.ones(10)
    with pytest.raises(ValueError, match="flat"):
        ops.unflatten(flat, out=[torch.empty(6), torch.empty(5)])
    with pytest.raises(ValueError, match="flat"):
        ops.unflatten(flat, [(11,)])
    with pytest.raises(TypeError, match=r"out\[1\]"):
        ops.unflatten(flat, out=[torch.empty(2), torch.empty(2, dtype=torch.half)])
    with pytest.raises(ValueError, match=r"out\[0\]"):
        ops.unflatten(flat, out=[torch.empty(2, 2).t()])
    with pytest.raises(ValueError, match="exactly one"):
        ops.unflatten(flat)
    with pytest.raises(ValueError, match="flat"):
        ops.unflatten(torch.ones(2, 5), out=[torch.empty(2)])
