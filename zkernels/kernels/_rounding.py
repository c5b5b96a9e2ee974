"""fp32 -> bf16/fp16 rounding that equals ``torch.Tensor.to`` bit for bit, in Triton.

[Note: exact rounding in kernels]
Every cast a kernel stores must equal ``tensor.to(dtype)`` on the same device, bit for bit:
the ZeRO stages compare compute copies against ``param.to(dtype)`` and the tests use
``torch.equal``. The native ``x.to(tl.bfloat16)`` cannot be trusted for that everywhere: under
``TRITON_INTERPRET=1`` it truncates, and the interpreter's fp16 cast (numpy) rounds to nearest
even but keeps NaN payloads differently from PyTorch. So finite values and infinities are
rounded here on the bit pattern (round to nearest even, overflow to inf, subnormals), which is
exact on the interpreter and on a GPU alike.

NaN is the one value whose bits PyTorch itself does not define portably. On CPU (measured,
torch 2.13, x86): fp32 -> bf16 writes 0xFFFF, fp16 -> bf16 writes 0x7FC0, and fp32/bf16 -> fp16
writes ``sign | 0x7E00 | fp32_payload >> 13``; on CUDA the hardware ``cvt.rn`` instruction
writes the canonical NaN. The launcher passes ``NATIVE_NAN=True`` for CUDA tensors, so NaN
lanes take the compiled cast, the very instruction PyTorch's CUDA cast uses; on CPU tensors the
CPU patterns are built here. Signalling-NaN payloads are not reproduced (PyTorch's CPU upcasts
quiet them, numpy's do not); arithmetic never produces them.
"""
import triton
import triton.language as tl


@triton.jit
def _bf16_bits(x, NATIVE_NAN: tl.constexpr, CPU_NAN: tl.constexpr):
    """uint32 holding the bf16 bits (low 16) of fp32 ``x`` rounded to nearest even; NaN
    becomes ``CPU_NAN`` unless ``NATIVE_NAN``."""
    b = x.to(tl.uint32, bitcast=True)
    lsb = (b >> 16) & 1
    rounded = (b + 0x7FFF + lsb) >> 16
    is_nan = (b & 0x7FFFFFFF) > 0x7F800000
    if NATIVE_NAN:
        nan_bits = x.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)
    else:
        nan_bits = tl.full(b.shape, CPU_NAN, tl.uint32)
    return tl.where(is_nan, nan_bits, rounded)


@triton.jit
def _fp16_bits(x, NATIVE_NAN: tl.constexpr):
    """uint32 holding the fp16 bits (low 16) of fp32 ``x`` rounded to nearest even."""
    b = x.to(tl.uint32, bitcast=True)
    sign = (b >> 16) & 0x8000
    a = b & 0x7FFFFFFF
    # Normal range: rebias the exponent (127 -> 15) and round off 13 mantissa bits; a carry
    # out of the mantissa bumps the exponent, up to 0x7C00 (inf) for |x| >= 65520.
    r = a - 0x38000000
    normal = (r + 0xFFF + ((r >> 13) & 1)) >> 13
    normal = tl.minimum(normal, 0x7C00)
    # Below 2^-14 the result is a multiple of 2^-24: adding 0.5 (whose ulp is 2^-24) makes
    # the fp32 adder round to nearest even at exactly that unit. Lanes outside that range
    # (NaN included) add 0 instead, so no invalid operation is ever evaluated.
    small = a < 0x38800000
    tiny = tl.where(small, tl.abs(x), 0.0)
    magic = (tiny + 0.5).to(tl.uint32, bitcast=True) - 0x3F000000
    mag = tl.where(small, magic, normal)
    is_nan = a > 0x7F800000
    if NATIVE_NAN:
        nan_bits = x.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
    else:
        nan_bits = sign | 0x7E00 | ((a >> 13) & 0x3FF)
    return tl.where(is_nan, nan_bits, sign | mag)


@triton.jit
def round_to(x, DST: tl.constexpr, NATIVE_NAN: tl.constexpr):
    """``x`` (fp32) converted to ``DST`` (fp32, bf16 or fp16) exactly as ``Tensor.to`` does."""
    if DST == tl.bfloat16:
        return _bf16_bits(x, NATIVE_NAN, 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    elif DST == tl.float16:
        return _fp16_bits(x, NATIVE_NAN).to(tl.uint16).to(tl.float16, bitcast=True)
    else:
        return x.to(DST)


@triton.jit
def convert(x, DST: tl.constexpr, NATIVE_NAN: tl.constexpr):
    """Any of fp32/bf16/fp16 to ``DST``: a plain copy when the dtypes agree, else via fp32 (bf16
    and fp16 are exact in fp32, so one rounding, as ``Tensor.to`` does)."""
    if x.dtype == DST:
        return x
    elif x.dtype == tl.float16 and DST == tl.bfloat16:
        # PyTorch's CPU half -> bfloat16 cast takes a scalar path with its own NaN (0x7FC0).
        bits = _bf16_bits(x.to(tl.float32), NATIVE_NAN, 0x7FC0)
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return round_to(x.to(tl.float32), DST, NATIVE_NAN)


@triton.jit
def widen(x):
    """fp32/bf16/fp16 ``x`` as fp32, exactly: bf16 through its bits (the interpreter's bf16
    upcast mangles subnormals; on a GPU this is the same shift the hardware does)."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)
