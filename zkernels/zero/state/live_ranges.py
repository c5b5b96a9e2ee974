"""The shard ranges the fused AdamW updates, and their step counts ([Note: unused
parameters] in ``gradients/presence.py``).

A unit's shard holds slices of several parameters; each parameter has its own AdamW step
count (torch's ``state["step"]``, which advances only when the parameter has a gradient). The
update runs once per maximal run of parameters that have a gradient and share a step count.
When every parameter has one and all counts agree (the common case) that is one call over the
whole shard, padding included, exactly as before.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

Segment = Tuple[int, int, int]   # [lo, hi) in the shard, the step count to apply


def live_segments(slices: Sequence[Tuple[int, int, int]], numel: int,
                  param_steps: Sequence[int], live: Optional[Sequence[bool]]
                  ) -> Tuple[List[Segment], bool]:
    """The ranges to update and the new step counts.

    Args:
        slices: ``(param_index, start_in_shard, length)`` of each parameter in the shard, in
            shard order (``FlatLayout.tensor_slices_in_shard``).
        numel: the shard's elements.
        param_steps: each parameter's step count before this step (updated in place).
        live: a flag per parameter (it has a gradient), or None: all have one.

    Returns:
        ``(segments, whole)``: ``[lo, hi, step]`` ranges (the step counted after this update),
        and whether they are the whole shard (nothing is skipped).
    """
    steps = list(param_steps)
    for i in range(len(steps)):
        if live is None or live[i]:
            param_steps[i] += 1
    if live is None and len(set(steps)) <= 1:
        return [(0, numel, (steps[0] if steps else 0) + 1)], True
    out: List[Segment] = []
    for i, s, n in slices:
        if not (live is None or live[i]) or n == 0:
            continue
        step = param_steps[i]
        if out and out[-1][1] == s and out[-1][2] == step:
            out[-1] = (out[-1][0], s + n, step)
        else:
            out.append((s, s + n, step))
    return out, False


def clip(segments: Sequence[Segment], lo: int, hi: int) -> List[Segment]:
    """``segments`` within ``[lo, hi)``, relative to ``lo``."""
    return [(max(a, lo) - lo, min(b, hi) - lo, st) for a, b, st in segments
            if a < hi and b > lo]
