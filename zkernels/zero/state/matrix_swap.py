"""Where an owner keeps its whole matrices (``place.whole_store()``): in memory, or in swap
files (``offload="nvme"`` with Muon or Adafactor): each owned parameter's whole fp32 master and
its class state in RAM only for its own update.

[Note: whole matrices on NVMe]
With NVMe offload :class:`~zkernels.zero.state.matrix_rule.MatrixUpdate` keeps what an owner
holds per owned parameter (see [Note: whole matrices on owners]), its whole fp32 master and
the class's state tensors (Muon's ``momentum_buffer``, Adafactor's ``row_var``/``col_var``/
``variance``), in files of the run's folder (``unit00003.whole1-master.swap``,
``unit00003.whole1-momentum_buffer.swap``: parameter 1 of unit 3; the format of ``swap.py``,
registered with ``NvmeFiles`` so ``stats()`` counts them on disk, the size check before a step
covers them and the folder's removal takes them). Between steps the class's parameter is a
4-byte placeholder (``torch.zeros(1).expand(shape)``: the class keeps its identity, the key of
its state) and each state tensor a meta tensor of its shape, so a read without the files
fails loudly. The owner steps its matrices one at a time: :meth:`WholeSwap.bring_in` reads
the master (or, when the masters are stale, gives a fresh buffer that the shards' pieces
fill) and the state into fresh aligned buffers, the class steps that one parameter (the
others' ``.grad`` None: Muon and Adafactor update each parameter on its own, so the result is
the one joint step's, bit for bit), the pieces the other ranks get are copied out, and
:meth:`WholeSwap.write_out` writes the buffers back and drops them. Host RAM holds one
matrix's whole master, state and gradient at a time (plus the exchanges' buffers, which
hold every owned matrix's pieces of the others, as without NVMe). The shard master of a
matrix group's units stays in host RAM (4 bytes per element over N, as with
``nvme_master=False``): the exchanges read and write its pieces. Reads and writes are
synchronous. 0-dim state (Adafactor's ``step``) stays in RAM.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from .nvme_files import NvmeFiles
from .swap import SwapFile, aligned_empty, round_up
from .transfer import Copier


def _buffer(numel: int) -> torch.Tensor:
    buf = aligned_empty(round_up(numel * 4))
    buf.view(torch.float32)[numel:].zero_()
    return buf


class WholeInMemory:
    """An owner's whole matrices in memory beside the state (device, or host RAM with CPU
    offload), held across steps (``streams`` False: each class steps once over all of them);
    nothing to read or write around a use, the gradient shards used where they are."""

    streams = False

    def new(self, shape, device: torch.device) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.float32, device=device)

    def bring_in(self, k: int, w: torch.Tensor, state: dict, master: str = "read") -> None:
        """Nothing to read: matrix ``k`` and its state stay in memory across steps."""

    def write_out(self, k: int, unit_index: int, pos: int, w: torch.Tensor, state: dict,
                  master: bool = True, write: bool = True) -> None:
        """Nothing to write back: the step updated matrix ``k`` where it lives."""

    def gradients(self, shards, units):
        return shards


class WholeSwap:
    """The files of an owner's whole matrices, one in RAM at a time (``streams``: each steps
    on its own; see [Note: whole matrices on NVMe]).

    Args:
        files: the run's :class:`NvmeFiles`.
        copier: the offload's :class:`Copier`, which brings the gradient shards (on the
            device with NVMe) to the host, counted as a rule's are.
    """

    streams = True

    def __init__(self, files: NvmeFiles, copier: Copier) -> None:
        self.files, self.copier = files, copier
        self.swaps: Dict[Tuple[int, str], SwapFile] = {}   # (item, key) -> its file
        self._bufs: Dict[Tuple[int, str], torch.Tensor] = {}

    def new(self, shape, device: torch.device) -> torch.Tensor:
        """What the class steps between steps (4 bytes)."""
        return torch.zeros(1).expand(tuple(shape))

    def gradients(self, shards, units):
        """Each unit's gradient shard copied to host RAM (counted)."""
        out = {u: torch.empty(shards[u].shape, dtype=shards[u].dtype) for u in units}
        for u in units:
            self.copier.to_host(out[u], shards[u]).wait()
        return out

    def _read(self, k: int, key: str) -> torch.Tensor:
        f = self.swaps[(k, key)]
        buf = aligned_empty(f.data_bytes)
        self.files.io.read(f, buf, 0, f.data_bytes).result()
        self._bufs[(k, key)] = buf
        return buf.view(torch.float32)[:f.numel]

    def bring_in(self, k: int, w: torch.Tensor, state: dict, master: str = "read") -> None:
        """Item ``k``'s whole master into ``w`` (``master``: "read" from its file, "fresh":
        a new buffer the caller fills, "none": left as is) and its state tensors (meta
        placeholders in ``state``) read from their files."""
        if master == "fresh" or master == "read" and (k, "master") not in self.swaps:
            buf = _buffer(w.numel())
            self._bufs[(k, "master")] = buf
            w.data = buf.view(torch.float32)[:w.numel()].view(w.shape)
        elif master == "read":
            w.data = self._read(k, "master").view(w.shape)
        for key, t in list(state.items()):
            if isinstance(t, torch.Tensor) and t.is_meta:
                state[key] = self._read(k, key).view(t.shape)

    def write_out(self, k: int, unit_index: int, pos: int, w: torch.Tensor, state: dict,
                  master: bool = True, write: bool = True) -> None:
        """Write item ``k``'s whole master (``master``) and state tensors to their files
        (created for new keys; ``write`` False: a read only, nothing written), then drop the
        buffers: placeholders stay."""
        parts = [("master", w)] if master else []
        parts += [(key, t) for key, t in state.items()
                  if isinstance(t, torch.Tensor) and t.dim() > 0 and not t.is_meta]
        futs = []
        for key, t in parts if write else ():
            n = t.numel()
            buf = self._bufs.get((k, key))
            if buf is None or buf.data_ptr() != t.data_ptr():   # a tensor the class made
                buf = _buffer(n)
                buf.view(torch.float32)[:n].copy_(t.reshape(-1))
            if (k, key) not in self.swaps:
                self.swaps[(k, key)] = self.files.create_file(unit_index, f"whole{pos}-{key}",
                                                              n)
            f = self.swaps[(k, key)]
            futs.append(self.files.io.write(f, buf, 0, f.data_bytes))
        try:
            for fu in futs:
                fu.result()
        finally:
            for key, t in parts:
                if key != "master":
                    state[key] = torch.empty(t.shape, dtype=t.dtype, device="meta")
            if master or (k, "master") in self._bufs:
                w.data = self.new(w.shape, w.device)
            self._bufs = {}
