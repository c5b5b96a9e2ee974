"""The native blockwise quantize / dequantize / dequantize-and-sum (zkernels._C through
zkernels._cpu) against zkernels.reference, bit for bit, every SIMD path forced in turn; paths
and thread counts against each other; bad input through the binding. (tests/ops/test_quant.py
runs the op suite on the best path too.)"""
import pytest
import torch

from zkernels import _cpu, reference
from tests.ops._quant_values import quant_values
from tests.ops._util import assert_bits_equal

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# Around the vector widths (8, 16) and the 16K-element OpenMP tile, odd and even.
NUMELS = (1, 2, 7, 8, 9, 15, 16, 17, 33, 16_383, 16_385, 40_009)


def _codes_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and torch.equal(a, b), (a != b).nonzero()[:5].flatten().tolist()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block_size", [2, 8, 16, 64, 8192])
@pytest.mark.parametrize("dtype", FLOATS)
def test_quantize_dequantize_bit_exact(isa, bits, block_size, dtype):
    for numel in NUMELS:
        x = quant_values(numel, block_size, bits, seed=numel).to(dtype)
        q, s = _cpu.quantize(x, bits=bits, block_size=block_size)
        eq, es = reference.quantize(x, bits=bits, block_size=block_size)
        _codes_equal(q, eq)
        assert_bits_equal(s, es)
        for out_dtype in FLOATS:
            out = _cpu.dequantize(q, s, bits=bits, block_size=block_size, numel=numel,
                                  dtype=out_dtype)
            assert_bits_equal(out, reference.dequantize(q, s, bits=bits, block_size=block_size,
                                                        numel=numel, dtype=out_dtype))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block_size", [2, 16, 256])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("accumulate", [False, True])
def test_dequantize_sum_bit_exact(isa, bits, block_size, dtype, accumulate):
    for numel, chunks in ((1, 1), (17, 2), (40_009, 5)):
        data = [quant_values(numel, block_size, bits, seed=r) for r in range(chunks)]
        pairs = [reference.quantize(d, bits=bits, block_size=block_size) for d in data]
        q = torch.stack([p[0] for p in pairs])
        s = torch.stack([p[1] for p in pairs])
        start = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(dtype)
        out = start.clone()
        _cpu.dequantize_sum(q, s, out, bits=bits, block_size=block_size, scale=0.3,
                            accumulate=accumulate)
        expected = reference.dequantize_sum(q, s, start.clone(), bits=bits,
                                            block_size=block_size, scale=0.3,
                                            accumulate=accumulate)
        assert_bits_equal(out, expected)


def test_paths_and_threads_agree_bit_for_bit(native_C):
    """Every path and thread count writes the same codes, scales and sums (blocks are
    independent; each element's sum runs in chunk order)."""
    numel = 100_003   # > 2 OpenMP tiles of 16K elements: two threads really split it
    x = quant_values(numel, 64, 4, seed=11)
    results = []
    for isa in ("scalar", "avx2", "avx512"):
        if not native_C.cpu_isa_supported(isa):
            continue
        for threads in (1, 2):
            q = torch.empty((numel + 1) // 2, dtype=torch.uint8)
            s = torch.empty(-(-numel // 64))
            assert native_C.cpu_quantize(x, q, s, 4, 64, isa, threads) == isa
            qs, ss = torch.stack([q, q.flip(0)]), torch.stack([s, s.flip(0)])
            out = torch.ones(numel, dtype=torch.bfloat16)
            native_C.cpu_dequantize(qs, ss, out, 4, 64, True, 0.5, True, isa, threads)
            results.append((q, s, out))
    for bufs in results[1:]:
        _codes_equal(bufs[0], results[0][0])
        assert_bits_equal(bufs[1], results[0][1])
        assert_bits_equal(bufs[2], results[0][2])


def test_binding_checks_name_the_argument(native_C):
    x, q, s = torch.ones(10), torch.empty(10, dtype=torch.int8), torch.empty(3)
    assert native_C.cpu_quantize(x, q, s, 8, 4) in ("scalar", "avx2", "avx512")
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        native_C.cpu_quantize(x, q, s, 5, 4)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        native_C.cpu_quantize(x, q, s, 8, 12)
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16"):
        native_C.cpu_quantize(x.int(), q, s, 8, 4)
    with pytest.raises(TypeError, match="out must be uint8 for bits=4"):
        native_C.cpu_quantize(x, q, s, 4, 4)
    with pytest.raises(ValueError, match="out must have 10 elements"):
        native_C.cpu_quantize(x, q[:9], s, 8, 4)
    with pytest.raises(ValueError, match="scales must have 3 elements"):
        native_C.cpu_quantize(x, q, s[:2], 8, 4)
    with pytest.raises(TypeError, match="scales must be float32"):
        native_C.cpu_quantize(x, q, s.half(), 8, 4)
    with pytest.raises(ValueError, match="x must be contiguous"):
        native_C.cpu_quantize(torch.ones(20)[::2], q, s, 8, 4)
    with pytest.raises(ValueError, match="x must be a CPU tensor"):
        native_C.cpu_quantize(torch.ones(10, device="meta"), q, s, 8, 4)
    out = torch.empty(10)
    with pytest.raises(ValueError, match="q must have 10 elements"):
        native_C.cpu_dequantize(q[:5], s, out, 8, 4)
    with pytest.raises(ValueError, match="q must hold a whole number"):
        native_C.cpu_dequantize(torch.empty(25, dtype=torch.int8), s, out, 8, 4, True)
    with pytest.raises(ValueError, match="scales must have 6 elements"):
        native_C.cpu_dequantize(torch.empty(20, dtype=torch.int8), s, out, 8, 4, True)
    with pytest.raises(TypeError, match="out must be float32, bfloat16 or float16"):
        native_C.cpu_dequantize(q, s, out.double(), 8, 4)
    with pytest.raises(ValueError, match="isa"):
        native_C.cpu_dequantize(q, s, out, 8, 4, False, 1.0, False, "sse9")
    with pytest.raises(ValueError, match="num_threads"):
        native_C.cpu_quantize(x, q, s, 8, 4, None, -1)


_STALE = """
import sys, types
import zkernels, zkernels._C as C
stale = types.ModuleType("zkernels._C")
stale.__dict__.update({k: v for k, v in C.__dict__.items()
                       if k not in ("cpu_quantize", "cpu_dequantize")})
sys.modules["zkernels._C"] = zkernels._C = stale
import torch
cpu = torch.device("cpu")
assert zkernels.ops.choose("quantize", cpu) == "reference", zkernels.ops.choose("quantize", cpu)
assert zkernels.ops.choose("cast", cpu) == "cpp"
q, s = zkernels.ops.quantize(torch.tensor([7.0, -7.0, 1.0]), bits=4, block_size=4)
assert q.tolist() == [0x97, 0x01] and s.tolist() == [1.0]
print("STALE-OK")
"""


def test_stale_extension_runs_the_reference(native_C):
    """An extension built before these ops (a stale in-place build) makes them fall back to
    the reference instead of failing (zkernels/_cpu.py drops what the binding lacks)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("ZKERNELS_BACKEND", None)
    proc = subprocess.run([sys.executable, "-c", _STALE], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "STALE-OK" in proc.stdout, proc.stdout + proc.stderr
