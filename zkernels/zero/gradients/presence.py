"""Which parameters have a gradient this step: torch's ``grad is None`` across ranks.

[Note: unused parameters]
``torch.optim.AdamW`` skips a parameter whose ``.grad`` is None: its moments do not decay, no
weight decay applies and its step count (its bias correction) does not advance. A flat unit
reduces one gradient buffer, where a parameter backward never reached holds zeros, so without
more the fused update would treat it as a zero gradient. So each gradient bucket marks, in its
post-accumulate-grad hook (also inside ``no_sync``), which of its parameters received a
gradient since the last ``zero_grad()``; at ``step()`` the ranks agree with one all-reduce
(max) of a per-parameter byte mask (one byte per trainable parameter: P bytes, metered as
``all_reduce``; a model with 1,000 parameter tensors sends 1 kB per step beside its 2Psi):
a parameter has a gradient iff any rank produced one, which is what the averaged gradient of
DDP-style data parallelism means (its reduced gradient is that rank's contribution / N). The
update engine then runs the fused AdamW only over the shard ranges of the parameters that have
one, with each parameter's own step count (``ShardState.param_steps``, see
``state/live_ranges.py``). Torch semantics is the default, ``unused_grads="skip"``.

DDP differs: with ``find_unused_parameters=True`` it all-reduces zeros for a parameter no rank
used, so ``param.grad`` is a zero tensor (not None) and the optimizer applies a zero-gradient
update (moments decay, weight decay applies, the step count advances). ``unused_grads="zero"``
does that: every parameter is updated every step (and no mask is sent), which is also what this
package did before. We default to single-process torch because ZeRO's promise is "the same run
as ``torch.optim`` on one process", and a parameter used on some steps (a routed expert, a
conditional head) trained differently there is a silent divergence.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

UNUSED_GRADS = ("skip", "zero")


def check_unused_grads(value) -> str:
    """``value`` if it is one of :data:`UNUSED_GRADS`.

    Raises:
        ValueError: anything else.
    """
    if not isinstance(value, str) or value not in UNUSED_GRADS:
        raise ValueError(f"unused_grads must be one of {UNUSED_GRADS} ('skip': torch's "
                         f"semantics, a parameter without a gradient is not updated; 'zero': "
                         f"DDP's, it gets a zero-gradient update), got {value!r}")
    return value


class GradPresence:
    """Per unit, which parameters received a gradient since the last :meth:`reset`.

    Args:
        sizes: the number of parameters of each unit, by unit index.
    """

    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes = list(sizes)
        self._starts = [0]
        for n in self.sizes:
            self._starts.append(self._starts[-1] + n)
        self._mask = bytearray(self._starts[-1])   # (a hook's write: no tensor op)

    @property
    def nbytes(self) -> int:
        """The bytes :meth:`agree` all-reduces."""
        return len(self._mask)

    def mark(self, unit_index: int, param_index: int) -> None:
        self._mask[self._starts[unit_index] + param_index] = 1

    def reset(self) -> None:
        self._mask[:] = bytes(len(self._mask))

    def agree(self, comm, device: torch.device) -> List[Optional[List[bool]]]:
        """Collective: per unit, None where every parameter has a gradient on some rank,
        else a flag per parameter (any rank produced one)."""
        mask = torch.frombuffer(bytearray(self._mask), dtype=torch.uint8).to(device) \
            if self._mask else torch.zeros(0, dtype=torch.uint8, device=device)
        if comm.world_size > 1:
            comm.all_reduce(mask, op="max").wait()
        flags = mask.cpu().tolist()
        out: List[Optional[List[bool]]] = []
        for u, n in enumerate(self.sizes):
            f = [bool(x) for x in flags[self._starts[u]:self._starts[u] + n]]
            out.append(None if all(f) else f)
        return out
