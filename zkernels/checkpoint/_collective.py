"""Agreement across ranks at the checkpoint's phase boundaries.

Every phase of a save or a load ends with :func:`agree`: one tiny all-reduce that is both the
barrier and the verdict. A rank that failed raises its own error; the others learn which ranks
failed and raise too, instead of entering the next collective alone and waiting for a peer
that will never come. A peer that died makes the all-reduce itself fail (gloo: connection
closed) or time out (the process group's timeout): bounded either way.
"""
from __future__ import annotations

from typing import Optional

import torch

from .errors import CheckpointError


def agree(view, error: Optional[BaseException], what: str, then: str,
          error_type: type = CheckpointError) -> None:
    """Barrier with a verdict.

    Args:
        view: the :class:`~zkernels.checkpoint._view.OptimizerView` (its comm, rank, device).
        error: this rank's exception in the phase, or None.
        what: the phase, for messages (e.g. ``"writing its shard of ckpt/"``).
        then: what the failure means for the caller (e.g. ``"the previous checkpoint is
            intact"``).
        error_type: the exception raised on the ranks that did not fail themselves.
    """
    everyone = view.everyone  # all ranks, also with hybrid sharding
    flags = torch.zeros(everyone.world_size, dtype=torch.float32, device=view.device)
    if error is not None:
        flags[everyone.rank] = 1.0
    try:
        everyone.all_reduce(flags).wait()
    except Exception as exc:  # noqa: BLE001 - a dead or hung peer, whatever the backend says
        raise error_type(f"{what}: a peer rank did not answer ({type(exc).__name__}: "
                         f"{exc}); {then}") from (error or exc)
    failed = [r for r, f in enumerate(flags.tolist()) if f]
    if error is not None:
        raise error  # the most precise account, on the rank where it happened
    if failed:
        raise error_type(f"{what} failed on rank(s) {failed} (their own errors say why); "
                         f"{then}")
