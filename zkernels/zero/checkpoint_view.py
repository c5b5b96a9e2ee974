"""What a checkpoint may read from and write into a ``ZeroOptimizer``: one declared view.

[Note: the declared checkpoint view]
Two readers save and restore an optimizer's state: ``zero/state/state_dict.py`` (torch's
``state_dict()``, same world size) and the ``zkernels.checkpoint`` package (any world size,
any stage). Both go through :class:`CheckpointSource`, which ``ZeroOptimizer`` implements,
:class:`CheckpointUnit`, which every flat unit implements, and :class:`CheckpointUnitState`,
which every trainable unit's ``ZeroUnit`` implements (``opt.zero_units[u.index]``); none
reaches for a private attribute, a strategy's internals or a member found with ``getattr``.
``tests/zero/test_layout_seams.py`` reads both readers' source and fails on any attribute of
the optimizer (``opt``), a unit (``u``, ``unit``) or its state (``z``) not declared here.

A unit's state is read with ``z.read_state()`` (its step and its fp32 ``master, exp_avg,
exp_avg_sq`` shard tensors: live tensors on the device or in host RAM; with NVMe offload
copies read from its files, which ``write_state`` writes back) and written with
``write_state``, which also rebuilds the unit's compute shard from the master in the compute
dtype. :meth:`~CheckpointSource.publish` then makes every rank's copy of the parameters follow
the shards (stages 1-2: all-gather; stage 3: drop a stale gathered copy). The counters (steps,
skipped steps, the loss scaler) travel as one dict. A unit with low-bit moments
(``state_dtype``) also offers them as trained (``read_lowbit_state``, ``write_lowbit_state``),
so a checkpoint resumes bit for bit.
"""
from __future__ import annotations

from typing import (Any, ContextManager, Dict, Iterator, List, Optional, Protocol, Sequence,
                    Tuple, runtime_checkable)

import torch
import torch.nn as nn

from ..comm.base import Comm
from ..layout import FlatLayout

StateTensors = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@runtime_checkable
class CheckpointUnit(Protocol):
    """A flat unit as a checkpoint sees it (``zkernels/zero/parameters/units.py``)."""

    index: int
    group_index: int
    names: Tuple[str, ...]
    layout: FlatLayout
    device: torch.device

    @property
    def shapes(self) -> List[torch.Size]:
        """Every parameter's full shape, in layout order (also while stage 3 has freed it)."""

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the unit's compute shard."""

    def shard_values(self, write_back: bool = False) -> ContextManager[torch.Tensor]:
        """This rank's shard of the compute buffer with its values (a frozen unit's values
        live only there): the shard, or a host copy where it is on disk, written back on exit
        with ``write_back``."""

    def param_slices_in_shard(self) -> Iterator[Tuple[str, int, int, int]]:
        """``(name, start in the parameter, start in the shard, length)`` per parameter
        overlapping this rank's shard."""


@runtime_checkable
class CheckpointUnitState(Protocol):
    """A trainable unit's state as a checkpoint sees it (``zkernels/zero/unit.py``)."""

    @property
    def state_step(self) -> int:
        """Steps applied to the unit's shard (no tensor is read)."""

    @property
    def param_steps(self) -> List[int]:
        """Each of the unit's parameters' step counts, by position."""

    @property
    def state_format(self) -> Optional[Dict[str, Any]]:
        """``{"dtype": "bf16" | "int8", "block_size": int}`` (int8: and ``"code"``) where its
        moments are low-bit (``state_dtype``), else None (``read_state``: dequantized)."""

    def read_state(self) -> Tuple[int, StateTensors]:
        """``(step, (master, exp_avg, exp_avg_sq))`` of the unit's shard, fp32."""

    def write_state(self, step: int, master: torch.Tensor, exp_avg: torch.Tensor,
                    exp_avg_sq: torch.Tensor, param_steps: Optional[Sequence[int]] = None
                    ) -> None:
        """Restore the unit's state and rebuild its compute shard from ``master``
        (``param_steps`` None: every parameter's count is ``step``)."""

    def read_lowbit_state(self) -> Optional[Dict[str, torch.Tensor]]:
        """A low-bit unit's moments as trained (``exp_avg``, ``exp_avg_sq``, and int8's
        ``exp_avg_scales``, ``exp_avg_sq_scales``), or None."""

    def write_lowbit_state(self, tensors: Dict[str, torch.Tensor]) -> None:
        """Restore a low-bit unit's moments bit for bit (tensors of its own format), after
        ``write_state`` restored its master and counts."""

    def read_rule_state(self) -> Tuple[int, torch.Tensor, List[dict]]:
        """``(step, master, [state per piece])`` in ``param_slices_in_shard()`` order, keyed as
        its class keeps them (the fused AdamW's: ``exp_avg``, ``exp_avg_sq``)."""

    def write_rule_state(self, step: int, master: torch.Tensor, states: List[dict]) -> None:
        """Restore :meth:`read_rule_state`'s state and rebuild the unit's compute shard."""

    def read_owned_state(self) -> Dict[str, dict]:
        """A whole-matrix class's unit ([Note: whole matrices on owners]): the class's own
        state of each of its parameters this rank owns, by name; empty for other units."""

    def write_owned_state(self, step: int, master: torch.Tensor, states: Dict[str, dict]) -> None:
        """Restore :meth:`read_owned_state` (same world size: same owners) and the master
        shard, and rebuild the unit's compute shard."""


@runtime_checkable
class CheckpointSource(Protocol):
    """What ``ZeroOptimizer`` offers to ``state_dict.py`` and ``zkernels.checkpoint``.

    Attributes:
        module: the model, for parameter names and ``state_dict()`` keys.
        stage: 1, 2 or 3.
        offload: None, "cpu" or "nvme" (where the state lives).
        param_groups: torch-style groups (hyperparameters, parameters).
        units: the trainable flat units, in launch order.
        zero_units: each trainable unit's state, by unit index (``zero_units[u.index]``).
        frozen_units: stage 3's frozen flat units (values only, no state); else empty.
        checkpoint_comm: the shard group's collectives, unmetered (checkpoint traffic is not
            a training step's); its rank and size name the shard files.
        checkpoint_world: every rank's collectives, unmetered (with hybrid sharding more
            than the shard group: all ranks agree on each phase, its rank 0 leads).
        replica_rank: hybrid sharding's group index (0 otherwise); every replica holds the
            same shards, so only replica 0 writes them.
    """

    module: nn.Module
    stage: int
    offload: Optional[str]
    param_groups: List[Dict[str, Any]]
    units: Sequence[CheckpointUnit]
    zero_units: Sequence[CheckpointUnitState]
    frozen_units: Sequence[CheckpointUnit]

    @property
    def checkpoint_comm(self) -> Comm:
        """The shard group's collectives, unmetered."""

    @property
    def checkpoint_world(self) -> Comm:
        """Every rank's collectives, unmetered."""

    @property
    def replica_rank(self) -> int:
        """This rank's replica group (0 without hybrid sharding)."""

    @property
    def param_dtype(self) -> torch.dtype:
        """The compute copy's dtype."""

    def wait_params(self) -> None:
        """Let in-flight parameter gathers land (they write the buffers a save reads)."""

    @property
    def optimizer_names(self) -> List[str]:
        """Each param group's optimizer: "adamw" (the fused AdamW) or a torch class's name
        ([Note: optimizer rules] in ``planning/optimizer_spec.py``)."""

    def publish(self, units: Sequence[CheckpointUnit]) -> None:
        """Make every rank's parameters follow these units' shards. Collective."""

    def counters(self) -> Dict[str, Any]:
        """``{"num_steps", "overflow_skips", "loss_scaler"}`` (the scaler's state or None)."""

    def load_counters(self, saved: Dict[str, Any]) -> None:
        """Restore :meth:`counters`; the loss scale only where both sides scale (fp16)."""

    def sharded_state_dict_keys(self) -> ContextManager[None]:
        """Inside: ``module.state_dict()`` lists stage 3's sharded parameters by key without
        gathering them (their values come from the shards); elsewhere a no-op."""
