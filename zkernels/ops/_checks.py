"""Argument checks shared by the public ops: every message names the argument at fault."""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def tensor(name: str, t, *, dtypes: Optional[Iterable[torch.dtype]] = FLOAT_DTYPES,
           device: Optional[torch.device] = None, contiguous: bool = True,
           numel: Optional[int] = None, one_dim: bool = False) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in tuple(dtypes):
        raise TypeError(f"{name} must have dtype in {_names(dtypes)}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (all tensors of one call "
                         f"must share a device)")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {tuple(t.stride())}); "
                         f"call .contiguous() first")
    if one_dim and t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} must have {numel} elements, got {t.numel()}")


def tensor_list(name: str, ts: Sequence, *, device: Optional[torch.device] = None,
                dtypes: Optional[Iterable[torch.dtype]] = FLOAT_DTYPES,
                same_dtype: bool = True) -> None:
    if isinstance(ts, torch.Tensor) or not isinstance(ts, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(ts).__name__}")
    for i, t in enumerate(ts):
        tensor(f"{name}[{i}]", t, dtypes=dtypes, device=device)
        if same_dtype and t.dtype != ts[0].dtype:
            raise TypeError(f"{name}[{i}] has dtype {t.dtype} but {name}[0] has {ts[0].dtype}: "
                            f"all tensors of one call must share a dtype")
        if device is None and t.device != ts[0].device:
            raise ValueError(f"{name}[{i}] is on {t.device} but {name}[0] is on {ts[0].device}")


def offsets(name: str, offs: Sequence[int], numels: Sequence[int], capacity: int,
            capacity_name: str) -> None:
    if len(offs) != len(numels):
        raise ValueError(f"{name} has {len(offs)} entries for {len(numels)} tensors")
    for i, (o, n) in enumerate(zip(offs, numels)):
        if int(o) < 0:
            raise ValueError(f"{name}[{i}] must be >= 0, got {o}")
        if int(o) + int(n) > capacity:
            raise ValueError(f"{capacity_name} is too small: tensor {i} needs elements "
                             f"[{o}, {int(o) + int(n)}) but it has {capacity}")


def _names(dtypes) -> str:
    return "(" + ", ".join(str(d) for d in dtypes) + ")"
