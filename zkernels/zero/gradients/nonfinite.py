"""What a step does with an inf/NaN gradient outside fp16's loss scaling: the ``nonfinite``
policy of :class:`ZeroOptimizer`.

[Note: non-finite gradients outside fp16]
In fp16 an inf/NaN gradient is an expected overflow of the scaled loss: the step is skipped
and the loss scale halves (precision.py). In fp32 and bf16 nothing rescales, and before this
policy such a gradient reached AdamW: its moments and the master weights turned NaN, silently
and for good. Now every step finds out, on every rank, whether any gradient element anywhere
is non-finite, from the same all-reduced sum of squares that clipping and loss scaling use
(see clip.py's Note), and:

- ``"skip"`` (default): the step changes nothing on any rank (params, master, moments, step
  counters of the buckets), ``stats()["overflow_skips"]`` counts it (the counter of every
  skipped step, fp16 overflows included; ``stats()["step"]`` counts the ``step()`` call), and
  rank 0 logs one WARNING per skipped step on the ``zkernels.zero`` logger.
- ``"raise"``: every rank raises :class:`NonFiniteGradientError` naming the step and, on the
  rank whose shard holds it, the first non-finite parameter (located only on this error path,
  without a collective); nothing was updated, and ``stats()`` counts the call as a step and a
  skip, so training can go on after ``zero_grad()``.

Squares of finite gradients above ~1.8e19 also overflow the fp32 sum: such a gradient counts as
non-finite (no trainable gradient is that large; bf16 could represent it, and it says so).
"""
from __future__ import annotations

import logging
from typing import Dict, List, Sequence

import torch

POLICIES = ("skip", "raise")
log = logging.getLogger("zkernels.zero")


class NonFiniteGradientError(FloatingPointError):
    """A gradient had an inf/NaN element under ``nonfinite="raise"``."""


def check_policy(nonfinite) -> str:
    if nonfinite not in POLICIES:
        raise ValueError(f"nonfinite must be one of {POLICIES}, got {nonfinite!r}")
    return nonfinite


def locate(shards: Sequence[torch.Tensor], buckets, names: Dict[int, str], rank: int) -> str:
    """Where this rank's gradient shards hold their first non-finite element (error path
    only: one ``isfinite`` per shard until it is found)."""
    for b, g in zip(buckets, shards):
        bad = (~torch.isfinite(g)).nonzero()
        if bad.numel() == 0:
            continue
        at = int(bad[0, 0])
        for i, start, in_shard, length in b.layout.tensor_slices_in_shard(rank):
            if in_shard <= at < in_shard + length:
                p = b.params[i]
                return (f"first in {names.get(id(p), f'a parameter of shape {tuple(p.shape)}')}"
                        f" (flat element {start + at - in_shard}) on rank {rank}")
    return f"not in rank {rank}'s gradient shards (another rank owns it)"


def on_nonfinite(policy: str, step: int, rank: int, where) -> None:
    """Apply ``policy`` to step ``step`` (1-based ``step()`` call) whose gradients are
    non-finite; ``where()`` says where (called only when raising)."""
    what = (f"step {step}: a gradient has an inf/NaN element (or squares summing past fp32's "
            f"range)")
    if policy == "raise":
        raise NonFiniteGradientError(f"{what}, {where()}; nothing was updated "
                                     f"(nonfinite='raise')")
    if rank == 0:
        log.warning("%s: skipped on every rank, nothing updated (nonfinite='skip'; "
                    "stats()['overflow_skips'] counts it)", what)


__all__: List[str] = ["POLICIES", "NonFiniteGradientError", "check_policy", "locate",
                      "on_nonfinite"]
