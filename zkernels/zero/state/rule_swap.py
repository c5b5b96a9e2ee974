"""A rule's state in swap files (``offload="nvme"`` with a torch.optim class or a fused
element-wise rule): in host RAM only while its unit updates.

[Note: rule state on NVMe]
A :class:`~zkernels.zero.state.torch_rule.TorchShardRule` or
:class:`~zkernels.zero.state.fused_rule.FusedShardRule` keeps its element-wise state as flat
[shard_numel] buffers, one per state key (``rule.flat``: fp32, or a fused rule's bf16 form,
whose files are bf16). With NVMe offload
:class:`SwappedRule` wraps the rule: each key's buffer is one swap file of the run's folder
(``unit00003.rule-momentum_buffer.swap``, the format of ``swap.py``, registered with
``NvmeFiles`` so ``stats()`` counts it on disk, the size check before a step covers it and
the folder's removal takes it). Before the unit's step the files are read into fresh aligned
host buffers, which the rule adopts (``attach``); after the step they are written back and
dropped (``detach``: a torch class's state entries become meta placeholders, so a read
without the files fails loudly instead of restarting the state). So host RAM holds one unit's
state at a time, bounded by the largest unit shard times the class's state size. The fp32
master stays where NVMe keeps it: in host RAM (``nvme_master=False``), or, with
``nvme_master`` (the default), in one more file of the unit (``unit00003.master.swap``, the
name and kind of the fused AdamW's, counted as "master" on disk), read in with the state
before the step and written back after it; between steps the rule steps a placeholder
(``use_master``: a torch class's pieces keep their identity, the keys of its state, and view
the buffer read in), so a step without the files fails loudly. The engine writes the unit's
compute shard from the master while it is in RAM (``step(publish=...)``), and reads it for a
checkpoint from the file (:meth:`SwappedRule.master_copy`). Host RAM then holds one unit's
master and state at a time, and nothing between steps. A kept folder resumes (``close(
keep_files=True)``, then ``OffloadConfig(resume_dir=...)``; with ``nvme_master``, so that the
master is in the folder): what lives in RAM, the optimizer's name, the state keys that have
files and each piece's 0-dim state (``step``, ASGD's ``eta``/``mu``, as numbers, as a
checkpoint keeps them) and whether it has state at all, goes into the folder's manifest
(:meth:`SwappedRule.kept`); the new run opens the kept files (:meth:`SwappedRule.adopt`) and
gives the rule its state at the first step, read load or save (as a checkpoint load would:
``rule.load``, which builds the class with the group's hyperparameters).
A class creates its state lazily at its first step, so a key's
file is created when the key first appears (after the unit's first step, or at a load).
Reads and writes are synchronous (no prefetch of the next unit: the class's step is the
bottleneck on the host, and a prefetch would hold two units' state). The gradient shard comes
to the host for the step by the copier (NVMe keeps it on the device; counted in
``stats()["offload"]`` as AdamW's slices are, and so are the files' reads and writes). 0-dim
state (``step``) stays in RAM.
Checkpoints read the state through :meth:`SwappedRule.piece_states` (copies, the buffers are
dropped again) and load through :meth:`SwappedRule.load` (written to the files).
"""
from __future__ import annotations

import os
from typing import Callable, Dict, List, Optional

import torch

from .nvme_files import NvmeFiles
from .swap import SwapFile, aligned_empty, round_up


class SwappedRule:
    """A rule whose flat state lives in files (see [Note: rule state on NVMe]).

    Args:
        rule: the :class:`TorchShardRule` or :class:`FusedShardRule` (``flat``, ``step``,
            ``piece_states``, ``load``, ``attach``, ``detach``).
        files: the run's :class:`NvmeFiles` (folder, I/O pool, rank).
        unit_index: the unit (file names and headers).
        numel: the unit's shard elements.
        copier: brings a device gradient shard to the host.
        master_on_disk: the master lives in a file too (``nvme_master``); its initial values
            go in by :meth:`write_master`.

    Attributes:
        swaps: state key -> its :class:`SwapFile`.
    """

    def __init__(self, rule, files: NvmeFiles, unit_index: int, numel: int, copier,
                 master_on_disk: bool = False) -> None:
        self.rule, self.files, self.unit, self.numel = rule, files, unit_index, numel
        self.copier = copier
        self.swaps: Dict[str, SwapFile] = {}
        self._bufs: Dict[str, torch.Tensor] = {}   # key -> padded aligned buffer (in RAM)
        self.master_file: Optional[SwapFile] = None
        self._master_buf: Optional[torch.Tensor] = None
        # (4 bytes standing for the master between steps: a read of it is no step)
        self._placeholder = torch.zeros(1).expand(numel) if master_on_disk else None
        if master_on_disk:
            rule.use_master(self._placeholder)
        self._pending: Optional[List[dict]] = None   # (resumed: each piece's kept scalars)

    # -- a kept folder ------------------------------------------------------------------

    def kept(self, optimizer: str) -> dict:
        """What a kept folder needs beside the files (JSON: the manifest's): the optimizer,
        the keys with files, each piece's 0-dim state as numbers (None: no state yet)."""
        pieces = []
        for st in self.piece_states():
            pieces.append({k: float(v) for k, v in st.items() if not isinstance(
                v, torch.Tensor) or v.dim() == 0} if st else None)
        return {"optimizer": optimizer, "keys": sorted(self.swaps),
                "master": self.master_file is not None, "pieces": pieces}

    def adopt(self, info: dict) -> None:
        """Resuming: open the files :meth:`kept` listed; the rule takes its state at the
        first step, load or save (:meth:`_settle`)."""
        if info["master"]:
            self.master_file = self.files.open_file(self.unit, "master", self.numel)
        for k in info["keys"]:
            self.swaps[k] = self.files.open_file(self.unit, f"rule-{k}", self.numel,
                                                 self.rule.state_dtype)
        self._pending = list(info["pieces"])

    def _kept_states(self, flat: Dict[str, torch.Tensor]) -> List[Dict[str, torch.Tensor]]:
        out = []
        for (s, n), sc in zip(self.rule.slices, self._pending):
            if sc is None:
                out.append({})
                continue
            st = {k: t[s:s + n] for k, t in flat.items()}
            st.update({k: torch.tensor(v) for k, v in sc.items()})
            out.append(st)
        return out

    def _settle(self, group: dict) -> None:
        """A resumed rule (state in RAM now) takes its kept state: ``rule.load``."""
        if self._pending is not None:
            self.rule.load(self._kept_states(dict(self.rule.flat)), group)
            self._pending = None

    def write_master(self, values: torch.Tensor) -> None:
        """Write ``values`` ([numel] fp32) to the master's file, created at the first call
        (the initial master, a load: not a step's traffic)."""
        if self.master_file is None:
            self.master_file = self.files.create_file(self.unit, "master", self.numel)
        buf = aligned_empty(self.master_file.data_bytes)
        view = buf.view(torch.float32)
        view[self.numel:].zero_()
        view[:self.numel].copy_(values.reshape(-1))
        self.files.io.write(self.master_file, buf, 0, self.master_file.data_bytes,
                            counted=False).result()

    def master_copy(self) -> torch.Tensor:
        """The fp32 master as a new CPU tensor (read from its file where it lives there)."""
        if self.master_file is None:
            return self.rule.master
        f = self.master_file
        buf = aligned_empty(f.data_bytes)
        self.files.io.read(f, buf, 0, f.data_bytes, counted=False).result()
        return buf.view(torch.float32)[:self.numel]

    @property
    def inner(self):
        return self.rule

    # -- in and out ---------------------------------------------------------------------

    def _bring_in(self, master: bool = True) -> None:
        futs, flat = [], {}
        if master and self.master_file is not None:
            f = self.master_file
            self._master_buf = aligned_empty(f.data_bytes)
            futs.append(self.files.io.read(f, self._master_buf, 0, f.data_bytes))
        for k, f in self.swaps.items():
            buf = aligned_empty(f.data_bytes)
            futs.append(self.files.io.read(f, buf, 0, f.data_bytes))
            self._bufs[k] = buf
            flat[k] = buf.view(f.dtype)[:self.numel]
        for fu in futs:
            fu.result()
        if self._master_buf is not None:
            self.rule.use_master(self._master_buf.view(torch.float32)[:self.numel])
        self.rule.attach(flat)

    def _write_out(self) -> None:
        """Write every key's buffer to its file (creating the files of new keys), then drop
        the buffers."""
        flat = self.rule.detach()
        futs = []
        for k, t in flat.items():
            buf = self._bufs.get(k)
            if buf is None or buf.data_ptr() != t.data_ptr():   # a key the rule just made
                buf = aligned_empty(round_up(self.numel * t.element_size()))
                buf.view(t.dtype)[self.numel:].zero_()
                buf.view(t.dtype)[:self.numel].copy_(t)
            if k not in self.swaps:
                self.swaps[k] = self.files.create_file(self.unit, f"rule-{k}", self.numel,
                                                       t.dtype)
            futs.append(self.files.io.write(self.swaps[k], buf, 0, self.swaps[k].data_bytes))
        if self._master_buf is not None:
            f = self.master_file
            futs.append(self.files.io.write(f, self._master_buf, 0, f.data_bytes))
        try:
            for fu in futs:
                fu.result()
        finally:
            self._drop()

    def _drop(self) -> None:
        self._bufs = {}
        if self._master_buf is not None:
            self.rule.use_master(self._placeholder)
            self._master_buf = None

    # -- the rule's interface -----------------------------------------------------------

    def step(self, grad: torch.Tensor, group: dict, grad_scale,
             live: Optional[List[bool]] = None,
             publish: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        """The rule's step with its state (and master) read in before and written back
        after; ``publish`` gets the updated fp32 master while it is in RAM (the engine writes
        the unit's compute shard from it)."""
        host = torch.empty(grad.shape, dtype=grad.dtype)   # (counted, as AdamW's slices)
        self.copier.to_host(host, grad).wait()
        self._bring_in()
        try:
            self._settle(group)
            self.rule.step(host, group, grad_scale, live)
            if publish is not None:
                publish(self.rule.master)
        finally:
            self._write_out()

    def piece_states(self) -> List[Dict[str, torch.Tensor]]:
        """Each piece's state (copies: the buffers go back to disk)."""
        self._bring_in(master=False)
        try:
            states = self.rule.piece_states() if self._pending is None else \
                self._kept_states(dict(self.rule.flat))
            return [{k: t.clone() if isinstance(t, torch.Tensor) else t
                     for k, t in st.items()} for st in states]
        finally:
            self.rule.detach()
            self._drop()

    def load(self, states, group: dict, master: Optional[torch.Tensor] = None) -> None:
        """Set each piece's state (written to the files); ``master``: the fp32 master's
        values too (where it lives in a file)."""
        self._bring_in()
        try:
            if master is not None and self.master_file is not None:
                self.rule.master.copy_(master)
            self._pending = None   # (a load replaces a kept state)
            self.rule.load(states, group)
        finally:
            self._write_out()

    def master_written(self) -> None:
        self.rule.master_written()

    def held(self) -> List[torch.Tensor]:
        """The state buffers in host RAM now (empty between steps)."""
        return list(self.rule.flat.values())

    def disk_bytes(self) -> int:
        """Bytes of this unit's state files (headers included; the master's not)."""
        return sum(os.fstat(f.fd).st_size for f in self.swaps.values() if f.fd >= 0)
