"""Triton flatten / unflatten: one launch for all tensors (kernel in ``_copy.py``)."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ..layout import packed_offsets
from ._copy import scaled_copy


def flatten(tensors: Sequence[torch.Tensor], *, out: Optional[torch.Tensor] = None,
            dtype: Optional[torch.dtype] = None,
            offsets: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Copy ``tensors`` into one flat buffer, cast to its dtype, in one launch.

    Same contract as :func:`zkernels.reference.flatten`: contiguous sources of one dtype and
    device; ``out`` (1-D, contiguous) or a new zero-filled buffer of ``dtype``; each tensor at
    its offset (default back to back), padding untouched.

    Returns:
        ``out`` or the new 1-D buffer.
    """
    numels = [t.numel() for t in tensors]
    offs = list(offsets) if offsets is not None else packed_offsets(numels)
    if out is None:
        total = max((o + n for o, n in zip(offs, numels)), default=0)
        dev = tensors[0].device if tensors else torch.device("cpu")
        src_dtype = tensors[0].dtype if tensors else torch.float32
        out = torch.zeros(total, dtype=dtype or src_dtype, device=dev)
    if not tensors:
        return out
    esize, base = out.element_size(), out.data_ptr()
    scaled_copy([t.data_ptr() for t in tensors], [base + int(o) * esize for o in offs], numels,
                tensors[0].dtype, out.dtype, out.device)
    return out


def unflatten(flat: torch.Tensor, shapes: Optional[Sequence[Sequence[int]]] = None, *,
              out: Optional[Sequence[torch.Tensor]] = None,
              offsets: Optional[Sequence[int]] = None) -> List[torch.Tensor]:
    """Inverse of :func:`flatten`: views of ``flat`` (``shapes=``, no kernel) or one launch
    copying slices into the contiguous tensors of ``out`` (one dtype), cast to their dtype.

    Returns:
        the views, or ``out`` as a list.
    """
    if (shapes is None) == (out is None):
        raise ValueError("unflatten: give exactly one of shapes= or out=")
    if shapes is not None:
        numels = [int(torch.Size(s).numel()) for s in shapes]
        offs = list(offsets) if offsets is not None else packed_offsets(numels)
        return [flat[o:o + n].view(tuple(s)) for s, o, n in zip(shapes, offs, numels)]
    numels = [t.numel() for t in out]
    offs = list(offsets) if offsets is not None else packed_offsets(numels)
    if not out:
        return []
    esize, base = flat.element_size(), flat.data_ptr()
    scaled_copy([base + int(o) * esize for o in offs], [t.data_ptr() for t in out], numels,
                flat.dtype, out[0].dtype, flat.device)
    return list(out)
