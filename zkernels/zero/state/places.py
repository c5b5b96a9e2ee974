"""Where the optimizer state lives: one injected place object per run, which the update engine
(``engine.py``) asks instead of testing a placement string.

[Note: state places]
``placement.make_engine`` turns ``offload=`` into one place composed into the
:class:`~zkernels.zero.state.engine.UpdateEngine`: :class:`DevicePlace` (no offload),
:class:`HostPlace` (host RAM: [Note: CPU offload step]) or
:class:`~zkernels.zero.state.nvme_place.NvmePlace` (files streamed through host slots: [Note:
NVMe offload step]). A place owns what differs by where the bytes live: each state kind's
allocation (``where``, ``alloc``), a new unit's record (``add``: its host gradient shard, the
slots, its files or a rule's swap), the sub-groups and their tensors (``pieces``), the step's
start and finish (one read of the scale, the copies and I/O still running, the figures), the
update order, where a whole-matrix class's owners keep their matrices (``whole_store``),
adopting a kept run, what it holds, and ``close``. The same object carries the
parameter shards' storage as ``params`` ([Note: shard storage] in ``parameters/storage.py``),
which ``make_engine`` injects into the parameter side's builders; its in-memory state kinds
come from ``storage`` (the device's ``DeviceStorage`` or the host's ``HostStorage``). With
``offload_params`` the two are one ``HostStorage`` (CPU) or the parameter files beside the
state's (NVMe); without it the shards stay on the device while the state is offloaded, so a
place composes the shards' storage rather than being it.

[Note: CPU offload step]
Three overlaps make the offloaded step cheap (ZeRO-Offload's schedule, with our fused C++ AdamW):

1. During backward, each unit's reduced gradient shard is copied to a host fp32 shard the
   moment its reduce-scatter finishes (``grad_sink.GradShards`` with a copier: ``accumulate``
   issues the copy off the compute stream and hands its fence to the reduce pool, which waits
   it before reusing the buffer). Only the copies still running when backward ends are
   exposed: ``stats()["offload"]`` reports copy time and the part hidden.
2. The step runs the CPU AdamW over host buffers in sub-groups of
   ``OffloadConfig.sub_group_numel`` elements, reading the fp32 gradient and writing the
   updated parameters in the compute dtype in the same pass (no separate cast).
3. The compute-dtype result of sub-group k goes to the device (into the unit's compute
   shard) on the copy stream while sub-group k+1 updates; two host staging slots alternate,
   and a slot is reused only after its copy finished. In pure fp32 the master itself is
   copied (no staging). The unit's last copy is fenced onto the compute stream before the
   gather policy's ``publish`` reads the shard.

Host memory per rank: master 4Ψ/N + moments 8Ψ/N + gradient shard 4Ψ/N + two staging
sub-groups. Stage 1 is refused (its full gradients live on the device until ``step()``).
With ``offload_params=True`` (stage 3) the step writes the host shard in place ([Note:
parameter offload]: no staging, nothing sent in ``step()``; in pure fp32 the master is the
shard), with NVMe offload each sub-group's slot into the shard's file ([Note: parameters on
NVMe]: sub-groups span whole 4096-byte blocks of it, so the smallest bf16 budget doubles).
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ...ops import OpSet
from ..parameters.storage import DeviceStorage
from .grad_sink import GradShards
from .matrix_swap import WholeInMemory
from .shard_state import ShardState
from .transfer import Copier, Fence

KINDS = ("master", "exp_avg", "exp_avg_sq")


def host_scalar(grad_scale):
    """``grad_scale`` as a host number (a device tensor is read once: one sync per step)."""
    return float(grad_scale.item()) if isinstance(grad_scale, torch.Tensor) else grad_scale


@dataclass
class Slot:
    """One sub-group's host buffers (by kind, gradient, compute-dtype output) and what still
    uses them (futures and fences to finish before the slot is reused)."""

    states: Dict[str, torch.Tensor] = field(default_factory=dict)
    grad: Optional[torch.Tensor] = None
    out: Optional[torch.Tensor] = None
    busy: list = field(default_factory=list)

    def settle(self) -> float:
        t0 = time.perf_counter()
        for b in self.busy:
            b.result() if hasattr(b, "result") else b.synchronize()
        self.busy = []
        return time.perf_counter() - t0


@dataclass
class Piece:
    """The tensors one AdamW call of a sub-group reads and writes."""

    master: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    out: Optional[torch.Tensor]
    busy: list
    slot_out: Optional[torch.Tensor] = None   # the slot's whole (aligned) output buffer
    exp_avg_scales: Optional[torch.Tensor] = None      # int8 moments: from the piece's
    exp_avg_sq_scales: Optional[torch.Tensor] = None   # first block on


class DevicePlace:
    """The state on the compute device (no offload), updated in place by the device's OpSet
    (see [Note: state places]).

    Attributes:
        name: the placement as ``offload=`` names it ("device", "cpu", "nvme").
        step_at: where the update runs (a shard that ``holds`` it is written in place).
        where: each state kind's location ("device", "host" or "disk"), for ``stats()``.
        grad_sink: CPU offload's host gradient shards (the gradient strategy fills them), or
            None (the strategy keeps its own); ``grad_ops``: the OpSet of the shards.
        sub_group_numel: elements per AdamW call (0: a shard whole).
        resumed: a kept run was adopted; ``closed``: ``close()`` ran; ``last_step``: the
            last step's transfer figures.
    """

    name, step_at = "device", "device"
    grad_sink: Optional[GradShards] = None
    sub_group_numel = 0
    resumed = closed = False

    def __init__(self, ops: OpSet, storage: Optional[DeviceStorage] = None) -> None:
        self.storage = self.params = storage or DeviceStorage()
        self.step_ops = self.grad_ops = ops
        self.where = dict.fromkeys(KINDS, self.step_at)
        self.last_step: Dict[str, float] = {}

    def alloc(self, n: int, kind: str, device: torch.device,
              dtype: torch.dtype = torch.float32, resident: bool = False) -> torch.Tensor:
        """``n`` zeros of state ``kind`` where it lives (``resident``: in memory even where
        the kind's files would hold it: a whole-matrix unit's shard master)."""
        return self.storage.empty(n, dtype, device)

    def add(self, rec: ShardState, initial_master: torch.Tensor, spec) -> None:
        """Place a new unit's record (its master and moments allocated by :meth:`alloc`)."""

    def begin_step(self, grad_scale):
        """Before a unit's update: the scale its AdamW reads."""
        return grad_scale

    def ranges(self, n: int, align: int = 1) -> List[Tuple[int, int]]:
        """Sub-groups of ``n`` elements, each starting at a multiple of ``align`` (a low-bit
        state's block size: a sub-group never splits a block)."""
        sub = self.sub_group_numel or max(n, 1)
        sub = max(sub // align * align, align)
        return [(lo, min(n, lo + sub)) for lo in range(0, n, sub)]

    def _slot(self, staged: bool) -> Slot:
        return Slot()

    def pieces(self, rec: ShardState, grad: torch.Tensor,
               staged: bool) -> Iterator[Tuple[int, int, Piece]]:
        """Sub-groups of a state held in memory: views, and an output staging slot when the
        result must travel (``staged``)."""
        bs = rec.fmt.block_size if rec.fmt is not None and rec.fmt.blocked else 1
        for lo, hi in self.ranges(rec.numel, bs):
            slot = self._slot(staged)
            blocks = slice(lo // bs, -(-hi // bs))
            yield lo, hi, Piece(rec.master[lo:hi], grad[lo:hi], rec.exp_avg[lo:hi],
                                rec.exp_avg_sq[lo:hi],
                                None if slot.out is None else slot.out[:hi - lo], slot.busy,
                                exp_avg_scales=None if bs == 1 else rec.exp_avg_scales[blocks],
                                exp_avg_sq_scales=None if bs == 1 else
                                rec.exp_avg_sq_scales[blocks])

    def finish_step(self, update_s: float) -> None:
        """After every unit's update (``update_s``: the seconds they took)."""

    def settle(self) -> None:
        """Every copy and I/O of the step finished (the state may be read or written)."""

    def write_compute(self, unit, master: torch.Tensor) -> None:
        """The unit's compute shard from a master (a load: not a step's traffic)."""
        shard = unit.compute_shard
        if master.data_ptr() == shard.data_ptr():
            return   # fp32 (or a bf16 master): the master is the shard
        unit.shard.settle()
        if shard.dtype in (torch.float32, master.dtype):
            shard.copy_(master)
        else:
            self.step_ops.cast(master.contiguous(), out=shard)

    publish_rule = write_compute   # a rule's unit after its step: the same write

    def fill(self, rec: ShardState, src: Dict[str, Optional[torch.Tensor]],
             kinds: Optional[Sequence[str]] = None) -> None:
        """Write ``rec``'s files from ``src`` (none here: its tensors hold the state)."""

    def materialize(self, rec: ShardState, kind: str, t: torch.Tensor) -> torch.Tensor:
        """State ``kind`` of ``rec`` (its tensor ``t``) as a tensor in memory."""
        return t

    def whole_store(self) -> WholeInMemory:
        """Where a whole-matrix class's owners keep their whole matrices (matrix_swap.py)."""
        return WholeInMemory()

    def update_order(self, units: Sequence) -> list:
        """Forward order (units are in backward order), so the gathers land as the next
        forward needs them ([Note: lazy parameter gathers] in param_wait.py)."""
        return list(reversed(units))

    def adopt(self, num_units: int) -> None:
        raise RuntimeError(f"placement {self.name!r} does not resume kept state")

    def held_at(self, states: Sequence[ShardState], where: str) -> Dict[str, list]:
        """The records' tensors at ``where`` by kind ("master", "optimizer_states")."""
        out = {"master": [], "optimizer_states": []}
        for rec in states:
            for k, t in zip(KINDS, rec.tensors()):
                at = self.where[k]
                if at == "disk" and not t.is_meta:   # (a whole-matrix unit's shard master:
                    at = "host"                      # [Note: whole matrices on NVMe])
                if at == where:
                    out["master" if k == "master" else "optimizer_states"].append(t)
            if self.where["exp_avg"] == where:
                out["optimizer_states"].extend(rec.scales())
            if rec.rule is not None and self.where["master"] == where:
                out["optimizer_states"].extend(rec.rule.held())
        return out

    def held_host(self, states: Sequence[ShardState]) -> Dict[str, list]:
        return {}

    def disk_bytes(self) -> Dict[str, int]:
        return {}

    def close(self, states: Sequence[ShardState], specs, keep_files: bool) -> Optional[str]:
        if keep_files:
            raise ValueError("close(keep_files=True) applies only to offload='nvme'")
        return None


class OffloadPlace(DevicePlace):
    """The state in host RAM or files, updated by the host's OpSet (CPU AdamW), each unit's
    result copied to the device where its shard is there; the host slots and the copier's
    thread or stream are this object's (see [Note: state places]).

    Args:
        ops, host_ops: the device's OpSet (the gradient shards') and the host's (the update's).
        copier: the offload's :class:`Copier`; storage, params: the ``HostStorage`` of the
            state kinds in RAM and the parameter shards' storage.
    """

    step_at = "host"

    def __init__(self, ops: OpSet, host_ops: OpSet, copier: Copier, storage, params) -> None:
        super().__init__(ops, storage)   # (the gradient shards stay the device's)
        self.step_ops, self.params, self.copier = host_ops, params, copier
        self._slots: List[Slot] = []
        self._buffers: List[torch.Tensor] = []   # the host memory behind the slots
        self._next_slot = 0
        self._in_step = False
        self._scale: Optional[float] = None
        self._exposed_s = 0.0
        self._finalizer = weakref.finalize(self, Copier.close, copier)

    def begin_step(self, grad_scale):
        if not self._in_step:   # the step's first unit: one read (sync) per step
            self._scale = host_scalar(grad_scale)
        self._in_step = True
        return self._scale

    def _release_buffers(self) -> None:
        for b in self._buffers:
            self.copier.unpin(b)
        self._buffers, self._slots, self._next_slot = [], [], 0

    def _take_slot(self) -> Slot:
        slot = self._slots[self._next_slot]
        self._next_slot = (self._next_slot + 1) % len(self._slots)
        self._exposed_s += slot.settle()
        return slot

    def _slot(self, staged: bool) -> Slot:
        return self._take_slot() if staged else Slot()

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> Fence:
        """A sub-group's output into the device's shard (counted, off the compute stream)."""
        return self.copier.to_device(dst, src)

    def settle(self) -> None:
        for s in self._slots:
            s.settle()

    def finish_step(self, update_s: float) -> None:
        t0 = time.perf_counter()
        self.settle()
        c = self.copier.take_counters()
        params = self.params.take_counters()
        tail = time.perf_counter() - t0
        out = {"update_s": update_s + tail,
               "host_to_device_bytes": c["to_device_bytes"],
               "device_to_host_bytes": c["to_host_bytes"],
               "host_to_device_s": c["to_device_busy_s"],
               "device_to_host_s": c["to_host_busy_s"],
               **self._figures(c, self._exposed_s + tail)}
        self.last_step = {**out, **params}
        self._exposed_s = 0.0
        self._in_step = False

    def _cast_for(self, shard: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
        """``master`` in the dtype of the device's ``shard``, on the host."""
        return master if shard.dtype in (torch.float32, master.dtype) else \
            self.step_ops.cast(master.contiguous(), shard.dtype)

    def write_compute(self, unit, master: torch.Tensor) -> None:
        if unit.shard.in_file:
            unit.shard.load_values(master)
        elif unit.shard.holds(self.step_at):
            super().write_compute(unit, master)
        else:
            shard = unit.compute_shard
            self.copier.copy_untracked(shard, self._cast_for(shard, master)).synchronize()

    def publish_rule(self, unit, master: torch.Tensor) -> None:
        if unit.shard.holds("device"):   # one counted copy up, as AdamW's
            shard = unit.compute_shard
            self.to_device(shard, self._cast_for(shard, master)).wait()
        else:
            self.write_compute(unit, master)

    def held_host(self, states: Sequence[ShardState]) -> Dict[str, list]:
        """Host tensors by kind: parameter shards (``offload_params``), master, moments,
        gradient shards and the slots' buffers."""
        return {"params": self.params.held_host(), **self.held_at(states, "host"),
                "grads": self._grad_shards(),
                "buffers": list(self._buffers) + self.params.buffers()}

    def close(self, states: Sequence[ShardState], specs, keep_files: bool) -> Optional[str]:
        super().close(states, specs, keep_files)
        if not self.closed:
            self.settle()
        self.closed = True
        self._finalizer()
        return None


class HostPlace(OffloadPlace):
    """CPU offload: every state kind in host RAM, the reduced gradient shards copied into
    host shards during backward (``grad_sink``), sub-groups of
    ``OffloadConfig.sub_group_numel`` with two staging slots for a device shard's output
    (see [Note: CPU offload step])."""

    name = "cpu"

    def __init__(self, ops: OpSet, host_ops: OpSet, copier: Copier, config, storage,
                 params) -> None:
        super().__init__(ops, host_ops, copier, storage, params)
        self.grad_sink, self.grad_ops = GradShards(copier=copier), host_ops
        self.sub_group_numel = config.sub_group_numel

    def add(self, rec: ShardState, initial_master: torch.Tensor, spec) -> None:
        """The unit's host gradient shard, and two output staging slots (mixed precision,
        shard on the device) big enough for it."""
        unit = rec.unit
        rec.grad = self.grad_sink.add(rec.numel, torch.device("cpu"))
        cdt, need = unit.compute_dtype, min(rec.numel, self.sub_group_numel)
        if cdt == torch.float32 or unit.shard.holds("host") or self._slots and \
                self._slots[0].out.numel() >= need and self._slots[0].out.dtype == cdt:
            return
        self._release_buffers()   # (unpinned: the larger ones replace them)
        self._buffers = [self.copier.host_empty(need, cdt) for _ in range(2)]
        self._slots = [Slot(out=b) for b in self._buffers]

    def _figures(self, c: dict, exposed: float) -> dict:
        """The step's own figures: the gradient copies' time hidden behind backward."""
        busy, waited = c["to_host_busy_s"], self.grad_sink.exposed_s
        self.grad_sink.exposed_s = 0.0
        return dict(device_to_host_exposed_s=min(waited, busy),
                    device_to_host_hidden_s=max(0.0, busy - waited),
                    host_to_device_exposed_s=exposed, disk_read_bytes=0, disk_write_bytes=0)

    def _grad_shards(self) -> list:
        return list(self.grad_sink.shards)
