"""Count the bytes this process sends through ``torch.distributed`` collectives.

[Note: byte convention]
Bytes are what one rank *sends* under the ring algorithm, for a group of N ranks:
  all-reduce of a B-byte tensor            2·B·(N−1)/N
  reduce-scatter / all-gather, B-byte full buffer (input of RS, output of AG)  B·(N−1)/N
  all-to-all of a B-byte input              B·(N−1)/N
  broadcast of B bytes                      B from every rank except the last one of the ring
                                            that starts at the root (so at N = 2: the root
                                            sends B, the other rank 0)
  anything else (reduce, gather, scatter, p2p)  the input's bytes, under "other"
These are the volumes the ZeRO ladder is stated in (docs/design.md#traffic: data parallel and
stages 1/2 move 2Ψ per step), whatever algorithm gloo or NCCL actually picks.

Interception is by wrapping the Python entry points of ``torch.distributed`` (both the
``torch.distributed`` and the ``torch.distributed.distributed_c10d`` names, so a caller that
looks them up in either place at call time is seen). Collectives issued from C++ (DDP's
reducer without a Python comm hook, functional collectives) are NOT seen: the benchmark routes
DDP through a Python comm hook and checks that every method it reports was seen.
When one wrapped entry point calls another (``all_gather_into_tensor`` forwards to
``all_gather_single`` in torch 2.13) only the outermost call counts.

[Note: scopes]
With ``shard_size=K`` (``--shard-size``: hybrid sharding, K consecutive ranks per group, as a
node) every byte also counts toward a scope: ``within_group`` when the collective's group lies
inside one block of K consecutive ranks, ``across_groups`` otherwise (a replicate group, or
any group spanning blocks, e.g. the world: DDP's all-reduce crosses the groups whole).
"""
from __future__ import annotations

import contextlib
import inspect
import threading
from typing import Callable, Dict, Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "other")
SCOPES = ("within_group", "across_groups")


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    return sum(_nbytes(x) for x in t)  # list / tuple of tensors


def _group_size_rank(group) -> tuple:
    return dist.get_world_size(group), dist.get_rank(group)


def _all_reduce(a) -> tuple:
    n, _ = _group_size_rank(a.get("group"))
    key = "tensor" if "tensor" in a else "tensors"
    return "all_reduce", 2 * _nbytes(a[key]) * (n - 1) / n


def _ring(kind: str, key: str, times_n: bool = False) -> Callable:
    """Reduce-scatter, all-gather, all-to-all: (N-1)/N of the full buffer ``a[key]`` (N times
    it with ``times_n``: the per-rank input of all-gather's list forms)."""
    def count(a) -> tuple:
        n, _ = _group_size_rank(a.get("group"))
        return kind, _nbytes(a[key]) * (n if times_n else 1) * (n - 1) / n
    return count


def _broadcast(a) -> tuple:
    group = a.get("group")
    n, rank = _group_size_rank(group)
    src = a.get("group_src")
    if src is None:
        src = a["src"] if group is None else dist.get_group_rank(group, a["src"])
    last = (src - 1) % n  # the ring's last rank receives and forwards nothing
    return "broadcast", (0 if n == 1 or rank == last else _nbytes(a["tensor"]))


def _first_tensor_arg(a) -> tuple:
    for v in a.values():
        if isinstance(v, torch.Tensor) or (isinstance(v, (list, tuple)) and v
                                           and isinstance(v[0], torch.Tensor)):
            return "other", _nbytes(v)
    return "other", 0


# entry point -> how many bytes this rank sends, from its bound arguments
_COUNTERS: Dict[str, Callable] = {
    "all_reduce": _all_reduce,
    "all_reduce_coalesced": _all_reduce,
    "broadcast": _broadcast,
    "reduce_scatter_single": _ring("reduce_scatter", "input"),
    "reduce_scatter_tensor": _ring("reduce_scatter", "input"),
    "_reduce_scatter_base": _ring("reduce_scatter", "input"),
    "reduce_scatter": _ring("reduce_scatter", "input_list"),
    "reduce_scatter_tensor_coalesced": _ring("reduce_scatter", "input_tensors"),
    "all_gather_single": _ring("all_gather", "output_tensor"),
    "all_gather_into_tensor": _ring("all_gather", "output_tensor"),
    "_all_gather_base": _ring("all_gather", "output_tensor"),
    "all_gather": _ring("all_gather", "tensor", times_n=True),
    "all_gather_coalesced": _ring("all_gather", "input_tensor_list", times_n=True),
    "all_gather_into_tensor_coalesced": _ring("all_gather", "output_tensors"),
    "all_to_all_single": _ring("other", "input"),
    "reduce": _first_tensor_arg,
    "gather": _first_tensor_arg,
    "scatter": _first_tensor_arg,
    "send": _first_tensor_arg,
    "isend": _first_tensor_arg,
}


class CommMeter:
    """Bytes sent and calls made by this process, per collective kind, while ``enabled``.

    Use as ``with meter.installed(): ...``; ``reset()`` starts a new step, ``snapshot()``
    returns ``{"bytes": {kind: int, ..., "total": int}, "calls": {entry_point: int}}``.
    """

    def __init__(self, shard_size=None) -> None:
        self.shard_size = shard_size
        self.enabled = False
        self._local = threading.local()
        self.reset()

    def reset(self) -> None:
        self._bytes = {k: 0.0 for k in KINDS}
        self._scopes = {k: 0.0 for k in SCOPES}
        self._calls: Dict[str, int] = {}

    def snapshot(self) -> dict:
        out = {k: int(round(v)) for k, v in self._bytes.items()}
        out["total"] = sum(out[k] for k in KINDS)
        return {"bytes": out, "calls": dict(self._calls),
                "scopes": {k: int(round(v)) for k, v in self._scopes.items()}}

    def _scope(self, group) -> str:
        """See [Note: scopes]."""
        if self.shard_size is None:
            return "within_group"
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        return "within_group" if len({r // self.shard_size for r in ranks}) == 1 \
            else "across_groups"

    def _wrap(self, name: str, orig: Callable) -> Callable:
        sig = inspect.signature(orig)
        count = _COUNTERS[name]

        def wrapper(*args, **kwargs):
            depth = getattr(self._local, "depth", 0)
            if self.enabled and depth == 0:
                bound = sig.bind(*args, **kwargs)
                bound.apply_defaults()
                kind, nbytes = count(bound.arguments)
                self._bytes[kind] += nbytes
                self._scopes[self._scope(bound.arguments.get("group"))] += nbytes
                self._calls[name] = self._calls.get(name, 0) + 1
            self._local.depth = depth + 1
            try:
                return orig(*args, **kwargs)
            finally:
                self._local.depth = depth

        wrapper.__wrapped__ = orig
        wrapper.__name__ = name
        return wrapper

    @contextlib.contextmanager
    def installed(self) -> Iterator["CommMeter"]:
        """Wrap every entry point this torch has, in both namespaces; restore on exit."""
        saved = []
        for name in _COUNTERS:
            orig = getattr(c10d, name, None)
            if orig is None:  # e.g. *_single in torch 2.11
                continue
            wrapped = self._wrap(name, orig)
            for mod in (dist, c10d):
                saved.append((mod, name, getattr(mod, name, None)))
                setattr(mod, name, wrapped)
        try:
            yield self
        finally:
            for mod, name, orig in reversed(saved):
                if orig is None:
                    delattr(mod, name)
                else:
                    setattr(mod, name, orig)
