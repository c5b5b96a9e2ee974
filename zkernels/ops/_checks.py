"""Argument checks shared by the public ops: every message names the argument at fault.

[Note: cheap checks]
The list checks run on every call of a multi-tensor op, and at 256K elements in 32 tensors a
CPU op's whole budget is tens of microseconds, while each tensor attribute read from Python
costs ~0.1 us. So ``tensor_list`` reads each attribute once per tensor in one loop that only
tests (returning the numels the callers need anyway), and ``offsets`` tests the extremes with
builtins; only when something fails does the detailed pass run, to raise the message that names
the argument and index.
"""
from __future__ import annotations

import math
import operator
from typing import Iterable, List, Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_Tensor = torch.Tensor


def tensor(name: str, t, *, dtypes: Optional[Iterable[torch.dtype]] = FLOAT_DTYPES,
           device: Optional[torch.device] = None, contiguous: bool = True,
           numel: Optional[int] = None, one_dim: bool = False) -> None:
    if not isinstance(t, _Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in (dtypes if isinstance(dtypes, tuple)
                                              else tuple(dtypes)):
        raise TypeError(f"{name} must have dtype in {_names(dtypes)}, got {t.dtype}")
    # CPU: a flag read instead of building and comparing torch.device objects.
    if device is not None and (not t.is_cpu if device.type == "cpu" else t.device != device):
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
                same_dtype: bool = True) -> List[int]:
    """Checks a list of contiguous tensors on one device (``device`` when given) with dtypes
    in ``dtypes`` (one dtype when ``same_dtype``); returns their numels."""
    if isinstance(ts, torch.Tensor) or not isinstance(ts, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(ts).__name__}")
    if not ts:
        return []
    numels = _fast_tensor_list(ts, device, dtypes, same_dtype)
    if numels is None:
        _tensor_list_detailed(name, ts, device, dtypes, same_dtype)  # raises
        numels = [t.numel() for t in ts]
    return numels


def _fast_tensor_list(ts: Sequence, device: Optional[torch.device], dtypes, same_dtype: bool):
    """The numels when every check of ``tensor_list`` passes, else None (see [Note: cheap
    checks])."""
    first = ts[0]
    if not isinstance(first, _Tensor):
        return None
    dtype0 = first.dtype
    allowed = tuple(dtypes) if dtypes is not None else None
    if allowed is not None and dtype0 not in allowed:
        return None
    dev = device if device is not None else first.device
    numels: List[int] = []
    append = numels.append
    if dev.type == "cpu":
        for t in ts:
            if not isinstance(t, _Tensor) or not t.is_cpu or not t.is_contiguous():
                return None
            dt = t.dtype
            if dt is not dtype0 and (same_dtype or (allowed is not None and dt not in allowed)):
                return None
            append(t.numel())
    else:
        for t in ts:
            if not isinstance(t, _Tensor) or t.device != dev or not t.is_contiguous():
                return None
            dt = t.dtype
            if dt is not dtype0 and (same_dtype or (allowed is not None and dt not in allowed)):
                return None
            append(t.numel())
    return numels


def _tensor_list_detailed(name: str, ts: Sequence, device, dtypes, same_dtype: bool) -> None:
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
    if not offs:
        return
    try:
        if min(offs) >= 0 and max(map(operator.add, offs, numels)) <= capacity:
            return
    except TypeError:
        pass
    for i, (o, n) in enumerate(zip(offs, numels)):
        if int(o) < 0:
            raise ValueError(f"{name}[{i}] must be >= 0, got {o}")
        if int(o) + int(n) > capacity:
            raise ValueError(f"{capacity_name} is too small: tensor {i} needs elements "
                             f"[{o}, {int(o) + int(n)}) but it has {capacity}")


def _names(dtypes) -> str:
    return "(" + ", ".join(str(d) for d in dtypes) + ")"


def step_buffers(param, grad, out, found_inf, grad_scale, step=None,
                 param_dtypes=(torch.float32,), **state):
    """The checks every fused optimizer step shares: ``param`` 1-D contiguous, of a dtype in
    ``param_dtypes`` (fp32); ``grad``, each state buffer (keyword name -> tensor, None skipped)
    and ``out`` on its device with its numel (the state fp32); ``found_inf`` a 1-element fp32
    flag; ``step``/``grad_scale``, when tensors, one element on that device. Returns
    ``(numel, device)``."""
    fp32 = (torch.float32,)
    tensor("param", param, dtypes=param_dtypes, one_dim=True)
    n, dev = param.numel(), param.device
    tensor("grad", grad, device=dev, numel=n, one_dim=True)
    for name, buf in state.items():
        if buf is not None:
            tensor(name, buf, dtypes=fp32, device=dev, numel=n, one_dim=True)
    if out is not None:
        tensor("out", out, device=dev, numel=n, one_dim=True)
    if found_inf is not None:
        tensor("found_inf", found_inf, dtypes=fp32, device=dev, numel=1)
    for name, t in (("step", step), ("grad_scale", grad_scale)):
        if isinstance(t, _Tensor):
            tensor(name, t, dtypes=None, device=dev, numel=1)
    return n, dev


def unit_interval(name: str, x) -> None:
    """``x`` a real number in [0, 1]."""
    if not isinstance(x, (int, float)) or isinstance(x, bool) or not 0.0 <= x <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {x!r}")


def finite(name: str, x) -> None:
    """``x`` a finite real number."""
    if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x):
        raise ValueError(f"{name} must be a finite number, got {x!r}")
