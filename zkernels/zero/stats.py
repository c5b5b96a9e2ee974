"""Memory held per rank, counted from the storages actually allocated (not from formulas)."""
from __future__ import annotations

import gc
import warnings
from typing import Dict, Iterable, Set, Tuple

import torch

KINDS = ("params", "grads", "master", "optimizer_states", "buffers")


def memory_bytes(groups: Dict[str, Iterable[torch.Tensor]]) -> Dict[str, int]:
    """Bytes of each distinct storage, by kind.

    Args:
        groups: tensors per kind (keys: ``KINDS``). A storage is counted once, under the first
            kind (in ``KINDS`` order) that holds it: e.g. in pure fp32 the master shard is a
            view of the compute parameters, so it counts as params and master is 0.

    Returns:
        ``{kind: bytes}`` for every kind plus ``"total"``.
    """
    seen: Set[Tuple[str, int]] = set()
    out = {}
    for kind in KINDS:
        total = 0
        for t in groups.get(kind, ()):
            if t is None or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            total += storage.nbytes()
        out[kind] = total
    out["total"] = sum(out[k] for k in KINDS)
    return out


def memory_by_location(device: Dict[str, Iterable[torch.Tensor]],
                       host: Dict[str, Iterable[torch.Tensor]],
                       disk: Dict[str, int]) -> Tuple[Dict[str, int], Dict[str, int],
                                                      Dict[str, Dict[str, int]]]:
    """Bytes by kind over device tensors, host tensors (offload) and file bytes (NVMe).

    Returns:
        ``(by_kind, by_location, split)``: ``{kind: bytes, "total"}`` summed over the three
        places, ``{"device", "host", "disk"}`` totals, and ``{place: {kind: bytes,
        "total"}}`` (each kind in each place). A storage is counted once (under the first
        place and kind that holds it).
    """
    on_disk = {k: int(disk.get(k, 0)) for k in KINDS}
    on_disk["total"] = sum(on_disk[k] for k in KINDS)
    split = {"device": memory_bytes(device), "host": memory_bytes(host), "disk": on_disk}
    by_kind = {k: sum(place[k] for place in split.values()) for k in KINDS}
    by_kind["total"] = sum(by_kind[k] for k in KINDS)
    where = {place: kinds["total"] for place, kinds in split.items()}
    return by_kind, where, split


def live_tensor_bytes(skip: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of every distinct storage of a tensor alive in this process (meta and empty ones
    aside), except the storages of ``skip``: an independent check of what ``memory_bytes``
    counts from the tensors the optimizer names (tests, benchmarks/after_backward.py). Walks
    ``gc.get_objects()`` (milliseconds); inside backward it also sees the activations the
    autograd graph saved."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on torch.distributed.reduce_op warns
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    skipped = {_storage_key(t) for t in skip}
    plain = []
    for t in tensors:
        key = _storage_key(t)
        if key is not None and key not in skipped:
            plain.append(t)
    return memory_bytes({"params": plain})["total"]


def _storage_key(t: torch.Tensor):
    """(device, storage pointer), or None for a tensor without a storage of its own (a
    wrapper subclass such as a DTensor: the walk meets its local tensor by itself)."""
    try:
        return str(t.device), t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
