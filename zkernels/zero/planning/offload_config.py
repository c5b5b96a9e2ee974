"""How offload runs: one frozen dataclass passed as ``ZeroOptimizer(offload_config=...)``.

The registry entry (``policy.OFFLOADS[kind]``) says *what* a kind moves off the device; this
says *how* (pinning, sub-group size, the NVMe buffer budget, I/O threads), as FSDP2's
``CPUOffloadPolicy(pin_memory=...)`` and DeepSpeed's ``offload_optimizer`` block do.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

IO_ALIGN = 4096           # bytes: O_DIRECT's alignment of buffers, offsets and lengths
DEFAULT_SUB_GROUP_NUMEL = 1 << 22    # elements per CPU AdamW sub-group (16 MiB of fp32)
DEFAULT_NVME_BUFFER_BYTES = 1 << 26  # the most host RAM NVMe offload streams through (64 MiB)
NUM_NVME_BUFFERS = 3      # read sub-group k+1, update k, write k-1
DEFAULT_NVME_PARAM_BUFFER_BYTES = 1 << 25   # stage 3's parameter bounces on NVMe (32 MiB)
NUM_PARAM_BOUNCES = 2     # read chunk k+1 while chunk k is copied to the device


ALIGN_NUMEL = IO_ALIGN // 4   # fp32 elements per aligned block


def round_up(n: int) -> int:
    """``n`` bytes rounded up to whole ``IO_ALIGN`` blocks."""
    return -(-n // IO_ALIGN) * IO_ALIGN


def nvme_slot_views(numel: int, num_kinds: int, compute_bytes: int, moment_bytes: int = 4,
                    block_size: int = 0) -> List[Tuple[str, int]]:
    """``(name, bytes)`` of each buffer of one NVMe slot of ``numel`` elements, each but the
    last (the output) rounded up to ``IO_ALIGN`` so that every file buffer starts aligned (an
    fp32 buffer of a sub-group, a multiple of ``ALIGN_NUMEL`` elements, needs no rounding):
    the fp32 master when ``num_kinds`` is 3 (``nvme_master``), both moments
    (``moment_bytes`` per element: fp32 4, bf16 2, int8 1), with ``block_size`` the int8
    format's two fp32 scale buffers (one scale per block), an fp32 gradient and a
    compute-dtype output (``compute_bytes`` per element, 0 without one). See [Note: low-bit
    state on NVMe] in ``state/nvme_files.py``."""
    views = [("master", 4 * numel)] if num_kinds == 3 else []
    views += [("exp_avg", moment_bytes * numel), ("exp_avg_sq", moment_bytes * numel)]
    if block_size:
        nb = -(-numel // block_size)
        views += [("exp_avg_scales", 4 * nb), ("exp_avg_sq_scales", 4 * nb)]
    views.append(("grad", 4 * numel))
    if compute_bytes:
        views.append(("out", compute_bytes * numel))
    return [(k, b if k == "out" else round_up(b)) for k, b in views]


def nvme_slot_bytes(numel: int, num_kinds: int, compute_bytes: int, moment_bytes: int = 4,
                    block_size: int = 0) -> int:
    """Bytes of one NVMe slot of ``numel`` elements (:func:`nvme_slot_views`' sum)."""
    return sum(b for _, b in nvme_slot_views(numel, num_kinds, compute_bytes, moment_bytes,
                                             block_size))


def nvme_sub_group_align(file_bytes: int = 0, moment_bytes: int = 4,
                         block_size: int = 0, master_bytes: int = 4) -> int:
    """Elements a sub-group that does not cover its whole unit shard starts at a multiple of:
    an aligned block of every file it reads at ``O_DIRECT`` offsets (the fp32 master, the
    moments of ``moment_bytes``, a parameter file of ``file_bytes``) and whole quantization
    blocks (``block_size``: a block's scale is never split between two sub-groups);
    ``master_bytes`` 2: a bf16 master's file."""
    align = max(ALIGN_NUMEL, IO_ALIGN // moment_bytes, IO_ALIGN // master_bytes, block_size)
    return max(align, IO_ALIGN // file_bytes) if file_bytes else align


def nvme_sub_group_numel(budget_bytes: int, num_kinds: int, compute_bytes: int,
                         largest_shard: int, file_bytes: int = 0, moment_bytes: int = 4,
                         block_size: int = 0, master_bytes: int = 4) -> int:
    """Elements per NVMe sub-group: the largest unit shard (rounded up to an aligned block),
    capped so that ``NUM_NVME_BUFFERS`` slots fit ``budget_bytes``. Each element of a slot
    holds ``num_kinds - 2`` fp32 masters, two moments of ``moment_bytes`` (with
    ``block_size``, their fp32 block scales), one fp32 gradient and one compute-dtype output
    (``compute_bytes``, 0 in pure fp32) (:func:`nvme_slot_views`); the arena's alignment
    slack (one block) is part of the budget. ``file_bytes``: the output is written to a
    parameter file of elements of that size (stage 3's parameters on NVMe), so a sub-group
    also spans whole blocks of it. A capped sub-group starts at multiples of
    :func:`nvme_sub_group_align`.

    Raises:
        ValueError: the budget cannot hold one aligned block per slot.
    """
    def fits(n: int) -> bool:
        return NUM_NVME_BUFFERS * nvme_slot_bytes(n, num_kinds, compute_bytes, moment_bytes,
                                                  block_size) + 2 * IO_ALIGN <= budget_bytes

    base = max(ALIGN_NUMEL, IO_ALIGN // file_bytes) if file_bytes else ALIGN_NUMEL
    whole = -(-largest_shard // base) * base
    if fits(whole):
        return whole
    align = nvme_sub_group_align(file_bytes, moment_bytes, block_size, master_bytes)
    per_elem = NUM_NVME_BUFFERS * (4 * (num_kinds - 2) + 2 * moment_bytes + 4 + compute_bytes
                                   + (8 / block_size if block_size else 0))
    cap = int((budget_bytes - 2 * IO_ALIGN) // per_elem) // align * align
    while cap >= align and not fits(cap):
        cap -= align
    if cap < align:
        need = NUM_NVME_BUFFERS * nvme_slot_bytes(align, num_kinds, compute_bytes,
                                                  moment_bytes, block_size) + 2 * IO_ALIGN
        raise ValueError(f"OffloadConfig.nvme_buffer_bytes={budget_bytes} is too small: "
                         f"{NUM_NVME_BUFFERS} slots of {align} elements need at least "
                         f"{need} bytes")
    return cap


def param_bounce_bytes(budget_bytes: int, largest_file_bytes: int) -> int:
    """Bytes of each of the ``NUM_PARAM_BOUNCES`` host bounces that stage 3's parameter files
    are read through (``param_nvme.py``): the largest file's data, capped so that the bounces
    with their alignment slack fit ``budget_bytes``; a larger file is read in chunks.

    Raises:
        ValueError: the budget cannot hold one aligned block per bounce.
    """
    cap = (budget_bytes // NUM_PARAM_BOUNCES - IO_ALIGN) // IO_ALIGN * IO_ALIGN
    if cap < IO_ALIGN:
        raise ValueError(f"OffloadConfig.nvme_param_buffer_bytes={budget_bytes} is too small: "
                         f"{NUM_PARAM_BOUNCES} bounces of one {IO_ALIGN}-byte block need at "
                         f"least {NUM_PARAM_BOUNCES * 2 * IO_ALIGN} bytes")
    return min(cap, round_up(largest_file_bytes))


def nvme_arena_bytes(sub_group_numel: int, num_kinds: int, compute_bytes: int,
                     moment_bytes: int = 4, block_size: int = 0) -> int:
    """Host bytes of the NVMe slot arena of ``sub_group_numel`` elements per slot (its
    allocation, alignment slack included)."""
    return NUM_NVME_BUFFERS * nvme_slot_bytes(sub_group_numel, num_kinds, compute_bytes,
                                              moment_bytes, block_size) + IO_ALIGN


@dataclass(frozen=True)
class OffloadConfig:
    """Knobs of ``offload="cpu"`` and ``offload="nvme"``.

    Attributes:
        pin_memory: None (pin host buffers when a GPU is present: page-locked memory is what
            makes device<->host copies asynchronous), True (always where a GPU is present;
            without one a warning and pageable memory, as DeepSpeed: [Note: pinning is a
            hint] in zkernels/zero/state/transfer.py) or False (never: for hosts where
            pinning fails or is capped).
        sub_group_numel: elements per CPU AdamW call (cpu offload): the updated compute
            params of one sub-group go back to the device while the next one updates.
        nvme_buffer_bytes: the most host RAM the NVMe placement holds (its aligned slots:
            moments, master, gradient and output staging of ``NUM_NVME_BUFFERS`` sub-groups).
            The slots are sized to need: a sub-group is the largest unit shard, or less where
            this budget caps it, so host RAM stays within the budget whatever the model size
            and does not exceed what a small model's state needs.
        nvme_param_buffer_bytes: stage 3 ``offload_params`` with NVMe: the most host RAM the
            parameter files are read through (two aligned bounces; a unit shard larger than
            one is read and copied in chunks), outside ``nvme_buffer_bytes``.
        nvme_master: keep the fp32 master on disk too (12 bytes per parameter on disk, not 8);
            False keeps it in host RAM (4Ψ/N, outside the budget).
        io_threads: threads of the file I/O pool (each runs blocking ``os.preadv`` /
            ``os.pwritev`` with the GIL released).
        direct_io: None (O_DIRECT where the filesystem accepts it, else buffered I/O, with the
            reason logged once), True (O_DIRECT or an error), False (buffered).
        resume_dir: an NVMe run folder kept by ``opt.close(keep_files=True)``: the new
            optimizer checks and adopts its files (moments, master, step counts) instead of
            starting from zero moments; its parameters are rebuilt from the kept master. A
            torch.optim class or the fused Lion/SGD resumes too (its RAM state kept in the
            manifest: [Note: rule state on NVMe]); Muon and Adafactor are refused by name.
    """

    pin_memory: Optional[bool] = None
    sub_group_numel: int = DEFAULT_SUB_GROUP_NUMEL
    nvme_buffer_bytes: int = DEFAULT_NVME_BUFFER_BYTES
    nvme_param_buffer_bytes: int = DEFAULT_NVME_PARAM_BUFFER_BYTES
    nvme_master: bool = True
    io_threads: int = 4
    direct_io: Optional[bool] = None
    resume_dir: Optional[str] = None

    def __post_init__(self) -> None:
        for name in ("sub_group_numel", "nvme_buffer_bytes", "nvme_param_buffer_bytes",
                     "io_threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"OffloadConfig.{name} must be an int >= 1, got {v!r}")
        for name in ("pin_memory", "direct_io"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"OffloadConfig.{name} must be None, True or False, got {v!r}")
        param_bounce_bytes(self.nvme_param_buffer_bytes, IO_ALIGN)   # raises if too small
        if not isinstance(self.nvme_master, bool):
            raise ValueError(f"OffloadConfig.nvme_master must be a bool, got "
                             f"{self.nvme_master!r}")
