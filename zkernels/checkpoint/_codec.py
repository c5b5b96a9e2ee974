"""JSON encoding of param-group hyper-parameters and the caller's ``model_extra``.

Plain JSON values stay as they are. Tuples, dicts with non-string keys and tensors are
tagged objects (``{"__tuple__": [...]}``, ``{"__items__": [[k, v], ...]}``,
``{"__tensor__": key}``); tensors are stored in ``model.safetensors``. Decoding builds only
these types: nothing in a checkpoint can name a class to construct.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict

import torch

from .errors import CorruptCheckpointError

_TAGS = ("__tuple__", "__items__", "__tensor__")


def encode(obj: Any, tensors: Dict[str, torch.Tensor], where: str) -> Any:
    """``obj`` as JSON-able data; tensors go into ``tensors`` under new keys."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        if not math.isfinite(obj):
            return {"__float__": repr(obj)}
        return obj
    if isinstance(obj, torch.Tensor):
        key = f"extra/{len(tensors)}"
        tensors[key] = obj.detach()
        return {"__tensor__": key}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not any(k in _TAGS or k == "__float__"
                                                            for k in obj):
            return {k: encode(v, tensors, f"{where}[{k!r}]") for k, v in obj.items()}
        return {"__items__": [[encode(k, tensors, f"{where} key"),
                               encode(v, tensors, f"{where}[{k!r}]")] for k, v in obj.items()]}
    raise TypeError(f"{where} holds a {type(obj).__name__}, which a checkpoint cannot store: "
                    f"use numbers, strings, lists, dicts, tuples and tensors (a checkpoint "
                    f"stores no pickles)")


def decode(obj: Any, tensor: Callable[[str], torch.Tensor], where: str) -> Any:
    """Inverse of :func:`encode`; ``tensor(key)`` reads a stored tensor."""
    if isinstance(obj, list):
        return [decode(v, tensor, where) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        (tag, value), = obj.items()
        if tag == "__tuple__" and isinstance(value, list):
            return tuple(decode(v, tensor, where) for v in value)
        if tag == "__items__" and isinstance(value, list):
            if not all(isinstance(kv, list) and len(kv) == 2 for kv in value):
                raise CorruptCheckpointError(f"{where}: malformed '__items__'")
            out = {}
            for k, v in value:
                k = decode(k, tensor, where)
                try:
                    out[k] = decode(v, tensor, where)
                except TypeError:  # an unhashable key
                    raise CorruptCheckpointError(f"{where}: unhashable key {k!r}") from None
            return out
        if tag == "__tensor__" and isinstance(value, str):
            return tensor(value)
        if tag == "__float__" and value in ("inf", "-inf", "nan"):
            return float(value)
    return {k: decode(v, tensor, where) for k, v in obj.items()}
