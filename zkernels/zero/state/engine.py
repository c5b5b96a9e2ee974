"""The update engine: one AdamW sub-group loop over per-unit state records, parametrized by
where the master, the moments and the updated parameters live.

See [Note: parameters and state] in ``units.py``. A placement (``"device"``, ``"cpu"``,
``"nvme"``, chosen once by ``placement.make_engine`` from ``offload=``) says where each kind
lives: the device (no offload), host RAM (CPU offload) or files streamed through host slots
(NVMe offload; the master too with ``nvme_master``). The engine allocates each unit's
:class:`~zkernels.zero.state.shard_state.ShardState` there, walks its shard in sub-groups,
runs one fused AdamW per sub-group where the state is (the device's OpSet, or the host's: the
native CPU AdamW where built) and writes the updated parameters into the unit's compute shard
(directly where it lives beside the step, else by a copy off the compute stream). The engine
also names the update order it wants (NVMe streams units in index order), the gradient sink
it fills (CPU offload) and the OpSet of the gradient shards (clipping's sum of squares).

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
With ``offload_params=True`` (stage 3) the parameter shards live in host RAM
(``param_offload.py``, [Note: parameter offload]); the step then writes the host shard in
place (no staging, nothing sent in ``step()``), and in pure fp32 the master is the shard.
With NVMe offload they live in files instead (``param_nvme.py``, [Note: parameters on
NVMe]): each sub-group's output goes from its slot to the unit's file (in pure fp32 the
slot's master, or, with a host master, an aligned copy in the slot), and sub-groups span
whole 4096-byte blocks of the file, so the smallest budget for bf16 parameters doubles.

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
and go at :meth:`UpdateEngine.close` unless ``close(keep_files=True)`` keeps them.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field, replace
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ...ops import OpSet
from ...ops.adamw import Scalar
from ..planning.state_format import block_align, slot_moments
from ..planning.offload_config import (NUM_NVME_BUFFERS, OffloadConfig, nvme_slot_views,
                                       nvme_sub_group_align, nvme_sub_group_numel)
from ..parameters.storage import DeviceStorage
from ..parameters.units import FlatParamUnit
from .bf16_master import on_bf16_master
from .grad_sink import GradShards
from .nvme_files import SCALE_KINDS, NvmeFiles
from .live_ranges import clip, live_segments
from .lowbit_state import alloc_moments, dequantized, quantized, step_range
from .shard_state import ShardState
from .swap import aligned_empty
from .fused_rule import FusedShardRule
from .matrix_rule import MatrixUnitRule, MatrixUpdate
from .rule_swap import SwappedRule
from .torch_rule import TorchShardRule
from .transfer import Copier

KINDS = ("master", "exp_avg", "exp_avg_sq")


def adamw_hparams(group: dict, step: int, grad_scale: Optional[Scalar]) -> dict:
    """The AdamW keywords of a param group, read at each step (schedulers apply next step)."""
    beta1, beta2 = group["betas"]
    return dict(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
                eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                step=step, grad_scale=grad_scale)


def host_scalar(grad_scale: Optional[Scalar]) -> Optional[float]:
    """``grad_scale`` as a host number (a device tensor is read once: one sync per step)."""
    return float(grad_scale.item()) if isinstance(grad_scale, torch.Tensor) else grad_scale


@dataclass
class _Slot:
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
class _Piece:
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


def _adamw(ops: OpSet, p: _Piece, a: int, b: int, out: Optional[torch.Tensor], fmt,
           hparams: dict) -> None:
    """One fused AdamW over ``[a, b)`` of a piece: fp32 moments, or ``fmt``'s low-bit ones;
    a bf16 master through an fp32 copy ([Note: bf16 master] in bf16_master.py)."""
    if p.master.dtype == torch.bfloat16 and fmt is not None:   # (the low-bit kernels take
        if out is not None and out.data_ptr() == p.master[a:b].data_ptr():   # a bf16 master)
            out = None
    elif p.master.dtype == torch.bfloat16:
        sub = _sub_piece(p, a, b, fmt)
        on_bf16_master(p.master[a:b], out, lambda wide, o: _adamw(
            ops, replace(sub, master=wide), 0, b - a, o, fmt, hparams))
        return
    if fmt is None:
        ops.adamw_step(p.master[a:b], p.grad[a:b], p.exp_avg[a:b], p.exp_avg_sq[a:b], out=out,
                       **hparams)
    else:
        step_range(ops, fmt, p.master, p.grad, p.exp_avg, p.exp_avg_sq, p.exp_avg_scales,
                   p.exp_avg_sq_scales, a, b, out, hparams)


def _sub_piece(p: _Piece, a: int, b: int, fmt) -> _Piece:
    """``[a, b)`` of a piece as a piece from element 0 (``a`` starts a quantization block)."""
    bs = fmt.block_size if fmt is not None and fmt.blocked else 0
    if bs and a % bs:
        raise RuntimeError(f"internal: a low-bit AdamW range starts at {a}, not at a multiple "
                           f"of state_block_size={bs} ([Note: low-bit state in shards])")
    return _Piece(p.master[a:b], p.grad[a:b], p.exp_avg[a:b], p.exp_avg_sq[a:b], None, p.busy,
                  exp_avg_scales=p.exp_avg_scales[a // bs:] if bs else None,
                  exp_avg_sq_scales=p.exp_avg_sq_scales[a // bs:] if bs else None)


def _file_range(rec: ShardState, kind: str, lo: int, hi: int) -> Tuple[int, int]:
    """Elements ``[lo, hi)`` of ``rec``'s shard in the file of ``kind``: the same, or a scale
    file's blocks (``lo`` starts a block: [Note: low-bit state on NVMe] in nvme_files.py)."""
    if kind not in SCALE_KINDS:
        return lo, hi
    bs = rec.fmt.block_size
    return lo // bs, -(-hi // bs)


def _update_segments(ops: OpSet, p: _Piece, out: Optional[torch.Tensor], direct: bool,
                     segments, group: dict, scale, fmt=None) -> None:
    """One AdamW per live segment of a piece; a staged output (it travels whole) holds the
    unchanged master's values outside them."""
    if out is not None and not direct:
        out.copy_(p.master)
    for a, b, step in segments:
        _adamw(ops, p, a, b, None if out is None else out[a:b], fmt,
               adamw_hparams(group, step, scale))


class UpdateEngine:
    """Owns every unit's :class:`ShardState` and applies one AdamW step per unit shard (see
    the module's Notes).

    Args:
        placement: "device", "cpu" or "nvme".
        ops: the optimizer's (device) OpSet.
        host_ops: a CPU OpSet (offload: the host step), else None.
        copier: offload: the :class:`Copier` of host<->device copies, else None.
        config: the :class:`OffloadConfig` (offload).
        files: NVMe: the :class:`~zkernels.zero.state.nvme_files.NvmeFiles`, else None.
        storages: the storage objects by where ("device", "host") that allocate the state
            kinds kept in memory, and ``"params"``: the one the parameter shards live in (the
            same object with ``offload_params``: [Note: shard storage] in
            ``parameters/storage.py``), whose figures the step reports. Each unit's shard is
            asked where its bytes are; the engine reads no flag.
        specs: each param group's :class:`~zkernels.zero.planning.optimizer_spec.OptimizerSpec`
            by group index (empty: every group the fused AdamW); a torch class's units step
            through a :class:`~zkernels.zero.state.torch_rule.TorchShardRule` ([Note:
            torch.optim on pieces]).
        formats: each param group's low-bit
            :class:`~zkernels.zero.planning.state_format.StateFormat` or None (fp32 moments),
            by group index (empty: fp32 everywhere); see [Note: low-bit state in shards].

    Attributes:
        placement: where the state lives ("device", "cpu", "nvme"): the one place that knows.
        states: one :class:`ShardState` per unit, by unit index.
        grad_sink: CPU offload's host :class:`GradShards` (the gradient strategy fills it),
            else None (the strategy keeps its own shards on the device).
        grad_ops: the OpSet of the gradient shards ``update`` receives.
        last_step: transfer figures of the last step (offload), for ``stats()``.
        resumed: NVMe: the files of a kept run were adopted (the optimizer re-gathers).
        sub_group_numel: elements per AdamW call (offload; the NVMe arena's slot size).
    """

    def __init__(self, placement: str, *, ops: OpSet, host_ops: Optional[OpSet] = None,
                 copier: Optional[Copier] = None, config: Optional[OffloadConfig] = None,
                 files: Optional[NvmeFiles] = None, storages: Optional[dict] = None,
                 specs: Sequence = (), formats: Sequence = (),
                 master_dtype: Optional[torch.dtype] = None) -> None:
        self.placement = placement
        # the fused AdamW's master: fp32, or bf16 ([Note: bf16 master] in bf16_master.py)
        self.master_dtype = master_dtype or torch.float32
        self.specs = list(specs)
        self.formats = list(formats)
        self.block_align = block_align(self.formats)   # the layout's alignment (build.py)
        # The NVMe slots' moment width and scales: the fused-AdamW groups' widest format
        # ([Note: low-bit state on NVMe] in nvme_files.py).
        self.slot_moments = slot_moments([self.format_of_group(g) for g in range(
            max(len(self.specs), len(self.formats), 1)) if self._is_adamw(g)])

        self.on_host = placement != "device"          # the step runs on the host
        self.step_ops = host_ops if self.on_host else ops
        self.host_ops, self.copier, self.config = host_ops, copier, config
        self.files = files
        self.storages = storages or {"device": DeviceStorage()}
        self.param_storage = self.storages.get("params", self.storages["device"])
        self.step_at = "host" if self.on_host else "device"   # where the update runs
        # Where each kind lives: "device", "host" or "disk" (the files' kinds).
        disk = files.kinds if files is not None else ()
        self.where = {k: "disk" if k in disk else "host" if self.on_host else "device"
                      for k in KINDS}
        self.grad_sink = GradShards(copier=copier) if placement == "cpu" else None
        self.grad_ops = host_ops if self.grad_sink is not None else ops
        self.resumed = files is not None and files.resumed
        self.states: List[ShardState] = []
        # Whole-matrix classes' owners and exchanges ([Note: whole matrices on owners]).
        self.matrix: Optional[MatrixUpdate] = None
        self.sub_group_numel = config.sub_group_numel if placement == "cpu" else 0
        self._slots: List[_Slot] = []
        self._largest_shard = 0
        self._buffers: List[torch.Tensor] = []   # the host memory behind the slots
        self._next_slot = 0
        self._prefetched: Optional[Tuple[ShardState, _Slot]] = None
        self._in_step = False
        self._host_scale: Optional[float] = None
        self._update_s = self._exposed_s = 0.0
        self.last_step: Dict[str, float] = {}
        self._closed = False
        self._finalizer = weakref.finalize(self, Copier.close, copier) if copier else None

    # -- construction -------------------------------------------------------------------

    def init_state(self, unit: FlatParamUnit, initial_master: torch.Tensor) -> ShardState:
        """Allocate ``unit``'s record where the placement keeps it, from its fp32 shard values
        (``build_*_unit``'s second result); units come in index order. NVMe: create (or,
        resuming, open and check) the unit's files and write the initial state."""
        if unit.index != len(self.states):
            raise ValueError(f"init_state: unit {unit.index} out of order (expected "
                             f"{len(self.states)})")
        n = unit.layout.shard_numel
        spec = self.specs[unit.group_index] if self.specs else None
        mdt = self.master_dtype
        if mdt != torch.float32:   # [Note: bf16 master]
            self._check_bf16_master(unit, spec)
        if unit.shard.holds(self.where["master"]) and unit.compute_dtype == mdt:
            master = unit.compute_shard   # the parameter shard is its own master
        else:
            master = self._alloc(n, "master", unit.device, mdt)
            if not master.is_meta:
                master.copy_(initial_master)   # (bf16: rounded to nearest even)
        if spec is not None and spec.matrix:   # whole matrices on owners (matrix_rule.py)
            if master.is_meta:   # (the shard master stays in RAM: [Note: whole matrices on NVMe])
                master = self.copier.host_empty(n, torch.float32).copy_(initial_master)
            none = master.new_empty(0)
            rec = ShardState(unit, master, none, none)
            if self.matrix is None:
                self.matrix = MatrixUpdate(unit.rank, unit.layout.world_size, self.specs,
                                           self.files, self.copier)
            self.matrix.add_unit(rec)
            rec.rule = MatrixUnitRule(self.matrix, unit.index)
        elif spec is not None and spec.kernel is not None:   # fused Lion / SGD (fused_rule)
            none = master.new_empty(0)
            rec = ShardState(unit, master, none, none)
            rec.rule = FusedShardRule(spec, master, [(s, k) for _, _, s, k in
                                                     unit.param_slices_in_shard()],
                                      self.step_ops)
        elif spec is not None and not spec.fused:   # the class allocates its own state
            none = master.new_empty(0)
            rec = ShardState(unit, master, none, none)
            rec.rule = TorchShardRule(spec, master, [(s, k) for _, _, s, k in
                                                     unit.param_slices_in_shard()])
        elif self.format_of(unit) is not None:
            fmt = self.format_of(unit)
            m, v, sm, sv = alloc_moments(n, fmt, lambda k, dt: self._alloc(
                k, "exp_avg", unit.device, dt))
            rec = ShardState(unit, master, m, v, fmt=fmt, exp_avg_scales=sm,
                             exp_avg_sq_scales=sv)
        else:
            rec = ShardState(unit, master, self._alloc(n, "exp_avg", unit.device),
                             self._alloc(n, "exp_avg_sq", unit.device))
        if self.grad_sink is not None:
            rec.grad = self.grad_sink.add(n, torch.device("cpu"))
        on_files = self.files is not None and rec.rule is not None   # (its own files)
        swapped = on_files and not isinstance(rec.rule, MatrixUnitRule)
        if swapped:   # the rule's state in files, in RAM for its step ([Note: rule state on NVMe])
            rec.rule = SwappedRule(rec.rule, self.files, unit.index, n, self.copier,
                                   master_on_disk=master.is_meta)
            if self.files.resumed:   # a kept folder: its files, its steps, its master
                rec.rule.adopt(self.files.rule_info(unit.index, spec.name))
                rec.set_step(self.files.kept_step(unit.index))
                self._write_compute(unit, rec.rule.master_copy())
            elif master.is_meta:
                rec.rule.write_master(initial_master)
        elif not on_files:
            self._ensure_slots(n, unit)
        self.states.append(rec)
        if self.files is not None and not on_files:
            # (a kept run's unit count; each parameter resumes at it: the run folder's
            # manifest keeps one count per unit)
            rec.set_step(self.files.open(rec))
            if self.files.resumed:
                self._write_compute(unit, self.files.read_all(rec, "master"))
            else:
                self._fill(rec, {"master": initial_master})
        return rec

    def _check_bf16_master(self, unit: FlatParamUnit, spec) -> None:
        """A bf16 master needs the fused AdamW and bf16 parameters (named otherwise)."""
        if spec is not None and not self._is_adamw(unit.group_index):
            raise ValueError(f"master_dtype=torch.bfloat16 applies to the fused AdamW only; "
                             f"param_groups[{unit.group_index}] runs {spec.name}, whose master "
                             f"stays fp32 ([Note: bf16 master])")
        if unit.compute_dtype != torch.bfloat16:
            raise ValueError(f"master_dtype=torch.bfloat16 needs bf16 parameters "
                             f"(param_dtype=torch.bfloat16 or a bf16 model); unit "
                             f"{unit.index} computes in {unit.compute_dtype}")

    def format_of(self, unit: FlatParamUnit):
        """The unit's group's low-bit state format, or None (fp32 moments)."""
        return self.format_of_group(unit.group_index)

    def format_of_group(self, group_index: int):
        return self.formats[group_index] if group_index < len(self.formats) else None

    def _is_adamw(self, group_index: int) -> bool:
        """The group runs the fused AdamW (no rule: ``init_state``'s last branches)."""
        spec = self.specs[group_index] if group_index < len(self.specs) else None
        return spec is None or spec.fused and spec.kernel is None and not spec.matrix

    def _alloc(self, n: int, kind: str, device: torch.device,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        where = self.where[kind]
        if where == "disk":   # (the files are nvme_files.py's)
            return torch.empty(n, dtype=dtype, device="meta")
        return self.storages[where].empty(n, dtype, device)

    def _ensure_slots(self, n: int, unit: FlatParamUnit) -> None:
        """Host slots big enough for ``unit``: CPU offload's two output staging slots (mixed
        precision, shard on the device), NVMe's arena (sized to need, capped by the budget)."""
        cdt = unit.compute_dtype
        if self.placement == "cpu":
            need = min(n, self.sub_group_numel)
            if cdt == torch.float32 or unit.shard.holds("host") or self._slots and \
                    self._slots[0].out.numel() >= need and self._slots[0].out.dtype == cdt:
                return
            self._release_buffers()   # (unpinned: the larger ones replace them)
            self._buffers = [self.copier.host_empty(need, cdt) for _ in range(2)]
            self._slots = [_Slot(out=b) for b in self._buffers]
        elif self.placement == "nvme":
            # fp32: the copy (or a parameter file's write, param_nvme.py) reads the master in
            # its slot; a host master is not aligned, so the output is staged in the slot.
            # With a parameter file a sub-group starts at an aligned byte of it too.
            kinds = self.files.kinds
            on_disk = unit.shard.in_file
            cb = 0 if cdt == torch.float32 and ("master" in kinds or not on_disk) \
                else cdt.itemsize
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
            self._settle_all()
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
                self._slots.append(_Slot(bufs, grad, None if out is None else out.view(cdt)))

    def _release_buffers(self) -> None:
        for b in self._buffers:
            self.copier.unpin(b)
        self._buffers, self._slots, self._next_slot = [], [], 0

    def adopt(self, num_units: int) -> None:
        """Resuming (NVMe): every unit's files checked out; the kept folder is this run's.

        Raises:
            RuntimeError: this placement resumes nothing. OffloadIOError: another layout.
        """
        if self.files is None:
            raise RuntimeError(f"placement {self.placement!r} does not resume kept state")
        self.files.adopt(num_units)

    # -- the step -----------------------------------------------------------------------

    def update_order(self, units: Sequence[FlatParamUnit]) -> List[FlatParamUnit]:
        """The order ``update`` wants the units in: forward order (units are in backward
        order), so the gathers land as the next forward needs them ([Note: lazy parameter
        gathers] in param_wait.py); NVMe streams states in index order (it prefetches unit
        i+1 while unit i updates)."""
        return list(units) if self.files is not None else list(reversed(units))

    def update(self, unit: FlatParamUnit, grad: torch.Tensor, group: dict,
               grad_scale: Optional[Scalar], live: Optional[Sequence[bool]] = None) -> None:
        """Apply one AdamW step to ``unit``'s state and write its compute shard.

        Args:
            unit: its ``compute_shard`` receives the updated parameters.
            grad: [shard_numel] reduced gradient (the device's, or CPU offload's host shard),
                to be divided by ``grad_scale``.
            group: the unit's param group (lr, betas, eps, weight_decay read now).
            grad_scale: None, float or 1-element fp32 tensor (1/N, loss scale, clipping).
            live: a flag per parameter of the unit (it has a gradient this step), or None
                (all have one): only the live parameters' ranges update, each with its own
                step count ([Note: unused parameters] in ``gradients/presence.py``).
        """
        t0 = time.perf_counter()
        if self._closed:
            raise RuntimeError("this ZeroOptimizer was closed (close()): its offloaded state "
                               "is gone, build a new optimizer to train on")
        if self.on_host and not self._in_step:   # the step's first unit
            if self.files is not None:
                self.files.check_sizes()
            self._host_scale = host_scalar(grad_scale)   # one read (sync) per step
        self._in_step = True
        rec = self.states[unit.index]
        rec.step += 1
        scale = self._host_scale if self.on_host else grad_scale
        if rec.rule is not None:   # a torch.optim class on the pieces
            # (a piece of a parameter without a gradient gets .grad None: the class skips it)
            flags = None if live is None else [
                live[i] for i, _, _, _ in unit.layout.tensor_slices_in_shard(unit.rank)]
            if isinstance(rec.rule, SwappedRule):   # (its master may be in RAM only now)
                rec.rule.step(grad, group, scale, flags,
                              publish=lambda m: self._publish_rule(unit, m))
            else:
                rec.rule.step(grad, group, scale, flags)
                self._publish_rule(unit, rec.master)
            self._update_s += time.perf_counter() - t0
            return
        segments, whole = live_segments(
            ((i, s, n) for i, _, s, n in unit.layout.tensor_slices_in_shard(unit.rank)),
            rec.numel, rec.param_steps, live)
        mixed = unit.compute_dtype != torch.float32
        # The compute shard lives beside the step: the AdamW writes it in place; or in a file
        # (parameters on NVMe): each sub-group's output goes from its slot to the file.
        to_file = unit.shard.in_file
        direct = unit.shard.holds(self.step_at)
        if direct:
            unit.shard.settle()   # no copy still reads the shard written now
        shard, last = unit.compute_shard, None
        pieces = self._streamed(rec, grad) if self.files is not None else \
            self._resident(rec, grad, staged=mixed and not direct)
        for lo, hi, p in pieces:
            out = (shard[lo:hi] if direct else p.out) if mixed else None
            if whole:
                _adamw(self.step_ops, p, 0, hi - lo, out, rec.fmt,
                       adamw_hparams(group, segments[0][2], scale))
            else:
                _update_segments(self.step_ops, p, out, direct, clip(segments, lo, hi), group,
                                 scale, rec.fmt)
            if to_file:
                if not mixed and p.out is not None:   # (a host master: staged aligned)
                    p.out.copy_(p.master)
                p.busy.append(unit.shard.write_range(p.slot_out, lo, hi))
            elif not direct:
                last = self.copier.to_device(shard[lo:hi], out if mixed else p.master)
                p.busy.append(last)
            elif not mixed and p.master.data_ptr() != shard[lo:hi].data_ptr():
                shard[lo:hi].copy_(p.master)
        if last is not None:
            last.wait()  # the gather (publish) reads the compute shard after the copy
        self._update_s += time.perf_counter() - t0

    def _publish_rule(self, unit: FlatParamUnit, master: torch.Tensor) -> None:
        """A rule's unit: its compute shard from the updated fp32 master."""
        shard = unit.compute_shard
        if self.on_host and unit.shard.holds("device"):
            # the device's shard from the host master: one counted copy up, as AdamW's
            src = master if shard.dtype == torch.float32 else \
                self.host_ops.cast(master.contiguous(), shard.dtype)
            self.copier.to_device(shard, src).wait()
        else:
            self._write_compute(unit, master)

    def _ranges(self, n: int, align: int = 1) -> List[Tuple[int, int]]:
        """Sub-groups of ``n`` elements, each starting at a multiple of ``align`` (a low-bit
        state's block size: a sub-group never splits a block)."""
        sub = self.sub_group_numel or max(n, 1)
        sub = max(sub // align * align, align)
        return [(lo, min(n, lo + sub)) for lo in range(0, n, sub)]

    def _take_slot(self) -> _Slot:
        slot = self._slots[self._next_slot]
        self._next_slot = (self._next_slot + 1) % len(self._slots)
        self._exposed_s += slot.settle()
        return slot

    def _resident(self, rec: ShardState, grad: torch.Tensor,
                  staged: bool) -> Iterator[Tuple[int, int, _Piece]]:
        """Sub-groups of a state held in memory (device or host RAM): views, and an output
        staging slot when the result must travel."""
        bs = rec.fmt.block_size if rec.fmt is not None and rec.fmt.blocked else 1
        for lo, hi in self._ranges(rec.numel, bs):
            slot = self._take_slot() if staged else _Slot()
            blocks = slice(lo // bs, -(-hi // bs))
            yield lo, hi, _Piece(rec.master[lo:hi], grad[lo:hi], rec.exp_avg[lo:hi],
                                 rec.exp_avg_sq[lo:hi],
                                 None if slot.out is None else slot.out[:hi - lo], slot.busy,
                                 exp_avg_scales=None if bs == 1 else rec.exp_avg_scales[blocks],
                                 exp_avg_sq_scales=None if bs == 1 else
                                 rec.exp_avg_sq_scales[blocks])

    def _read_into(self, slot: _Slot, rec: ShardState, lo: int, hi: int) -> None:
        slot.busy = [self.files.read(rec, k, slot.states[k], *_file_range(rec, k, lo, hi))
                     for k in self.files.kinds_of(rec)]

    def _typed(self, slot: _Slot, rec: ShardState, lo: int, hi: int) -> Dict[str, torch.Tensor]:
        """The slot's buffers as ``rec``'s files' elements ``[lo, hi)`` (from element 0)."""
        out = {}
        for k in self.files.kinds_of(rec):
            a, b = _file_range(rec, k, lo, hi)
            dt = self.files.file_spec(rec, k)[1]
            out[k] = slot.states[k][:(b - a) * dt.itemsize].view(dt)
        return out

    def _streamed(self, rec: ShardState, grad: torch.Tensor) -> Iterator[Tuple[int, int, _Piece]]:
        """Sub-groups of a state in files, through the slots (see [Note: NVMe offload step]):
        the next sub-group (or the next unit's first) is read while this one updates, and each
        is written back once updated."""
        ranges = self._ranges(rec.numel)
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
            elif rec.unit_index + 1 < len(self.states) and \
                    self.states[rec.unit_index + 1].rule is None:   # (a rule reads its own)
                following = self.states[rec.unit_index + 1]
                nxt = self._take_slot()
                self._read_into(nxt, following, *self._ranges(following.numel)[0])
                self._prefetched = (following, nxt)
            self._exposed_s += slot.settle()
            k = hi - lo
            typed = self._typed(slot, rec, lo, hi)
            master = typed["master"] if "master" in typed else rec.master[lo:hi]
            whole = slot.states["master"].view(torch.float32) if "master" in typed else None
            yield lo, hi, _Piece(master, slot.grad[:k], typed["exp_avg"], typed["exp_avg_sq"],
                                 None if slot.out is None else slot.out[:k], slot.busy,
                                 whole if slot.out is None else slot.out,
                                 exp_avg_scales=typed.get("exp_avg_scales"),
                                 exp_avg_sq_scales=typed.get("exp_avg_sq_scales"))
            slot.busy.extend(self.files.write(rec, kd, slot.states[kd],
                                              *_file_range(rec, kd, lo, hi))
                             for kd in self.files.kinds_of(rec))
            if nxt is not None and self._prefetched is None:
                slot = nxt

    def finish_step(self) -> None:
        """After every unit's update: every write and copy of the step finished; the step's
        transfer figures go into :attr:`last_step`."""
        if not self.on_host:
            return
        t0 = time.perf_counter()
        self._settle_all()
        c = self.copier.take_counters()
        params = self.param_storage.take_counters()
        io = self.files.io.take_counters() if self.files is not None else None
        tail = time.perf_counter() - t0
        exposed = self._exposed_s + tail
        out = {"update_s": self._update_s + tail,
               "host_to_device_bytes": c["to_device_bytes"],
               "device_to_host_bytes": c["to_host_bytes"],
               "host_to_device_s": c["to_device_busy_s"],
               "device_to_host_s": c["to_host_busy_s"]}
        if io is None:
            busy, waited = c["to_host_busy_s"], self.grad_sink.exposed_s
            out.update(device_to_host_exposed_s=min(waited, busy),
                       device_to_host_hidden_s=max(0.0, busy - waited),
                       host_to_device_exposed_s=exposed, disk_read_bytes=0,
                       disk_write_bytes=0)
            self.grad_sink.exposed_s = 0.0
        else:   # I/O thread seconds the step did not wait for (ran beside the CPU AdamW)
            out.update(io_exposed_s=exposed,
                       disk_io_hidden_s=max(0.0, io["disk_io_s"] - exposed), **io,
                       sub_group_numel=self.sub_group_numel, direct_io=self.files.direct_io)
        self.last_step = {**out, **params}
        self._update_s = self._exposed_s = 0.0
        self._in_step = False

    def _settle_all(self) -> None:
        for s in self._slots:
            s.settle()
        self._prefetched = None

    # -- state in and out ---------------------------------------------------------------

    def _fill(self, rec: ShardState, src: Dict[str, Optional[torch.Tensor]],
              kinds: Optional[Sequence[str]] = None) -> None:
        """Write ``rec``'s files (``kinds``: those only) from tensors in the files' formats
        (absent or None: zeros), synchronously, through the first slot (a load, not a step's
        traffic)."""
        slot = self._slots[0]
        slot.settle()
        kinds = self.files.kinds_of(rec) if kinds is None else kinds
        for lo, hi in self._ranges(rec.numel):
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

    def _write_compute(self, unit: FlatParamUnit, master: torch.Tensor) -> None:
        """The unit's compute shard from an fp32 master (a load: not a step's traffic)."""
        if unit.shard.in_file:
            unit.shard.load_values(master)
            return
        shard = unit.compute_shard
        if master.data_ptr() == shard.data_ptr():
            return   # fp32 (or a bf16 master): the master is the shard
        here = unit.shard.holds(self.step_at)
        if master.dtype == shard.dtype != torch.float32:   # a bf16 master apart from it
            if here:
                unit.shard.settle()
                shard.copy_(master)
            else:
                self.copier.copy_untracked(shard, master).synchronize()
            return
        if here:
            unit.shard.settle()
            self.step_ops.cast(master.contiguous(), out=shard) \
                if shard.dtype != torch.float32 else shard.copy_(master)
            return
        src = master if shard.dtype == torch.float32 else \
            self.host_ops.cast(master.contiguous(), shard.dtype)
        self.copier.copy_untracked(shard, src).synchronize()

    def state_tensors(self, unit_index: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(master, exp_avg, exp_avg_sq)`` of a unit: the live tensors where they are in
        memory, new CPU tensors read from the files where they are on disk."""
        self._settle_all()
        rec = self.states[unit_index]
        if isinstance(rec.rule, SwappedRule):   # (its master in RAM or in its own file)
            return rec.rule.master_copy(), rec.exp_avg, rec.exp_avg_sq
        out = self._state_tensors(rec)
        if out[0].dtype == torch.bfloat16:   # (a bf16 master: its exact fp32 values)
            return (out[0].float(),) + tuple(out[1:])
        return out

    def _state_tensors(self, rec: ShardState):
        """:meth:`state_tensors` of a record (its master as it is)."""
        unit_index = rec.unit_index
        if rec.fmt is not None:   # low-bit moments: their fp32 values (new tensors)
            low = self.lowbit_tensors(unit_index)
            master = self.files.read_all(rec, "master") if rec.master.is_meta else rec.master
            return (master,) + dequantized(rec.fmt, low["exp_avg"], low["exp_avg_sq"],
                                           low.get("exp_avg_scales"),
                                           low.get("exp_avg_sq_scales"))
        return tuple(self.files.read_all(rec, k) if t.is_meta else t
                     for k, t in zip(KINDS, rec.tensors()))

    def load_state(self, unit: FlatParamUnit, step: int, master: torch.Tensor,
                   exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   param_steps: Optional[Sequence[int]] = None) -> None:
        """Overwrite ``unit``'s state (tensors, files) and rebuild its compute shard
        (``param_steps`` None: every parameter's count is ``step``)."""
        self._settle_all()
        rec = self.states[unit.index]
        rec.set_step(step, param_steps)
        if rec.rule is not None:   # a whole-matrix owner re-reads its master at the next step
            rec.rule.master_written()
        src = dict(zip(KINDS, (master, exp_avg, exp_avg_sq)))
        if rec.fmt is not None:   # fp32 moments into low-bit state: requantized
            at = "cpu" if rec.exp_avg.is_meta else rec.exp_avg.device   # (NVMe: in files)
            src.update(quantized(rec.fmt, exp_avg.to(at), exp_avg_sq.to(at)))
            for k, t in (("exp_avg_scales", rec.exp_avg_scales),
                         ("exp_avg_sq_scales", rec.exp_avg_sq_scales)):
                if t is not None and not t.is_meta:
                    t.copy_(src[k])
        for k, t in zip(KINDS, rec.tensors()):
            if not t.is_meta:
                t.copy_(src[k])
        if isinstance(rec.rule, SwappedRule):   # (a model.load_state_dict: the master only)
            if rec.master.is_meta:
                rec.rule.write_master(master.to("cpu", torch.float32))
        elif self.files is not None and rec.rule is None:
            self._fill(rec, src)
        self._write_compute(unit, master.to("cpu", torch.float32) if rec.master.is_meta
                            else rec.master)

    def lowbit_tensors(self, unit_index: int) -> Optional[Dict[str, torch.Tensor]]:
        """A low-bit unit's live moments as trained (``exp_avg``, ``exp_avg_sq`` and, int8,
        ``exp_avg_scales``, ``exp_avg_sq_scales``), or None where its moments are fp32."""
        rec = self.states[unit_index]
        out = self._lowbit_live(rec)
        if out is not None and rec.exp_avg.is_meta:   # NVMe: new tensors read from the files
            self._settle_all()
            out = {k: self.files.read_all(rec, k) for k in out}
        return out

    @staticmethod
    def _lowbit_live(rec: ShardState) -> Optional[Dict[str, torch.Tensor]]:
        """A low-bit record's moment tensors (meta tensors where they live in files)."""
        if rec.fmt is None:
            return None
        out = {"exp_avg": rec.exp_avg, "exp_avg_sq": rec.exp_avg_sq}
        if rec.fmt.blocked:
            out.update(exp_avg_scales=rec.exp_avg_scales,
                       exp_avg_sq_scales=rec.exp_avg_sq_scales)
        return out

    def load_lowbit(self, unit_index: int, tensors: Dict[str, torch.Tensor]) -> None:
        """Overwrite a low-bit unit's moments with tensors of its own format (bit for bit)."""
        self._settle_all()
        rec = self.states[unit_index]
        live = self._lowbit_live(rec)
        if live is None or set(live) != set(tensors):
            raise ValueError(f"unit {unit_index}: expected low-bit moments "
                             f"{sorted(live or ())}, got {sorted(tensors)}")
        for k, t in live.items():
            if tensors[k].shape != t.shape or tensors[k].dtype != t.dtype:
                raise ValueError(f"unit {unit_index}: {k} must be {t.dtype} of shape "
                                 f"{tuple(t.shape)}, got {tensors[k].dtype} of shape "
                                 f"{tuple(tensors[k].shape)}")
        if rec.exp_avg.is_meta:   # NVMe: into the files
            self._fill(rec, tensors, kinds=list(tensors))
            return
        for k, t in live.items():
            t.copy_(tensors[k])

    def rule_state(self, unit_index: int):
        """``(step, master, per-piece states)`` of a torch class's unit (live tensors)."""
        rec = self.states[unit_index]
        master = rec.rule.master_copy() if rec.master.is_meta else rec.master
        return rec.step, master, rec.rule.piece_states()

    def load_rule_state(self, unit: FlatParamUnit, step: int, master: torch.Tensor,
                        states, group: dict) -> None:
        """Overwrite a torch class's unit state and rebuild its compute shard."""
        rec = self.states[unit.index]
        rec.step = int(step)
        if rec.master.is_meta:   # the master in a file ([Note: rule state on NVMe])
            rec.rule.load(states, group, master=master)
            self._write_compute(unit, master.to("cpu", torch.float32))
            return
        rec.master.copy_(master)
        rec.rule.load(states, group)
        self._write_compute(unit, rec.master)

    def load_owned_state(self, unit: FlatParamUnit, step: int, master: torch.Tensor,
                         states, group: dict) -> None:
        """A whole-matrix class's unit: its master shard and the owned parameters' state in
        the class's format (``MatrixUpdate.load_owned``); rebuild its compute shard."""
        rec = self.states[unit.index]
        rec.step = int(step)
        rec.master.copy_(master)
        self.matrix.load_owned(unit.index, states, group)
        self._write_compute(unit, rec.master)

    # -- accounting and lifetime --------------------------------------------------------

    def _held_at(self, where: str) -> Dict[str, List[torch.Tensor]]:
        out = {"master": [], "optimizer_states": []}
        for rec in self.states:
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

    def held(self) -> Dict[str, List[torch.Tensor]]:
        """Device tensors held by kind ("master", "optimizer_states") for ``stats()``."""
        return self._held_at("device")

    def held_host(self) -> Dict[str, List[torch.Tensor]]:
        """Host tensors held by kind (offload) for ``stats()``: parameter shards
        (``offload_params``), master, moments, gradient shards and the slots' buffers."""
        if not self.on_host:
            return {}
        store = self.param_storage
        return {"params": store.held_host(),
                **self._held_at("host"),
                "grads": list(self.grad_sink.shards) if self.grad_sink is not None else [],
                "buffers": list(self._buffers) + store.buffers()}

    def disk_bytes(self) -> Dict[str, int]:
        """Bytes of files held by kind (NVMe offload; the parameter shards' too where they
        are on disk), measured from the files."""
        if self.files is None:
            return {}
        return {**self.files.disk_bytes(), "params": self.param_storage.disk_bytes()}

    def close(self, keep_files: bool = False) -> Optional[str]:
        """Finish copies and I/O, stop the copy thread, close the files and remove the run
        folder (idempotent; also at garbage collection).

        Args:
            keep_files: NVMe: keep the folder with a manifest (steps, rank, kinds) so that a
                new optimizer with ``OffloadConfig(resume_dir=folder)`` continues from it (a
                rule's RAM state goes into the manifest: [Note: rule state on NVMe]; a
                whole-matrix class is refused by name: its shard masters live in RAM).

        Returns:
            the kept folder, or None.
        """
        if keep_files and self.files is None:
            raise ValueError("close(keep_files=True) applies only to offload='nvme'")
        if keep_files and self.where["master"] != "disk":
            raise ValueError("close(keep_files=True) needs OffloadConfig(nvme_master=True): "
                             "the master is in host RAM and would not survive")
        if keep_files and any(isinstance(r.rule, MatrixUnitRule) for r in self.states):
            raise ValueError("close(keep_files=True) cannot keep a whole-matrix class's run "
                             "(Muon, Adafactor): its units' shard masters live in host RAM "
                             "([Note: whole matrices on NVMe]), not in the folder; save a "
                             "checkpoint (zk.checkpoint.save) instead")
        if not self.on_host:
            return None
        rules = None
        if not self._closed:
            self._settle_all()
            if keep_files:   # (a rule's RAM state for the manifest, before anything closes)
                rules = {r.unit_index: r.rule.kept(self.specs[r.unit.group_index].name)
                         for r in self.states if isinstance(r.rule, SwappedRule)}
        self._closed = True
        self._finalizer()
        if self.files is None:
            return None
        return self.files.close([r.step for r in self.states] if keep_files else None, rules)
