"""quantize, dequantize and dequantize_sum on every backend against zkernels.reference, bit for
bit (codes, scales, outputs), with the semantics of [Note: blockwise quantization semantics]
checked on their own: ties, zeros, inf/NaN, int4 packing, partial blocks."""
import pytest
import torch

from zkernels import reference
from .conftest import FLOATS
from ._quant_values import BLOCK_SIZES, quant_values, tie_count
from ._util import NUMPY_WARNINGS, assert_bits_equal

pytestmark = NUMPY_WARNINGS

# Odd, even, one element, less than a block, a partial last block (for every block size).
NUMELS = (1, 7, 4_098, 40_007)
BITS = (8, 4)


def _bits_equal_codes(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    bad = (a != b).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} codes differ, first at {bad[:5].tolist()}"


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_quantize_bit_exact(impl, device, bits, block_size, dtype):
    for numel in NUMELS:
        x = quant_values(numel, block_size, bits, seed=numel).to(dtype).to(device)
        q, s = impl("quantize")(x, bits=bits, block_size=block_size)
        eq, es = reference.quantize(x, bits=bits, block_size=block_size)
        _bits_equal_codes(q, eq)
        assert_bits_equal(s, es)
        assert q.dtype == (torch.int8 if bits == 8 else torch.uint8)
        assert q.numel() == (numel if bits == 8 else (numel + 1) // 2)
        assert s.numel() == -(-numel // block_size)


@pytest.mark.parametrize("bits", BITS)
def test_ties_round_half_to_even(impl, device, bits):
    """Where ``(x / amax) * qmax`` (fp32) is exactly k + 0.5, the code is the even one of k and
    k + 1, on every backend (and the input really holds such ties)."""
    x = quant_values(40_007, 256, bits, seed=5)
    q, _ = impl("quantize")(x.to(device), bits=bits, block_size=256)
    codes = reference.quant._unpack(q.cpu(), bits, x.numel()).float()
    pad = (-x.numel()) % 256
    b = torch.nn.functional.pad(x, (0, pad)).view(-1, 256)
    amax = b.abs().amax(dim=1, keepdim=True)
    ok = torch.isfinite(amax) & (amax > 0)
    y = ((b / torch.where(ok, amax, torch.ones_like(amax))) * (127 if bits == 8 else 7))
    y = y.reshape(-1)[:x.numel()]
    tie = (y - torch.floor(y) == 0.5) & ok.expand_as(b).reshape(-1)[:x.numel()]
    assert int(tie.sum()) == tie_count(x, 256, bits) > 50
    assert ((codes[tie] - y[tie]).abs() == 0.5).all()
    assert (torch.remainder(codes[tie], 2) == 0).all()


@pytest.mark.parametrize("bits", BITS)
def test_special_blocks(impl, device, bits):
    """Zeros: scale +0, codes 0, +0 back. NaN: scale NaN (0x7FC00000), inf: +inf; codes 0 and
    NaN back either way. Subnormal and ~1e-38 blocks: finite codes within +-qmax."""
    block = 32
    x = quant_values(block * 8, block, bits, seed=1).to(device)
    q, s = impl("quantize")(x, bits=bits, block_size=block)
    codes = reference.quant._unpack(q.cpu(), bits, x.numel()).view(8, block)
    sb = s.cpu().view(torch.int32).tolist()
    assert sb[1] == 0 and (codes[1] == 0).all()                            # zeros
    assert sb[2] == 0x7FC00000 and (codes[2] == 0).all()                   # NaN
    assert sb[3] == 0x7F800000 and (codes[3] == 0).all()                   # +inf
    assert sb[4] == 0x7FC00000 and (codes[4] == 0).all()                   # -inf and NaN
    qmax = 127 if bits == 8 else 7
    for b in (0, 5, 6, 7):                                                 # finite blocks
        assert codes[b].abs().max() == qmax and 0 < s[b].item() < float("inf")
    back = impl("dequantize")(q, s, bits=bits, block_size=block, numel=x.numel()).cpu()
    back = back.view(8, block)
    assert (back[1].view(torch.int32) == 0).all()                          # +0 exactly
    assert torch.isnan(back[2:5]).all()
    assert torch.isfinite(back[[0, 5, 6, 7]]).all()


def test_int4_packing_order(impl, device):
    # amax 7, qmax 7: codes equal the values; low nibble first, the odd tail's high nibble 0.
    x = torch.tensor([7.0, -7.0, 1.0, 0.0, -1.0, 3.0, 2.0], device=device)
    q, s = impl("quantize")(x, bits=4, block_size=8)
    assert q.cpu().tolist() == [0x97, 0x01, 0x3F, 0x02]
    assert s.item() == 1.0
    x8 = torch.tensor([127.0, -127.0, 18.0, 0.0, -18.0, 54.0, 36.0], device=device)
    q8, s8 = impl("quantize")(x8, bits=8, block_size=8)
    assert q8.cpu().tolist() == [127, -127, 18, 0, -18, 54, 36] and s8.item() == 1.0


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_round_trip_error_bound(impl, device, bits, block_size):
    """Finite blocks come back within half a step (scale / 2, plus the rounding of the two
    fp32 operations) and |codes| <= qmax; the absmax element comes back exactly +-qmax."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(40_007, generator=g) * 3).to(device)
    q, s = impl("quantize")(x, bits=bits, block_size=block_size)
    back = impl("dequantize")(q, s, bits=bits, block_size=block_size, numel=x.numel())
    step = s.repeat_interleave(block_size)[:x.numel()]
    assert ((back - x).abs() <= step * (0.5 + 1e-4)).all()
    codes = reference.quant._unpack(q.cpu(), bits, x.numel())
    assert codes.abs().max() <= (127 if bits == 8 else 7)


def _random_codes(rows: int, numel: int, bits: int, seed: int) -> torch.Tensor:
    """Every byte value: int8 codes from -128 (never written by quantize, still defined) to
    127; int4 bytes 0..255 (all 16 nibbles, -8 included)."""
    g = torch.Generator().manual_seed(seed)
    n = numel if bits == 8 else (numel + 1) // 2
    q = torch.randint(0, 256, (rows, n), generator=g).to(torch.uint8)
    return q.view(torch.int8) if bits == 8 else q


def _scales(rows: int, nb: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = torch.rand(rows, nb, generator=g) * torch.exp2(torch.randint(-20, 10, (rows, nb),
                                                                     generator=g).float())
    flat = s.view(-1)
    special = torch.tensor([0.0, float("nan"), float("inf"), 1e-45, 3e38])
    flat[:min(flat.numel(), 5)] = special[:min(flat.numel(), 5)]
    return s


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_dequantize_bit_exact(impl, device, bits, block_size, dtype):
    for numel in NUMELS:
        nb = -(-numel // block_size)
        q = _random_codes(1, numel, bits, seed=numel)[0].to(device)
        s = _scales(1, nb, seed=numel)[0].to(device)
        out = impl("dequantize")(q, s, bits=bits, block_size=block_size, numel=numel,
                                 dtype=dtype)
        expected = reference.dequantize(q, s, bits=bits, block_size=block_size, numel=numel,
                                        dtype=dtype)
        assert_bits_equal(out, expected, nan_payload=device.type == "cpu")
        given = torch.full((numel,), 5.0, dtype=dtype, device=device)
        assert impl("dequantize")(q, s, bits=bits, block_size=block_size, out=given) is given
        assert_bits_equal(given, expected, nan_payload=device.type == "cpu")


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block_size", (2, 256, 8192))
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("accumulate", [False, True])
def test_dequantize_sum_bit_exact(impl, device, bits, block_size, dtype, accumulate):
    for numel, chunks, scale in ((7, 1, 1.0), (4_098, 3, 1.0 / 3.0), (12_289, 8, 0.125)):
        nb = -(-numel // block_size)
        # Chunks as ranks send them (quantized data, a NaN block in chunk 1) and one of every
        # code value.
        data = [quant_values(numel, block_size, bits, seed=r) for r in range(chunks)]
        if chunks > 1:
            data[0][block_size * 2:block_size * 5] = 1.0   # rank 0 finite where 1 has NaN
        qs, ss = zip(*(reference.quantize(d, bits=bits, block_size=block_size) for d in data))
        q, s = torch.stack(qs), torch.stack(ss)
        if chunks > 2:
            q[2] = _random_codes(1, numel, bits, seed=7)[0]
        q, s = q.to(device), s.to(device)
        start = quant_values(numel, 2, 8, seed=99).nan_to_num(0.0, 0.0, 0.0).to(dtype)
        out = start.clone().to(device)
        res = impl("dequantize_sum")(q, s, out, bits=bits, block_size=block_size, scale=scale,
                                     accumulate=accumulate)
        assert res is out
        expected = reference.dequantize_sum(q, s, start.clone().to(device), bits=bits,
                                            block_size=block_size, scale=scale,
                                            accumulate=accumulate)
        assert_bits_equal(out, expected, nan_payload=device.type == "cpu")
        assert nb == s.shape[1]


def test_dequantize_sum_order_and_scale(impl, device):
    """The sum runs in chunk order in fp32: 1e8 + 1 - 1e8 is 0 that way (1 is lost), and
    scale multiplies the sum once, before accumulate adds out."""
    q = torch.tensor([[127], [127], [-127]], dtype=torch.int8, device=device)
    s = torch.tensor([[1e8 / 127], [1.0 / 127], [1e8 / 127]], device=device)
    out = torch.full((1,), 10.0, device=device)
    impl("dequantize_sum")(q, s, out, bits=8, block_size=2, scale=0.5, accumulate=True)
    a = torch.tensor([127.0]) * torch.tensor([1e8 / 127])
    b = torch.tensor([127.0]) * torch.tensor([1.0 / 127])
    c = torch.tensor([-127.0]) * torch.tensor([1e8 / 127])
    expected = torch.tensor([10.0]) + ((torch.zeros(1) + a + b + c) * 0.5)
    assert_bits_equal(out.cpu(), expected)


@pytest.mark.parametrize("bits", BITS)
def test_non_finite_chunk_reaches_the_inf_check(impl, device, bits):
    """One rank's inf (or NaN) makes its whole block of the summed shard NaN, and nothing
    else: the optimizer's non-finite check after a quantized reduce-scatter still fires."""
    from zkernels import ops
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(4))
    x[1, 40] = float("inf")                      # chunk 1, block 1 of 3
    pairs = [reference.quantize(r, bits=bits, block_size=32) for r in x]
    q = torch.stack([p[0] for p in pairs]).to(device)
    s = torch.stack([p[1] for p in pairs]).to(device)
    out = torch.zeros(96, dtype=torch.bfloat16, device=device)
    impl("dequantize_sum")(q, s, out, bits=bits, block_size=32, scale=0.5)
    bad = torch.isnan(out.float()).cpu()
    assert bad[32:64].all() and not bad[:32].any() and not bad[64:].any()
    found = torch.zeros(1, device=device)
    ops.unscale_and_check_(out, 1.0, found)
    assert found.item() == 1.0


def test_opset_runs_the_same_ops(device):
    """OpSet (the optimizer's ops, chosen once) runs the same checks and kernels."""
    from zkernels.ops import for_device
    opset = for_device(device)
    x = quant_values(1000, 64, 4, seed=2).to(device)
    q, s = opset.quantize(x, bits=4, block_size=64)
    eq, es = reference.quantize(x, bits=4, block_size=64)
    _bits_equal_codes(q, eq)
    assert_bits_equal(s, es)
    out = torch.ones(1000, device=device)
    opset.dequantize_sum(torch.stack([q, q]), torch.stack([s, s]), out, bits=4, block_size=64,
                         scale=0.5, accumulate=True)
    expected = reference.dequantize_sum(torch.stack([q, q]), torch.stack([s, s]),
                                        torch.ones(1000, device=device), bits=4, block_size=64,
                                        scale=0.5, accumulate=True)
    assert_bits_equal(out, expected, nan_payload=device.type == "cpu")
    assert_bits_equal(opset.dequantize(q, s, bits=4, block_size=64, numel=1000),
                      reference.dequantize(q, s, bits=4, block_size=64, numel=1000),
                      nan_payload=device.type == "cpu")
    with pytest.raises(ValueError, match="block_size"):
        opset.quantize(x, bits=4, block_size=48)


def test_empty(impl, device):
    x = torch.empty(0, device=device)
    q, s = impl("quantize")(x, bits=4, block_size=8)
    assert q.numel() == 0 and s.numel() == 0
    out = torch.empty(0, device=device)
    assert impl("dequantize")(q, s, bits=4, block_size=8, out=out) is out


def test_quantize_bad_arguments(ops):
    x = torch.ones(10)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        ops.quantize(x, bits=2)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        ops.quantize(x, bits=True)
    for bad in (3, 0, 1, 16384, 6, 2.0):
        with pytest.raises(ValueError, match="block_size must be a power of two"):
            ops.quantize(x, block_size=bad)
    with pytest.raises(TypeError, match="x"):
        ops.quantize(torch.ones(10, dtype=torch.int32))
    with pytest.raises(ValueError, match="x"):
        ops.quantize(torch.ones(4, 4).t())
    with pytest.raises(TypeError, match="out"):
        ops.quantize(x, bits=4, out=torch.empty(5, dtype=torch.int8))
    with pytest.raises(ValueError, match="out"):
        ops.quantize(x, bits=8, out=torch.empty(9, dtype=torch.int8))
    with pytest.raises(TypeError, match="scales"):
        ops.quantize(x, block_size=4, scales=torch.empty(3, dtype=torch.float16))
    with pytest.raises(ValueError, match="scales"):
        ops.quantize(x, block_size=4, scales=torch.empty(2))
    with pytest.raises(ValueError, match="scales"):
        ops.quantize(x, block_size=4, scales=torch.empty(3, device="meta"))


def test_dequantize_bad_arguments(ops):
    q, s = torch.zeros(5, dtype=torch.uint8), torch.zeros(3)
    with pytest.raises(TypeError, match="q"):
        ops.dequantize(q, s, bits=8, block_size=4)
    with pytest.raises(ValueError, match="q"):
        ops.dequantize(q, s, bits=4, block_size=4, numel=12)
    with pytest.raises(ValueError, match="scales"):
        ops.dequantize(q, torch.zeros(2), bits=4, block_size=4)
    with pytest.raises(ValueError, match="numel"):
        ops.dequantize(q, s, bits=4, block_size=4, numel=9, out=torch.empty(10))
    with pytest.raises(TypeError, match="dtype"):
        ops.dequantize(q, s, bits=4, block_size=4, dtype=torch.int32)
    with pytest.raises(TypeError, match="dtype"):
        ops.dequantize(q, s, bits=4, block_size=4, dtype=torch.float16, out=torch.empty(10))
    with pytest.raises(TypeError, match="out"):
        ops.dequantize(q, s, bits=4, block_size=4, out=torch.empty(10, dtype=torch.int32))
    with pytest.raises(ValueError, match="numel"):
        ops.dequantize(q, s, bits=4, block_size=4, numel=-1)


def test_dequantize_sum_bad_arguments(ops):
    out = torch.zeros(10)
    q, s = torch.zeros(3, 10, dtype=torch.int8), torch.zeros(3, 3)
    kw = dict(bits=8, block_size=4)
    ops.dequantize_sum(q, s, out, **kw)   # the valid call
    with pytest.raises(ValueError, match="q must be 2-D"):
        ops.dequantize_sum(q.view(-1), s, out, **kw)
    with pytest.raises(ValueError, match="q must be 2-D"):
        ops.dequantize_sum(torch.zeros(3, 11, dtype=torch.int8), s, out, **kw)
    with pytest.raises(ValueError, match="q must be 2-D"):
        ops.dequantize_sum(torch.zeros(0, 10, dtype=torch.int8), torch.zeros(0, 3), out, **kw)
    with pytest.raises(TypeError, match="q"):
        ops.dequantize_sum(q.view(torch.uint8), s, out, **kw)
    with pytest.raises(ValueError, match="scales must have shape"):
        ops.dequantize_sum(q, torch.zeros(2, 3), out, **kw)
    with pytest.raises(TypeError, match="scales"):
        ops.dequantize_sum(q, s.double(), out, **kw)
    with pytest.raises(TypeError, match="out"):
        ops.dequantize_sum(q, s, out.int(), **kw)
    with pytest.raises(ValueError, match="out"):
        ops.dequantize_sum(q, s, torch.zeros(20)[::2], **kw)
    with pytest.raises(ValueError, match="scale must be a finite number"):
        ops.dequantize_sum(q, s, out, scale=float("nan"), **kw)
    with pytest.raises(ValueError, match="scale must be a finite number"):
        ops.dequantize_sum(q, s, out, scale=torch.ones(1), **kw)
    with pytest.raises(TypeError, match="accumulate"):
        ops.dequantize_sum(q, s, out, accumulate=1, **kw)
    with pytest.raises(ValueError, match="q"):
        ops.dequantize_sum(q.to("meta"), s, out, **kw)
