"""Inputs for the quantization tests: blocks of many magnitudes with the cases of [Note:
blockwise quantization semantics] planted in known blocks."""
import torch

BLOCK_SIZES = (2, 32, 256, 8192)
CASES = ("zeros", "nan", "inf", "neg_inf_and_nan", "subnormal", "ties", "tiny")


def quant_values(n: int, block_size: int, bits: int, seed: int = 0) -> torch.Tensor:
    """``n`` fp32 values, a random magnitude per block (2**-30 .. 2**20), with the blocks
    after the first holding, in turn: all zeros (some -0), a NaN, +inf, -inf and a NaN, fp32
    subnormals only, half-integer multiples of amax / qmax (rounding ties), values near 1e-38
    (where qmax / amax would overflow). The last block is partial when ``n`` is not a multiple
    of ``block_size``."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-n // block_size)
    mag = torch.exp2(torch.randint(-30, 20, (nb,), generator=g).float())
    x = torch.randn(nb * block_size, generator=g) * mag.repeat_interleave(block_size)
    blocks = x.view(nb, block_size)
    qmax = 127 if bits == 8 else 7
    for i, case in enumerate(CASES, start=1):
        if i >= nb:
            break
        b = blocks[i]
        if case == "zeros":
            b.zero_()
            b[::3] = -0.0
        elif case == "nan":
            b[block_size // 2] = float("nan")
        elif case == "inf":
            b[-1] = float("inf")
        elif case == "neg_inf_and_nan":
            b[0] = float("-inf")
            b[-1] = float("nan")
        elif case == "subnormal":
            b.copy_(torch.randint(-2000, 2000, (block_size,), generator=g).to(torch.int32)
                    .abs().view(torch.float32) * torch.sign(torch.randn(block_size, generator=g)))
        elif case == "ties":
            # amax = qmax: (x / qmax) * qmax lands on k + 0.5 for many half-integers k + 0.5.
            k = torch.randint(-qmax, qmax, (block_size,), generator=g).float() + 0.5
            b.copy_(k)
            b[0] = float(qmax)
        elif case == "tiny":
            b.mul_(0).add_(torch.rand(block_size, generator=g) * 1e-38)
    return x[:n].clone()


def tie_count(x: torch.Tensor, block_size: int, bits: int) -> int:
    """How many finite elements of fp32 ``x`` have ``(x / amax) * qmax`` exactly halfway
    between two integers (where round half to even decides)."""
    qmax = 127 if bits == 8 else 7
    pad = (-x.numel()) % block_size
    b = torch.nn.functional.pad(x.float(), (0, pad)).view(-1, block_size)
    amax = b.abs().amax(dim=1, keepdim=True)
    ok = torch.isfinite(amax) & (amax > 0)
    y = (b / torch.where(ok, amax, torch.ones_like(amax))) * qmax
    frac = y - torch.floor(y)
    return int(((frac == 0.5) & ok).sum())
