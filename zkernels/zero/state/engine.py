"""The update engine: one AdamW sub-group loop over per-unit state records, wherever the state
lives.

See [Note: parameters and state] in ``units.py`` and [Note: state places] in ``places.py``.
The engine allocates each unit's :class:`~zkernels.zero.state.shard_state.ShardState` from its
injected place, dispatches the unit's update by rule (the fused AdamW, low-bit moments, a
torch.optim class, a fused element-wise definition, whole matrices on owners), runs one fused AdamW per
sub-group the place yields, over the live parameters' ranges, with the place's OpSet, and
writes the updated parameters where the unit's shard says: in place where it ``holds`` the
step's memory, into its file where it is ``in_file``, else by the place's copy to the device.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ...ops import OpSet
from ...ops.adamw import Scalar
from ..planning.state_format import block_align, slot_moments
from ..parameters.units import FlatParamUnit
from .bf16_master import on_bf16_master
from .live_ranges import clip, live_segments
from .lowbit_state import alloc_moments, step_range
from .places import DevicePlace, Piece
from .shard_state import ShardState
from .fused_rule import FusedShardRule
from .matrix_rule import MatrixUnitRule, MatrixUpdate
from .rule_swap import SwappedRule
from .torch_rule import TorchShardRule


def fused_adamw(spec) -> bool:
    """A group of ``spec`` runs the fused AdamW (no rule: ``init_state``'s last branches)."""
    return spec is None or spec.fused and spec.definition is None and not spec.matrix


def adamw_slot_moments(specs: Sequence, formats: Sequence) -> Tuple[int, int]:
    """The NVMe slots' moment width and scales: the fused-AdamW groups' widest format
    ([Note: low-bit state on NVMe] in nvme_files.py)."""
    return slot_moments([formats[g] if g < len(formats) else None for g in range(
        max(len(specs), len(formats), 1)) if fused_adamw(specs[g] if g < len(specs) else None)])


def adamw_hparams(group: dict, step: int, grad_scale: Optional[Scalar]) -> dict:
    """The AdamW keywords of a param group, read at each step (schedulers apply next step)."""
    beta1, beta2 = group["betas"]
    return dict(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
                eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                step=step, grad_scale=grad_scale)


def _adamw(ops: OpSet, p: Piece, a: int, b: int, out: Optional[torch.Tensor], fmt,
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


def _sub_piece(p: Piece, a: int, b: int, fmt) -> Piece:
    """``[a, b)`` of a piece as a piece from element 0 (``a`` starts a quantization block)."""
    bs = fmt.block_size if fmt is not None and fmt.blocked else 0
    if bs and a % bs:
        raise RuntimeError(f"internal: a low-bit AdamW range starts at {a}, not at a multiple "
                           f"of state_block_size={bs} ([Note: low-bit state in shards])")
    return Piece(p.master[a:b], p.grad[a:b], p.exp_avg[a:b], p.exp_avg_sq[a:b], None, p.busy,
                 exp_avg_scales=p.exp_avg_scales[a // bs:] if bs else None,
                 exp_avg_sq_scales=p.exp_avg_sq_scales[a // bs:] if bs else None)


def _update_segments(ops: OpSet, p: Piece, out: Optional[torch.Tensor], direct: bool,
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
        place: where the state lives ([Note: state places] in ``places.py``): a
            :class:`~zkernels.zero.state.places.DevicePlace`, ``HostPlace`` or ``NvmePlace``,
            which allocates the states, streams each shard through the step and owns the
            copies, files and figures.
        specs: each param group's :class:`~zkernels.zero.planning.optimizer_spec.OptimizerSpec`
            by group index (empty: every group the fused AdamW); a torch class's units step
            through a :class:`~zkernels.zero.state.torch_rule.TorchShardRule` ([Note:
            torch.optim on pieces]).
        formats: each param group's low-bit
            :class:`~zkernels.zero.planning.state_format.StateFormat` or None (fp32 moments),
            by group index (empty: fp32 everywhere); see [Note: low-bit state in shards].

    Attributes:
        place: the place object (its ``name`` is :attr:`placement`).
        states: one :class:`ShardState` per unit, by unit index.
        grad_sink, grad_ops, resumed: the place's (the gradient shards the gradient strategy
            fills, their OpSet, a kept run adopted).
        matrix: the whole-matrix classes' update ([Note: whole matrices on owners]), or None.
    """

    def __init__(self, place: DevicePlace, *, specs: Sequence = (), formats: Sequence = (),
                 master_dtype: Optional[torch.dtype] = None) -> None:
        self.place = place
        # the fused AdamW's master: fp32, or bf16 ([Note: bf16 master] in bf16_master.py)
        self.master_dtype = master_dtype or torch.float32
        self.specs = list(specs)
        self.formats = list(formats)
        self.block_align = block_align(self.formats)   # the layout's alignment (build.py)
        self.grad_sink, self.grad_ops = place.grad_sink, place.grad_ops
        self.resumed = place.resumed
        self.states: List[ShardState] = []
        self.matrix: Optional[MatrixUpdate] = None
        self._update_s = 0.0

    @property
    def placement(self) -> str:
        """Where the state lives ("device", "cpu", "nvme"), as ``offload=`` names it."""
        return self.place.name

    @property
    def last_step(self) -> Dict[str, float]:
        """Transfer figures of the last step (offload), for ``stats()``."""
        return self.place.last_step

    # -- construction -------------------------------------------------------------------

    def init_state(self, unit: FlatParamUnit, initial_master: torch.Tensor) -> ShardState:
        """Allocate ``unit``'s record where the place keeps it, from its fp32 shard values
        (``build_*_unit``'s second result); units come in index order. NVMe: create (or,
        resuming, open and check) the unit's files and write the initial state."""
        if unit.index != len(self.states):
            raise ValueError(f"init_state: unit {unit.index} out of order (expected "
                             f"{len(self.states)})")
        n, place = unit.layout.shard_numel, self.place
        spec = self.specs[unit.group_index] if self.specs else None
        mdt = self.master_dtype
        if mdt != torch.float32:   # [Note: bf16 master]
            self._check_bf16_master(unit, spec)
        if unit.shard.holds(place.where["master"]) and unit.compute_dtype == mdt:
            master = unit.compute_shard   # the parameter shard is its own master
        else:   # (a whole matrix's shard master stays in RAM: [Note: whole matrices on NVMe])
            master = place.alloc(n, "master", unit.device, mdt,
                                 resident=spec is not None and spec.matrix)
            if not master.is_meta:
                master.copy_(initial_master)   # (bf16: rounded to nearest even)
        none = master.new_empty(0)
        rec = ShardState(unit, master, none, none)
        pieces, fmt = [(s, k) for _, _, s, k in unit.param_slices_in_shard()], self.format_of(unit)
        if spec is not None and spec.matrix:   # whole matrices on owners (matrix_rule.py)
            if self.matrix is None:
                self.matrix = MatrixUpdate(unit.rank, unit.layout.world_size, self.specs,
                                           place.whole_store())
            self.matrix.add_unit(rec)
            rec.rule = MatrixUnitRule(self.matrix, unit.index)
        elif spec is not None and spec.definition is not None:   # a fused element-wise rule
            rec.rule = FusedShardRule(spec, master, pieces, place.step_ops, fmt)
        elif spec is not None and not spec.fused:   # the class allocates its own state
            rec.rule = TorchShardRule(spec, master, pieces)
        elif fmt is not None:
            m, v, sm, sv = alloc_moments(n, fmt, lambda k, dt: place.alloc(
                k, "exp_avg", unit.device, dt))
            rec = ShardState(unit, master, m, v, fmt=fmt, exp_avg_scales=sm,
                             exp_avg_sq_scales=sv)
        else:
            rec = ShardState(unit, master, place.alloc(n, "exp_avg", unit.device),
                             place.alloc(n, "exp_avg_sq", unit.device))
        place.add(rec, initial_master, spec)
        self.states.append(rec)
        return rec

    def _check_bf16_master(self, unit: FlatParamUnit, spec) -> None:
        """A bf16 master needs the fused AdamW and bf16 parameters (named otherwise)."""
        if not fused_adamw(spec):
            raise ValueError(f"master_dtype=torch.bfloat16 applies to the fused AdamW only; "
                             f"param_groups[{unit.group_index}] runs {spec.name}, whose master "
                             f"stays fp32 ([Note: bf16 master])")
        if unit.compute_dtype != torch.bfloat16:
            raise ValueError(f"master_dtype=torch.bfloat16 needs bf16 parameters "
                             f"(param_dtype=torch.bfloat16 or a bf16 model); unit "
                             f"{unit.index} computes in {unit.compute_dtype}")

    def format_of(self, unit: FlatParamUnit):
        """The unit's group's low-bit state format, or None (fp32 moments)."""
        g = unit.group_index
        return self.formats[g] if g < len(self.formats) else None

    def adopt(self, num_units: int) -> None:
        """Resuming (NVMe): every unit's files checked out (RuntimeError elsewhere)."""
        self.place.adopt(num_units)

    # -- the step -----------------------------------------------------------------------

    def update_order(self, units: Sequence[FlatParamUnit]) -> List[FlatParamUnit]:
        """The order ``update`` wants the units in (the place's: forward order, or NVMe's
        index order)."""
        return self.place.update_order(units)

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
        place = self.place
        if place.closed:
            raise RuntimeError("this ZeroOptimizer was closed (close()): its offloaded state "
                               "is gone, build a new optimizer to train on")
        scale = place.begin_step(grad_scale)
        rec = self.states[unit.index]
        rec.step += 1
        if rec.rule is not None:   # a torch.optim class on the pieces
            # (a piece of a parameter without a gradient gets .grad None: the class skips it)
            flags = None if live is None else [
                live[i] for i, _, _, _ in unit.layout.tensor_slices_in_shard(unit.rank)]
            if isinstance(rec.rule, SwappedRule):   # (its master may be in RAM only now)
                rec.rule.step(grad, group, scale, flags,
                              publish=lambda m: place.publish_rule(unit, m))
            else:
                rec.rule.step(grad, group, scale, flags)
                place.publish_rule(unit, rec.master)
            self._update_s += time.perf_counter() - t0
            return
        segments, whole = live_segments(
            ((i, s, n) for i, _, s, n in unit.layout.tensor_slices_in_shard(unit.rank)),
            rec.numel, rec.param_steps, live)
        mixed = unit.compute_dtype != torch.float32
        # The compute shard lives beside the step: the AdamW writes it in place; or in a file
        # (parameters on NVMe): each sub-group's output goes from its slot to the file.
        to_file = unit.shard.in_file
        direct = unit.shard.holds(place.step_at)
        if direct:
            unit.shard.settle()   # no copy still reads the shard written now
        shard, last = unit.compute_shard, None
        for lo, hi, p in place.pieces(rec, grad, staged=mixed and not direct):
            out = (shard[lo:hi] if direct else p.out) if mixed else None
            if whole:
                _adamw(place.step_ops, p, 0, hi - lo, out, rec.fmt,
                       adamw_hparams(group, segments[0][2], scale))
            else:
                _update_segments(place.step_ops, p, out, direct, clip(segments, lo, hi), group,
                                 scale, rec.fmt)
            if to_file:
                if not mixed and p.out is not None:   # (a host master: staged aligned)
                    p.out.copy_(p.master)
                p.busy.append(unit.shard.write_range(p.slot_out, lo, hi))
            elif not direct:
                last = place.to_device(shard[lo:hi], out if mixed else p.master)
                p.busy.append(last)
            elif not mixed and p.master.data_ptr() != shard[lo:hi].data_ptr():
                shard[lo:hi].copy_(p.master)
        if last is not None:
            last.wait()  # the gather (publish) reads the compute shard after the copy
        self._update_s += time.perf_counter() - t0

    def finish_step(self) -> None:
        """After every unit's update: every write and copy of the step finished; the step's
        transfer figures go into :attr:`last_step`."""
        self.place.finish_step(self._update_s)
        self._update_s = 0.0

    # -- accounting and lifetime --------------------------------------------------------

    def held(self) -> Dict[str, List[torch.Tensor]]:
        """Device tensors held by kind ("master", "optimizer_states") for ``stats()``."""
        return self.place.held_at(self.states, "device")

    def held_host(self) -> Dict[str, List[torch.Tensor]]:
        """Host tensors held by kind (offload) for ``stats()``."""
        return self.place.held_host(self.states)

    def disk_bytes(self) -> Dict[str, int]:
        """Bytes of files held by kind (NVMe offload), measured from the files."""
        return self.place.disk_bytes()

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
        return self.place.close(self.states, self.specs, keep_files)
