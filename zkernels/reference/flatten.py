"""Reference flatten / unflatten."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ..layout import packed_offsets


def flatten(tensors: Sequence[torch.Tensor], *, out: Optional[torch.Tensor] = None,
            dtype: Optional[torch.dtype] = None,
            offsets: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Copy ``tensors`` (any shapes, one dtype, one device) into one flat 1-D buffer.

    Args:
        tensors: the sources, contiguous.
        out: optional 1-D contiguous destination; its dtype is the cast target. Elements not
            covered by a tensor are left untouched.
        dtype: dtype of a newly allocated buffer when ``out`` is None (default: the sources').
        offsets: element offset of each tensor in the buffer (default: back to back from 0).

    Returns:
        ``out``, or a new 1-D tensor of ``sum(numel)`` elements (or up to the last
        ``offset + numel``), with each tensor cast (round to nearest even) at its offset.
    """
    numels = [t.numel() for t in tensors]
    offs = list(offsets) if offsets is not None else packed_offsets(numels)
    if out is None:
        total = max((o + n for o, n in zip(offs, numels)), default=0)
        dev = tensors[0].device if tensors else torch.device("cpu")
        src_dtype = tensors[0].dtype if tensors else torch.float32
        out = torch.zeros(total, dtype=dtype or src_dtype, device=dev)
    for t, o, n in zip(tensors, offs, numels):
        out[o:o + n].copy_(t.reshape(-1))
    return out


def unflatten(flat: torch.Tensor, shapes: Optional[Sequence[Sequence[int]]] = None, *,
              out: Optional[Sequence[torch.Tensor]] = None,
              offsets: Optional[Sequence[int]] = None) -> List[torch.Tensor]:
    """Inverse of :func:`flatten`.

    Args:
        flat: 1-D buffer.
        shapes: give these to get views of ``flat`` (no copy), one per shape.
        out: or give existing contiguous tensors to copy into (cast to each one's dtype).
        offsets: element offset of each tensor in ``flat`` (default: back to back from 0).

    Returns:
        the views, or ``out``.
    """
    if (shapes is None) == (out is None):
        raise ValueError("unflatten: give exactly one of shapes= or out=")
    if shapes is not None:
        numels = [_numel(s) for s in shapes]
        offs = list(offsets) if offsets is not None else packed_offsets(numels)
        return [flat[o:o + n].view(tuple(s)) for s, o, n in zip(shapes, offs, numels)]
    numels = [t.numel() for t in out]
    offs = list(offsets) if offsets is not None else packed_offsets(numels)
    for t, o, n in zip(out, offs, numels):
        t.view(-1).copy_(flat[o:o + n])
    return list(out)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
