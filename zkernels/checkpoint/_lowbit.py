"""Low-bit AdamW moments in a checkpoint: the fields a piece keeps, and reading them back.

[Note: low-bit moments in a checkpoint]
A parameter whose group keeps low-bit moments (``ZeroOptimizer(state_dtype=...)``) is saved
as it is trained: each piece holds "master" (fp32) and "exp_avg", "exp_avg_sq" in the trained
dtype (bf16, or int8 / uint8 codes), and with int8 "exp_avg_scales", "exp_avg_sq_scales"
(fp32, one per block of ``block_size`` elements). The piece entry records
``"state_format": {"dtype", "block_size"}`` (int8: and ``"code": "float8"``, the map of
[Note: low-bit moment formats]; an int8 entry without ``"code"`` was written by an earlier
zkernels with linear codes, read as such and converted like another format below; an unknown
code is refused by name) and the dtype of each field (``"dtypes"``); the
scales of a piece ``[start, end)`` are the parameter's blocks ``[start / bs, ceil(end / bs))``
(an int8 run starts every parameter and shard at a multiple of ``bs``, so pieces hold whole
blocks and the block ranges tile the parameter as the element ranges do).

Loading reads each piece of this rank from whichever saved pieces hold it:

- into a run of the same format and block size: the codes and scales are copied (blocks are
  whole parameter blocks at any world size and stage: no shard boundary ever splits one), so a
  resume continues bit for bit;
- into any other format (fp32, bf16, int8 of another block size): the saved moments are
  dequantized to fp32 and the optimizer stores them in its own format (fp32 as they are,
  bf16 rounded to nearest even, int8 requantized over its own blocks); a saved fp32 state
  loaded into a low-bit run is quantized the same way. Either conversion is logged at
  WARNING on the "zkernels.checkpoint" logger, naming both formats. Requantizing int8 over
  other blocks (or from the old linear codes) moves each moment by at most half a step of its
  new code: ``2**-4`` of ``|m|`` and ``2**-5`` of ``sqrt(v)`` (``2**-18`` and ``2**-19`` of the
  new block's absmax below ``2**-14`` of it); tests/zero/test_lowbit_checkpoint.py
  measures it.

``consolidate_moments`` exports the fp32 (dequantized) moments of every parameter.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from . import manifest
from ..reference.adamw_lowbit import (INT8_CODE, LINEAR_INT8_CODE, check_int8_code,
                                      moments_from_codes)
from ._tensorfile import dtype_from_name

MOMENTS = ("exp_avg", "exp_avg_sq")
SCALES = ("exp_avg_scales", "exp_avg_sq_scales")


def saved_format(m: Dict[str, Any], name: str) -> Optional[dict]:
    """The ``state_format`` a parameter was saved with (None: fp32 moments)."""
    pieces = m["params"][name]["pieces"]
    return pieces[0].get("state_format") if pieces else None


def describe(desc: Optional[dict]) -> str:
    if desc is None:
        return "fp32"
    if desc["dtype"] != "int8":
        return desc["dtype"]
    code = desc.get("code", LINEAR_INT8_CODE)
    old = "" if code == INT8_CODE else f", {code} codes of an earlier zkernels"
    return f"int8 (blocks of {desc['block_size']}{old})"


def _blocks(start: int, end: int, bs: int) -> Tuple[int, int]:
    return start // bs, -(-end // bs)


def _read_field(files, name: str, field: str, lo: int, hi: int, div: int,
                target: torch.Tensor) -> None:
    """Units ``[lo, hi)`` of ``field`` (elements, or blocks of ``div`` for scales) of ``name``
    into ``target``, from whichever saved pieces hold them, in each piece's saved dtype."""
    for piece in files.param_pieces(name):
        a, b = _blocks(piece["start"], piece["end"], div)
        x, y = max(lo, a), min(hi, b)
        if x >= y:
            continue
        where = f"params[{name!r}]"
        if field not in piece:
            raise manifest.CorruptCheckpointError(f"{where}: a piece has no {field!r}")
        dtype = dtype_from_name(piece.get("dtypes", {}).get(field, "F32"), where)
        esize = torch.empty((), dtype=dtype).element_size()
        begin, stop = piece[field]
        if stop - begin != (b - a) * esize:
            raise manifest.CorruptCheckpointError(f"{where}: the {field} byte range of a "
                                                  f"piece does not match its range")
        files.read_into(piece["file"], begin + (x - a) * esize, dtype, target[x - lo:y - lo])


def read_lowbit(files, name: str, start: int, end: int, desc: dict
                ) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
    """Elements ``[start, end)`` of a low-bit parameter's saved moments: ``(exp_avg fp32,
    exp_avg_sq fp32, raw)``, ``raw`` the saved tensors (codes over the elements, scales over
    blocks ``[start / bs, ceil(end / bs))``; bf16 moments) as they are in the files."""
    n = end - start
    if desc["dtype"] == "bf16":
        raw = {k: torch.empty(n, dtype=torch.bfloat16) for k in MOMENTS}
        for k in MOMENTS:
            _read_field(files, name, k, start, end, 1, raw[k])
        return raw["exp_avg"].float(), raw["exp_avg_sq"].float(), raw
    bs = int(desc["block_size"])
    code = check_int8_code(desc.get("code", LINEAR_INT8_CODE), f"params[{name!r}]")
    b0, b1 = _blocks(start, end, bs)
    raw = {"exp_avg": torch.empty(n, dtype=torch.int8),
           "exp_avg_sq": torch.empty(n, dtype=torch.uint8),
           **{k: torch.empty(b1 - b0, dtype=torch.float32) for k in SCALES}}
    for k in MOMENTS:
        _read_field(files, name, k, start, end, 1, raw[k])
    for k in SCALES:
        _read_field(files, name, k, b0, b1, bs, raw[k])
    idx = torch.arange(start, end) // bs - b0
    m, v = moments_from_codes(raw["exp_avg"], raw["exp_avg_sq"], raw["exp_avg_scales"][idx],
                              raw["exp_avg_sq_scales"][idx], code)
    return m, v, raw


def field_specs(desc: Optional[dict], start: int, end: int):
    """``[(field, dtype, numel)]`` of a fused AdamW piece saved in format ``desc``."""
    n = end - start
    if desc is None:
        return [(f, torch.float32, n) for f in ("master",) + MOMENTS]
    if desc["dtype"] == "bf16":
        return [("master", torch.float32, n), ("exp_avg", torch.bfloat16, n),
                ("exp_avg_sq", torch.bfloat16, n)]
    b0, b1 = _blocks(start, end, int(desc["block_size"]))
    return [("master", torch.float32, n), ("exp_avg", torch.int8, n),
            ("exp_avg_sq", torch.uint8, n), *[(k, torch.float32, b1 - b0) for k in SCALES]]
