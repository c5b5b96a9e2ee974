"""The stage registry: which ZeRO stages and offload kinds exist, what each keeps, which
buffers it needs. The optimizer, ``stage="auto"``, the ladder, ``python -m zkernels plan`` and
``estimate_memory`` all read it; nothing else lists stages.

[Note: the stage registry]
A stage is a frozen :class:`StagePolicy` in ``STAGES``: what it shards (optimizer states,
gradients, parameters) and the transient memory of its step. Offload kinds are
:class:`OffloadPolicy` entries in ``OFFLOADS``. The ladder's rungs (``RUNGS``) are (stage,
offload) pairs, lowest first. A new stage or kind registers here and its strategies where they
live (the gradient strategy in ``grad_reducers.make_grad_reducer``, the parameter policy in
``units.py``, the update placement in ``state/engine.py``); what a run asks for is a
``ZeroConfig`` (``config.py``), checked against these entries there. The reduce-buffer rule
(:func:`num_reduce_buffers`) is shared by the gradient strategies and the estimator so that
``estimate_memory`` and ``stats()`` count the same buffers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

NUM_REDUCE_BUFFERS = 2  # bucket-sized reduce buffers in flight: one filling, one reducing


@dataclass(frozen=True)
class StagePolicy:
    """What one stage keeps per rank and how its step moves data.

    Attributes:
        stage: 0 (plain data parallel, DDP + AdamW: the estimator's baseline) to 3.
        shards_optimizer: master and AdamW moments are sharded (1/N per rank).
        shards_grads: gradients are reduce-scattered during backward and only this rank's shard
            is kept (otherwise full gradients are kept until ``step()``).
        shards_params: parameters are sharded between uses and gathered just in time
            (otherwise every rank keeps the full compute copy).
        transient: memory that lives only inside a step: "none", "reduced_grad_shard" (stage 1's
            reduced shards during ``step()``) or "gathered_units" (stage 3's gathered units).
    """

    stage: int
    shards_optimizer: bool
    shards_grads: bool
    shards_params: bool
    transient: str

    @property
    def name(self) -> str:
        return "data parallel" if self.stage == 0 else f"stage {self.stage}"

    @property
    def holds_reduce_buffers(self) -> bool:
        """Whether the reduce buffers are kept between steps (stages 1-2 reuse them every
        step) or live only while gradients are in flight (stage 3, so that between steps it
        holds its formula and nothing else, as FSDP2 does; [Note: transient reduce buffers] in
        ``zkernels/comm/reduce_pool.py``). The peak is the same either way."""
        return not self.shards_params

    @property
    def gathers_per_step(self) -> int:
        """All-gathers of the parameters per step: 1 after the update (stages 1-2), 2 at stage
        3 (before forward and again before backward), 0 for data parallel."""
        if self.stage == 0:
            return 0
        return 2 if self.shards_params else 1

    def uses_reduce_pool(self, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> bool:
        """Whether gradients go through pooled reduce buffers. Stages that reduce during
        backward always do; stage 1 reduce-scatters its flat gradient in place unless it must
        cast it (reduce dtype != param dtype) or pre-divide it (fp16, see precision.py)."""
        if self.stage == 0:
            return False
        if self.shards_grads:
            return True
        return reduce_dtype != param_dtype or param_dtype == torch.float16

    def num_reduce_buffers(self, num_buckets: int, num_groups: int) -> int:
        """Reduce buffers the pool holds: see :func:`num_reduce_buffers`."""
        return num_reduce_buffers(self, num_buckets, num_groups)


def num_reduce_buffers(policy: StagePolicy, num_buckets: int, num_groups: int) -> int:
    """THE reduce-buffer rule (reducers and estimator both call it): two buffers (one filling,
    one reducing); a stage that reduces during backward adds one per param group beyond the
    first (a partly filled bucket of one group may wait for another group's); never more than
    there are buckets."""
    extra = num_groups - 1 if policy.shards_grads else 0
    return min(NUM_REDUCE_BUFFERS + extra, num_buckets)


@dataclass(frozen=True)
class OffloadPolicy:
    """Where the fp32 work lives (ZeRO-Offload / ZeRO-Infinity).

    Attributes:
        kind: None (the device), "cpu" (master, moments and gradient shard in host RAM) or
            "nvme" (master and moments on disk, streamed through a fixed host budget; the
            gradient shard stays on the device). At stage 3 either kind also takes the
            parameter shard off the device with ``offload_params=True``: into host RAM with
            "cpu" (``param_offload.py``), into files with "nvme" (``param_nvme.py``).
        min_stage: the lowest stage it combines with.
    """

    kind: Optional[str]
    min_stage: int

    @property
    def name(self) -> str:
        return "none" if self.kind is None else f"{self.kind} offload"


STAGES: Dict[int, StagePolicy] = {
    0: StagePolicy(0, shards_optimizer=False, shards_grads=False, shards_params=False,
                   transient="none"),   # DDP: the baseline
    1: StagePolicy(1, shards_optimizer=True, shards_grads=False, shards_params=False,
                   transient="reduced_grad_shard"),
    2: StagePolicy(2, shards_optimizer=True, shards_grads=True, shards_params=False,
                   transient="none"),
    3: StagePolicy(3, shards_optimizer=True, shards_grads=True, shards_params=True,
                   transient="gathered_units"),
}

OFFLOADS: Dict[Optional[str], OffloadPolicy] = {
    None: OffloadPolicy(None, min_stage=0),
    "cpu": OffloadPolicy("cpu", min_stage=2),
    "nvme": OffloadPolicy("nvme", min_stage=2),
}

# The ladder, lowest first: (stage, offload kind). Offload comes after stage 3 (host copies
# and a CPU step cost more than stage 3's extra all-gather on a GPU), stage 2 + offload before
# stage 3 + offload (ZeRO-Offload keeps full parameters on the device: no gathers), NVMe last
# (disk bandwidth); stage="auto" and plan take the first that fits.
RUNGS: Tuple[Tuple[int, Optional[str]], ...] = ((1, None), (2, None), (3, None),
                                                (2, "cpu"), (3, "cpu"),
                                                (2, "nvme"), (3, "nvme"))


def check_reshard_after_forward(value, shard_size: int):
    """``reshard_after_forward`` (type and stage checked by ``ZeroConfig``) once the shard
    group's K is known: a bool, or an int R strictly between 1 and K that divides K.

    Raises:
        ValueError: an int that is not such a divisor.
    """
    if not isinstance(value, bool) and not (1 < value < shard_size and shard_size % value == 0):
        raise ValueError(f"reshard_after_forward={value} must divide the shard group's "
                         f"{shard_size} ranks and lie strictly between 1 and {shard_size} (a "
                         f"smaller group to reshard to after forward, as FSDP2 asks; True or "
                         f"False otherwise)")
    return value


def is_compiled(model) -> bool:
    """Whether ``model`` is the wrapper ``torch.compile`` returns for a module."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # a torch without dynamo compiles nothing
        return False
    return isinstance(model, OptimizedModule)


def check_parameter_schedule(policy: StagePolicy, reshard_after_forward, shard_size: int,
                             offload_params: bool, overlap_param_gather: bool, model):
    """The parameter schedule's options once the stage is known: ``reshard_after_forward``
    as :func:`check_reshard_after_forward` returns it.

    Raises:
        TypeError: ``overlap_param_gather`` not a bool.
        ValueError: an int ``reshard_after_forward`` with ``offload_params``; stage 3 freeing
            units after forward in a ``torch.compile``'d model; ``overlap_param_gather`` at
            stage 3.
    """
    if not isinstance(overlap_param_gather, bool):
        raise TypeError(f"overlap_param_gather must be a bool, got "
                        f"{type(overlap_param_gather).__name__}")
    reshard_after_forward = check_reshard_after_forward(reshard_after_forward, shard_size)
    if not isinstance(reshard_after_forward, bool) and offload_params:
        raise ValueError(f"reshard_after_forward={reshard_after_forward} keeps a device "
                         f"copy for backward; it does not combine with offload_params=True")
    if policy.shards_params and reshard_after_forward and is_compiled(model):
        # [Note: stage 3 under torch.compile] A compiled graph saves the parameters it read in
        # forward for its backward; freeing a unit after forward and gathering it again
        # before backward swaps their storage (an in-place change autograd's version
        # counter rejects). Keeping units gathered from forward to backward works.
        raise ValueError("stage=3 with a torch.compile'd model needs "
                         "reshard_after_forward=False (a compiled graph keeps the parameters "
                         "it saved in forward for its backward, so a unit cannot be freed "
                         "and regathered in between)")
    if overlap_param_gather and policy.shards_params:
        raise ValueError(f"overlap_param_gather applies to stages 1-2 (stage "
                         f"{policy.stage} gathers each unit before its forward anyway)")
    return reshard_after_forward
