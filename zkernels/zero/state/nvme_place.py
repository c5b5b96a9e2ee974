"""NVMe offload's state place: the state kinds in files (``nvme_files.py``), streamed through
an arena of host slots ([Note: state places] in ``places.py``).

[Note: NVMe offload step]
Host RAM holds ``NUM_NVME_BUFFERS`` (3) slots carved out of one aligned arena: each slot holds
one sub-group's moments (and master), its gradient slice and its compute-dtype output. The
arena is sized to need: a sub-group never exceeds the largest unit shard, and the whole arena
never exceeds ``OffloadConfig.nvme_buffer_bytes`` (the budget caps the sub-group). The step
walks every unit's shard in sub-groups, slot after slot, so that sub-group k+1 is being read
from disk while k is updated by the CPU AdamW and k-1 written back (a slot is reused only
after its writes and its device copy finished); the read of the next unit's first sub-group
starts during the current unit's last, so units go in index order (``update_order``). The
gradient shard stays where stage 2 keeps it (the device); each sub-group's slice comes to
its slot by the copier, and the updated parameters go back the same way. Host RAM is the
arena whatever the model size; disk holds 8Ψ/N (moments) or 12Ψ/N (with the master), and
low-bit moments at their own size (4Ψ/N bf16, (2 + 8/block)Ψ/N int8: [Note: low-bit state on
NVMe] in nvme_files.py, which also says how the slots hold them).
Before the first sub-group of a step every file's size is checked, so a truncated file fails
the step before any state changes. Files live in the run's own folder (``nvme_files.py``)
and go at ``close`` unless ``close(keep_files=True)`` keeps them.
"""
from __future__ import annotations

from typing import Dict, Iterator, Optional, Sequence, Tuple

import torch

from ...ops import OpSet
from ..planning.offload_config import (NUM_NVME_BUFFERS, nvme_slot_views,
                                       nvme_sub_group_align, nvme_sub_group_numel)
from .matrix_rule import MatrixUnitRule
from .matrix_swap import WholeSwap
from .nvme_files import SCALE_KINDS, NvmeFiles
from .places import OffloadPlace, Piece, Slot
from .rule_swap import SwappedRule
from .shard_state import ShardState
from .swap import aligned_empty
from .transfer import Copier


def _file_range(rec: ShardState, kind: str, lo: int, hi: int) -> Tuple[int, int]:
    """Elements ``[lo, hi)`` of ``rec``'s shard in the file of ``kind``: the same, or a scale
    file's blocks (``lo`` starts a block: [Note: low-bit state on NVMe] in nvme_files.py)."""
    if kind not in SCALE_KINDS:
        return lo, hi
    bs = rec.fmt.block_size
    return lo // bs, -(-hi // bs)


class NvmePlace(OffloadPlace):
    """The moments (and with ``nvme_master`` the master) in files, the rest in host RAM; each
    unit's shard streamed through ``NUM_NVME_BUFFERS`` slots in index order.

    Args:
        ops, host_ops, copier, storage, params: as ``places.OffloadPlace``.
        config: the :class:`OffloadConfig` (the arena's budget).
        files: the run's :class:`NvmeFiles`.
        slot_moments: the slots' moment width and scales (``state_format.slot_moments``).
        master_dtype: the fused AdamW's master dtype (its file's blocks).
    """

    name = "nvme"

    def __init__(self, ops: OpSet, host_ops: OpSet, copier: Copier, config, files: NvmeFiles,
                 storage, params, slot_moments, master_dtype: torch.dtype) -> None:
        super().__init__(ops, host_ops, copier, storage, params)
        self.config, self.files, self.resumed = config, files, files.resumed
        self.slot_moments, self.master_dtype = slot_moments, master_dtype
        self.where.update((k, "disk") for k in files.kinds)
        self._records = []
        self._largest_shard = 0
        self._prefetched: Optional[Tuple[ShardState, Slot]] = None

    def alloc(self, n, kind, device, dtype=torch.float32, resident=False):
        if kind in self.files.kinds and not resident:
            return torch.empty(n, dtype=dtype, device="meta")
        return super().alloc(n, kind, device, dtype)

    def add(self, rec: ShardState, initial_master: torch.Tensor, spec) -> None:
        """A fused AdamW unit: its files (created, or resuming, opened and checked) with the
        initial state, and the arena sized for it; a rule's state swapped in files of its own
        ([Note: rule state on NVMe]); a whole-matrix unit's swaps are the matrix update's."""
        unit, n = rec.unit, rec.numel
        self._records.append(rec)
        if isinstance(rec.rule, MatrixUnitRule):
            return
        if rec.rule is not None:
            rec.rule = SwappedRule(rec.rule, self.files, unit.index, n, self.copier,
                                   master_on_disk=rec.master.is_meta)
            if self.files.resumed:   # a kept folder: its files, its steps, its master
                rec.rule.adopt(self.files.rule_info(unit.index, spec.name))
                rec.set_step(self.files.kept_step(unit.index))
                self.write_compute(unit, rec.rule.master_copy())
            elif rec.master.is_meta:
                rec.rule.write_master(initial_master)
            return
        self._ensure_slots(n, unit)
        # (a kept run's unit count; each parameter resumes at it: the run folder's manifest
        # keeps one count per unit)
        rec.set_step(self.files.open(rec))
        if self.files.resumed:
            self.write_compute(unit, self.files.read_all(rec, "master"))
        else:
            self.fill(rec, {"master": initial_master})

    def _ensure_slots(self, n: int, unit) -> None:
        """The arena sized to need, capped by the budget. fp32: the copy (or a parameter
        file's write, param_nvme.py) reads the master in its slot; a host master is not
        aligned, so the output is staged in the slot. With a parameter file a sub-group
        starts at an aligned byte of it too."""
        kinds, cdt = self.files.kinds, unit.compute_dtype
        on_disk = unit.shard.in_file
        cb = 0 if cdt == torch.float32 and ("master" in kinds or not on_disk) else cdt.itemsize
        mb, bs = self.slot_moments   # (low-bit moments: narrower buffers, and scales)
        fb = cdt.itemsize if on_disk else 0
        # (sized for the largest shard so far: a sub-group that splits a shard starts at
        # multiples of the alignment, which a smaller unit's whole shard need not be)
        self._largest_shard = max(self._largest_shard, n)
        ms = self.master_dtype.itemsize   # (a bf16 master's file: 2048-element blocks)
        sub = nvme_sub_group_numel(self.config.nvme_buffer_bytes, len(kinds), cb,
                                   self._largest_shard, file_bytes=fb, moment_bytes=mb,
                                   block_size=bs, master_bytes=ms)
        have = self.sub_group_numel
        if sub <= have and (have >= self._largest_shard or
                            have % nvme_sub_group_align(fb, mb, bs, ms) == 0):
            return
        self.settle()
        self._release_buffers()
        self.sub_group_numel = sub
        views = nvme_slot_views(sub, len(kinds), cb, mb, bs)
        per_slot = sum(b for _, b in views)
        # Touched now (zeroed): host RAM holds what stats() reports from the start.
        arena = aligned_empty(NUM_NVME_BUFFERS * per_slot,
                              self.copier.pin if self.copier.pinned else None).zero_()
        self._buffers, self._slots = [arena], []
        for s in range(NUM_NVME_BUFFERS):
            ofs, bufs = s * per_slot, {}
            for name, b in views:   # raw bytes, typed per unit (_typed)
                bufs[name], ofs = arena[ofs:ofs + b], ofs + b
            grad, out = bufs.pop("grad").view(torch.float32), bufs.pop("out", None)
            self._slots.append(Slot(bufs, grad, None if out is None else out.view(cdt)))

    def begin_step(self, grad_scale):
        if not self._in_step:   # a truncated file fails the step before any state changes
            self.files.check_sizes()
        return super().begin_step(grad_scale)

    def settle(self) -> None:
        super().settle()
        self._prefetched = None

    def whole_store(self) -> WholeSwap:
        """The owners' whole matrices in files ([Note: whole matrices on NVMe])."""
        return WholeSwap(self.files, self.copier)

    def update_order(self, units: Sequence) -> list:
        """Index order: unit i+1's first sub-group is read while unit i updates."""
        return list(units)

    def adopt(self, num_units: int) -> None:
        """Resuming: every unit's files checked out; the kept folder is this run's.

        Raises:
            OffloadIOError: another layout.
        """
        self.files.adopt(num_units)

    def _read_into(self, slot: Slot, rec: ShardState, lo: int, hi: int) -> None:
        slot.busy = [self.files.read(rec, k, slot.states[k], *_file_range(rec, k, lo, hi))
                     for k in self.files.kinds_of(rec)]

    def _typed(self, slot: Slot, rec: ShardState, lo: int, hi: int) -> Dict[str, torch.Tensor]:
        """The slot's buffers as ``rec``'s files' elements ``[lo, hi)`` (from element 0)."""
        out = {}
        for k in self.files.kinds_of(rec):
            a, b = _file_range(rec, k, lo, hi)
            dt = self.files.file_spec(rec, k)[1]
            out[k] = slot.states[k][:(b - a) * dt.itemsize].view(dt)
        return out

    def pieces(self, rec: ShardState, grad: torch.Tensor,
               staged: bool) -> Iterator[Tuple[int, int, Piece]]:
        """Sub-groups of a state in files, through the slots: the next sub-group (or the next
        unit's first) is read while this one updates, and each is written back once
        updated."""
        ranges = self.ranges(rec.numel)
        if self._prefetched is not None and self._prefetched[0] is rec:
            slot = self._prefetched[1]
        else:
            slot = self._take_slot()
            self._read_into(slot, rec, *ranges[0])
        self._prefetched = None
        lo0, hi0 = ranges[0]
        slot.busy.append(self.copier.to_host(slot.grad[:hi0 - lo0], grad[lo0:hi0]))
        for j, (lo, hi) in enumerate(ranges):
            nxt = None
            if j + 1 < len(ranges):
                nxt = self._take_slot()
                a, b = ranges[j + 1]
                self._read_into(nxt, rec, a, b)
                nxt.busy.append(self.copier.to_host(nxt.grad[:b - a], grad[a:b]))
            elif rec.unit_index + 1 < len(self._records) and \
                    self._records[rec.unit_index + 1].rule is None:   # (a rule reads its own)
                following = self._records[rec.unit_index + 1]
                nxt = self._take_slot()
                self._read_into(nxt, following, *self.ranges(following.numel)[0])
                self._prefetched = (following, nxt)
            self._exposed_s += slot.settle()
            k = hi - lo
            typed = self._typed(slot, rec, lo, hi)
            master = typed["master"] if "master" in typed else rec.master[lo:hi]
            whole = slot.states["master"].view(torch.float32) if "master" in typed else None
            yield lo, hi, Piece(master, slot.grad[:k], typed["exp_avg"], typed["exp_avg_sq"],
                                None if slot.out is None else slot.out[:k], slot.busy,
                                whole if slot.out is None else slot.out,
                                exp_avg_scales=typed.get("exp_avg_scales"),
                                exp_avg_sq_scales=typed.get("exp_avg_sq_scales"))
            slot.busy.extend(self.files.write(rec, kd, slot.states[kd],
                                              *_file_range(rec, kd, lo, hi))
                             for kd in self.files.kinds_of(rec))
            if nxt is not None and self._prefetched is None:
                slot = nxt

    def _figures(self, c: dict, exposed: float) -> dict:
        """I/O thread seconds the step did not wait for (ran beside the CPU AdamW)."""
        io = self.files.io.take_counters()
        return dict(io_exposed_s=exposed, disk_io_hidden_s=max(0.0, io["disk_io_s"] - exposed),
                    **io, sub_group_numel=self.sub_group_numel, direct_io=self.files.direct_io)

    def _grad_shards(self) -> list:
        return []   # (the gradient shards stay on the device)

    def fill(self, rec: ShardState, src: Dict[str, Optional[torch.Tensor]],
             kinds: Optional[Sequence[str]] = None) -> None:
        """Write ``rec``'s files (``kinds``: those only) from tensors in the files' formats
        (absent or None: zeros), synchronously, through the first slot (a load, not a step's
        traffic)."""
        slot = self._slots[0]
        slot.settle()
        kinds = self.files.kinds_of(rec) if kinds is None else kinds
        for lo, hi in self.ranges(rec.numel):
            futs = []
            typed = self._typed(slot, rec, lo, hi)
            for k in kinds:
                a, b = _file_range(rec, k, lo, hi)
                slot.states[k].zero_()
                if src.get(k) is not None:
                    self.copier.copy_untracked(typed[k], src[k][a:b]).synchronize()
                futs.append(self.files.write(rec, k, slot.states[k], a, b, counted=False))
            for f in futs:
                f.result()

    def materialize(self, rec: ShardState, kind: str, t: torch.Tensor) -> torch.Tensor:
        """A new CPU tensor read from ``kind``'s file where ``t`` is a meta tensor."""
        if not t.is_meta:
            return t
        self.settle()
        return self.files.read_all(rec, kind)

    def disk_bytes(self) -> Dict[str, int]:
        """Bytes of files held by kind (the parameter shards' too where they are on disk),
        measured from the files."""
        return {**self.files.disk_bytes(), "params": self.params.disk_bytes()}

    def close(self, states: Sequence[ShardState], specs, keep_files: bool) -> Optional[str]:
        """See :meth:`UpdateEngine.close`; the kept folder, or None."""
        if keep_files and self.where["master"] != "disk":
            raise ValueError("close(keep_files=True) needs OffloadConfig(nvme_master=True): "
                             "the master is in host RAM and would not survive")
        if keep_files and any(isinstance(r.rule, MatrixUnitRule) for r in states):
            raise ValueError("close(keep_files=True) cannot keep a whole-matrix class's run "
                             "(Muon, Adafactor): its units' shard masters live in host RAM "
                             "([Note: whole matrices on NVMe]), not in the folder; save a "
                             "checkpoint (zk.checkpoint.save) instead")
        rules = None
        if keep_files and not self.closed:   # (a rule's RAM state, before anything closes)
            self.settle()
            rules = {r.unit_index: r.rule.kept(specs[r.unit.group_index].name)
                     for r in states if isinstance(r.rule, SwappedRule)}
        super().close(states, specs, False)
        return self.files.close([r.step for r in states] if keep_files else None, rules)
