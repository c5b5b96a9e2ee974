"""Public flatten / unflatten: checks, then dispatch (see ``_backend``)."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from . import _checks, _fast
from ._backend import Resolve, implementation
from ..layout import packed_offsets


def flatten(tensors: Sequence[torch.Tensor], *, out: Optional[torch.Tensor] = None,
            dtype: Optional[torch.dtype] = None,
            offsets: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Copy ``tensors`` into one flat buffer in one launch. See
    :func:`zkernels.reference.flatten` for the arguments."""
    if _fast.flatten(tensors, out, dtype, offsets, True):
        return out
    return _flatten(implementation, tensors, out=out, dtype=dtype, offsets=offsets)


def _flatten(resolve: Resolve,
             tensors: Sequence[torch.Tensor], *, out: Optional[torch.Tensor] = None,
             dtype: Optional[torch.dtype] = None,
             offsets: Optional[Sequence[int]] = None) -> torch.Tensor:
    numels = _checks.tensor_list("tensors", tensors)
    offs = list(offsets) if offsets is not None else packed_offsets(numels)
    device = tensors[0].device if tensors else (out.device if out is not None
                                                 else torch.device("cpu"))
    if out is not None:
        _checks.tensor("out", out, device=device, one_dim=True)
        if dtype is not None and dtype != out.dtype:
            raise TypeError(f"dtype={dtype} disagrees with out.dtype={out.dtype}")
        _checks.offsets("offsets", offs, numels, out.numel(), "out")
    else:
        _checks.offsets("offsets", offs, numels, 1 << 62, "out")
        total = max((o + n for o, n in zip(offs, numels)), default=0)
        out = torch.zeros(total, dtype=dtype or (tensors[0].dtype if tensors else torch.float32),
                          device=device)
    if not tensors:
        return out
    return resolve("flatten", device)(tensors, out=out, offsets=offs)


def unflatten(flat: torch.Tensor, shapes: Optional[Sequence[Sequence[int]]] = None, *,
              out: Optional[Sequence[torch.Tensor]] = None,
              offsets: Optional[Sequence[int]] = None) -> List[torch.Tensor]:
    """Views of ``flat`` (``shapes=``), or a one-launch copy into existing tensors (``out=``).
    See :func:`zkernels.reference.unflatten`."""
    if _fast.unflatten(flat, shapes, out, offsets, True):
        return list(out)
    return _unflatten(implementation, flat, shapes, out=out, offsets=offsets)


def _unflatten(resolve: Resolve,
               flat: torch.Tensor, shapes: Optional[Sequence[Sequence[int]]] = None, *,
               out: Optional[Sequence[torch.Tensor]] = None,
               offsets: Optional[Sequence[int]] = None) -> List[torch.Tensor]:
    _checks.tensor("flat", flat, one_dim=True)
    if (shapes is None) == (out is None):
        raise ValueError("unflatten: give exactly one of shapes= or out=")
    if shapes is not None:
        # Views need no kernel on any backend.
        numels = [int(torch.Size(s).numel()) for s in shapes]
        offs = list(offsets) if offsets is not None else packed_offsets(numels)
        _checks.offsets("offsets", offs, numels, flat.numel(), "flat")
        return [flat[o:o + n].view(tuple(s)) for s, o, n in zip(shapes, offs, numels)]
    numels = _checks.tensor_list("out", out, device=flat.device)
    offs = list(offsets) if offsets is not None else packed_offsets(numels)
    _checks.offsets("offsets", offs, numels, flat.numel(), "flat")
    if not out:
        return []
    return resolve("unflatten", flat.device)(flat, out=out, offsets=offs)
