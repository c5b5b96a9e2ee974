"""Memory held per rank, counted from the storages actually allocated (not from formulas)."""
from __future__ import annotations

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
                       disk: Dict[str, int]) -> Tuple[Dict[str, int], Dict[str, int]]:
    """Bytes by kind over device tensors, host tensors (offload) and file bytes (NVMe).

    Returns:
        ``(by_kind, by_location)``: ``{kind: bytes, "total"}`` summed over the three places,
        and ``{"device", "host", "disk"}`` totals. A storage is counted once (under the first
        place and kind that holds it).
    """
    on_device = memory_bytes(device)
    on_host = memory_bytes(host)
    by_kind = {k: on_device[k] + on_host[k] + int(disk.get(k, 0)) for k in KINDS}
    by_kind["total"] = sum(by_kind[k] for k in KINDS)
    where = {"device": on_device["total"], "host": on_host["total"],
             "disk": sum(int(disk.get(k, 0)) for k in KINDS)}
    return by_kind, where
