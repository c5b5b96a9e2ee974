"""A unit shard's AdamW moments in a low-bit format: allocation, the fused step on a range,
and the conversions a checkpoint needs.

[Note: low-bit state in shards]
A param group with ``state_dtype`` (``planning/state_format.py``) keeps its moments as
[Note: low-bit moment formats] (``zkernels/reference/adamw_lowbit.py``) says: bf16 tensors,
or int8 / uint8 codes with one fp32 scale per block of ``block_size`` elements and moment.
Blocks never cross a shard or parameter boundary: when any group is int8, every parameter
of every unit starts at a multiple of ``block_size`` in its flat buffer and every shard is a
multiple of it (the layout's ``align``, ``parameters/build.py``), so block ``j`` of a shard is
block ``(shard_start + j*bs - param_offset) / bs`` of one parameter: the blocks a sharded run
quantizes are exactly those of the whole parameter (element 0 on), at any world size, stage,
hybrid shape, CPU offload sub-group or unused-parameter segment (all start at such
multiples). A sharded run therefore reproduces the single-process
:class:`~zkernels.reference.adamw_lowbit.LowbitAdamW` bit for bit, and a checkpoint's codes
and scales re-slice to any other world size without requantizing. The cost is padding: a
parameter whose size is not a multiple of ``block_size`` pads to the next one (at most
``block_size - 1`` elements per parameter, zero and never updated; a padding element has
zero moments, so it never changes its block's absmax scale).

The step runs ``ops.adamw_step_lowbit`` (the device's OpSet, or the host's with CPU offload:
its C++ path where built, else the reference) once per live range, with the same unscale,
found-inf skip (the optimizer skips the whole step) and compute-dtype output as the fp32
AdamW. With NVMe offload the files and slots hold the same formats ([Note: low-bit state on
NVMe] in ``nvme_files.py``).
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from ...reference.adamw_lowbit import (INT8_CODE, LINEAR_INT8_CODE, moments_from_codes,
                                       quantize_exp_avg, quantize_exp_avg_sq)
from ..planning.state_format import StateFormat

Alloc = Callable[[int, torch.dtype], torch.Tensor]


def alloc_moments(n: int, fmt: StateFormat, alloc: Alloc
                  ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor],
                             Optional[torch.Tensor]]:
    """Zero ``(exp_avg, exp_avg_sq, exp_avg_scales, exp_avg_sq_scales)`` of ``n`` elements
    (``alloc(numel, dtype)`` returns a zeroed tensor where the state lives)."""
    if not fmt.blocked:
        return alloc(n, torch.bfloat16), alloc(n, torch.bfloat16), None, None
    nb = fmt.num_blocks(n)
    return (alloc(n, torch.int8), alloc(n, torch.uint8), alloc(nb, torch.float32),
            alloc(nb, torch.float32))


def step_range(ops, fmt: StateFormat, master: torch.Tensor, grad: torch.Tensor,
               exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, sm: Optional[torch.Tensor],
               sv: Optional[torch.Tensor], a: int, b: int, out: Optional[torch.Tensor],
               hparams: dict) -> None:
    """One fused low-bit AdamW over ``[a, b)`` of a piece whose element 0 starts a block
    (``sm``/``sv``: the piece's scales from its first block)."""
    if not fmt.blocked:
        ops.adamw_step_lowbit(master[a:b], grad[a:b], exp_avg[a:b], exp_avg_sq[a:b], out=out,
                              **hparams)
        return
    bs = fmt.block_size
    if a % bs:
        raise RuntimeError(f"internal: a low-bit AdamW range starts at {a}, not at a multiple "
                           f"of state_block_size={bs} ([Note: low-bit state in shards])")
    blocks = slice(a // bs, -(-b // bs))
    ops.adamw_step_lowbit(master[a:b], grad[a:b], exp_avg[a:b], exp_avg_sq[a:b], sm[blocks],
                          sv[blocks], out=out, block_size=bs, **hparams)


def dequantized(fmt: StateFormat, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                sm: Optional[torch.Tensor], sv: Optional[torch.Tensor],
                code: str = INT8_CODE) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp32 copies of the moments (for export and fp32 readers; ``code``: the int8 codes'
    map, ``reference.adamw_lowbit.INT8_CODES``)."""
    if not fmt.blocked:
        return exp_avg.float(), exp_avg_sq.float()
    bs, n = fmt.block_size, exp_avg.numel()
    return moments_from_codes(exp_avg.reshape(-1), exp_avg_sq.reshape(-1),
                              sm.reshape(-1).repeat_interleave(bs)[:n],
                              sv.reshape(-1).repeat_interleave(bs)[:n], code)


def quantized(fmt: StateFormat, m: torch.Tensor, v: torch.Tensor) -> dict:
    """The format's tensors of fp32 moments ``m``, ``v`` (bf16: rounded to nearest even;
    int8: blocks from element 0)."""
    if not fmt.blocked:
        return {"exp_avg": m.to(torch.bfloat16), "exp_avg_sq": v.to(torch.bfloat16)}
    qm, sm = quantize_exp_avg(m.float(), fmt.block_size)
    qv, sv = quantize_exp_avg_sq(v.float(), fmt.block_size)
    return {"exp_avg": qm, "exp_avg_sq": qv, "exp_avg_scales": sm, "exp_avg_sq_scales": sv}


def describe_format(fmt: Optional[StateFormat]) -> Optional[dict]:
    """A checkpoint's ``{"dtype", "block_size"}`` of ``fmt``, and for int8 the ``"code"`` of its
    map (a state_format without one holds the linear codes of earlier versions)."""
    if fmt is None:
        return None
    desc = {"dtype": fmt.name, "block_size": fmt.block_size}
    return {**desc, "code": INT8_CODE} if fmt.blocked else desc


def format_of(desc: Optional[dict]) -> Optional[StateFormat]:
    """The :class:`StateFormat` a checkpoint's ``{"dtype", "block_size"}`` names (None: fp32)."""
    if desc is None:
        return None
    return StateFormat(torch.bfloat16 if desc["dtype"] == "bf16" else "int8",
                       int(desc["block_size"]))


def fp32_moments(desc: Optional[dict], tensors: dict) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(exp_avg, exp_avg_sq)`` of saved moments in the format ``desc`` names."""
    fmt = format_of(desc)
    if fmt is None:
        return tensors["exp_avg"], tensors["exp_avg_sq"]
    return dequantized(fmt, tensors["exp_avg"], tensors["exp_avg_sq"],
                       tensors.get("exp_avg_scales"), tensors.get("exp_avg_sq_scales"),
                       desc.get("code", LINEAR_INT8_CODE))
