"""Public blockwise int8/int4 quantize, dequantize and fused dequantize-and-sum (ZeRO++'s qwZ
and qgZ building blocks): checks, then dispatch. Semantics: [Note: blockwise quantization
semantics] in ``zkernels/reference/quant.py``."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from . import _checks
from ._backend import Resolve, implementation
from ..reference.quant import QMAX, code_numel, num_blocks

MIN_BLOCK_SIZE = 2
MAX_BLOCK_SIZE = 8192
_CODE_DTYPES = {8: torch.int8, 4: torch.uint8}
_FP32 = (torch.float32,)


def check_block_size(block_size, name: str = "block_size") -> int:
    """``block_size`` as the ops take it: a power of two in [2, 8192] (so that an int4 byte
    never holds two blocks and a block fits one Triton tile).

    Raises:
        ValueError: anything else (the message names ``name``).
    """
    if type(block_size) is not int or not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE or \
            block_size & (block_size - 1):
        raise ValueError(f"{name} must be a power of two in [{MIN_BLOCK_SIZE}, "
                         f"{MAX_BLOCK_SIZE}], got {block_size!r}")
    return block_size


def _format(bits, block_size) -> None:
    """``bits`` 8 or 4; ``block_size`` as :func:`check_block_size` takes it."""
    if type(bits) is not int or bits not in QMAX:
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    check_block_size(block_size)


def _codes(name: str, t, bits: int, device: torch.device, numel: Optional[int] = None) -> None:
    _checks.tensor(name, t, dtypes=(_CODE_DTYPES[bits],), device=device, numel=numel)


def quantize(x: torch.Tensor, *, bits: int = 8, block_size: int = 256,
             out: Optional[torch.Tensor] = None,
             scales: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Blockwise symmetric quantization to int8 or int4 (two per byte) with one fp32 scale
    per block. See :func:`zkernels.reference.quantize`."""
    return _quantize(implementation, x, bits=bits, block_size=block_size, out=out,
                     scales=scales)


def _quantize(resolve: Resolve, x: torch.Tensor, *, bits: int = 8, block_size: int = 256,
              out: Optional[torch.Tensor] = None,
              scales: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    _checks.tensor("x", x)
    _format(bits, block_size)
    n, dev = x.numel(), x.device
    if out is None:
        out = torch.empty(code_numel(n, bits), dtype=_CODE_DTYPES[bits], device=dev)
    else:
        _codes("out", out, bits, dev, code_numel(n, bits))
    if scales is None:
        scales = torch.empty(num_blocks(n, block_size), dtype=torch.float32, device=dev)
    else:
        _checks.tensor("scales", scales, dtypes=_FP32, device=dev,
                       numel=num_blocks(n, block_size))
    if n == 0:
        return out, scales
    return resolve("quantize", dev)(x, bits=bits, block_size=block_size, out=out,
                                    scales=scales)


def dequantize(q: torch.Tensor, scales: torch.Tensor, *, bits: int = 8, block_size: int = 256,
               numel: Optional[int] = None, out: Optional[torch.Tensor] = None,
               dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``float(q) * scale`` per element, rounded to ``out.dtype``. See
    :func:`zkernels.reference.dequantize`."""
    return _dequantize(implementation, q, scales, bits=bits, block_size=block_size,
                       numel=numel, out=out, dtype=dtype)


def _dequantize(resolve: Resolve, q: torch.Tensor, scales: torch.Tensor, *, bits: int = 8,
                block_size: int = 256, numel: Optional[int] = None,
                out: Optional[torch.Tensor] = None,
                dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    _format(bits, block_size)
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    dev = q.device
    if out is not None:
        _checks.tensor("out", out, device=dev)
        if numel is not None and numel != out.numel():
            raise ValueError(f"numel={numel} disagrees with out.numel()={out.numel()}")
        if dtype is not None and dtype != out.dtype:
            raise TypeError(f"dtype={dtype} disagrees with out.dtype={out.dtype}")
        numel = out.numel()
    elif numel is None:
        numel = q.numel() * (1 if bits == 8 else 2)
    elif type(numel) is not int or numel < 0:
        raise ValueError(f"numel must be an int >= 0, got {numel!r}")
    if out is None and dtype is not None and dtype not in _checks.FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of {_checks.FLOAT_DTYPES}, got {dtype}")
    _codes("q", q, bits, dev, code_numel(numel, bits))
    _checks.tensor("scales", scales, dtypes=_FP32, device=dev,
                   numel=num_blocks(numel, block_size))
    if out is None:
        out = torch.empty(numel, dtype=dtype or torch.float32, device=dev)
    if numel == 0:
        return out
    return resolve("dequantize", dev)(q, scales, bits=bits, block_size=block_size,
                                      numel=numel, out=out)


def dequantize_sum(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, bits: int = 8,
                   block_size: int = 256, scale: float = 1.0,
                   accumulate: bool = False) -> torch.Tensor:
    """Dequantize N received chunks of one shard and sum them in fp32 (in chunk order), times
    ``scale``, into ``out`` or (``accumulate``) onto it. See
    :func:`zkernels.reference.dequantize_sum`."""
    return _dequantize_sum(implementation, q, scales, out, bits=bits, block_size=block_size,
                           scale=scale, accumulate=accumulate)


def _dequantize_sum(resolve: Resolve, q: torch.Tensor, scales: torch.Tensor,
                    out: torch.Tensor, *, bits: int = 8, block_size: int = 256,
                    scale: float = 1.0, accumulate: bool = False) -> torch.Tensor:
    _checks.tensor("out", out)
    _format(bits, block_size)
    n, dev = out.numel(), out.device
    _codes("q", q, bits, dev)
    per_chunk, nb = code_numel(n, bits), num_blocks(n, block_size)
    if q.dim() != 2 or q.shape[0] < 1 or q.shape[1] != per_chunk:
        raise ValueError(f"q must be 2-D (num_chunks >= 1, {per_chunk}): one row of codes of "
                         f"out's {n} elements per chunk, got shape {tuple(q.shape)}")
    _checks.tensor("scales", scales, dtypes=_FP32, device=dev)
    if tuple(scales.shape) != (q.shape[0], nb):
        raise ValueError(f"scales must have shape ({q.shape[0]}, {nb}): one row of block "
                         f"scales per chunk of q, got {tuple(scales.shape)}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or \
            not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    if not isinstance(accumulate, bool):
        raise TypeError(f"accumulate must be a bool, got {type(accumulate).__name__}")
    if n == 0:
        return out
    return resolve("dequantize_sum", dev)(q, scales, out, bits=bits, block_size=block_size,
                                          scale=float(scale), accumulate=accumulate)
