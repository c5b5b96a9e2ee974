"""The state format per param group: fp32, bf16 or blockwise int8 moments (the fused AdamW),
or a fused element-wise rule's low-bit form (those its definition lists: bf16 states).

``ZeroOptimizer(state_dtype=...)`` (and a param group's ``"state_dtype"`` key) are read here,
once: :func:`split_group_formats` takes the key out of the groups (a torch class never sees it)
and :func:`group_formats` gives each group its :class:`StateFormat` (None: fp32 moments, the
fused AdamW as before). The engine keeps the moments of a group with a format in it (see
[Note: low-bit state in shards] in ``state/lowbit_state.py``); the estimator counts their
bytes with :func:`state_bytes`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

_NAMES = {"fp32": None, "float32": None, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "int8": "int8"}


def parse_state_dtype(value, name: str = "state_dtype"):
    """None (fp32 moments), ``torch.bfloat16`` or ``"int8"`` from a dtype or a name.

    Raises:
        ValueError: naming ``name`` and what is accepted.
    """
    if value is None or value is torch.float32:
        return None
    if value is torch.bfloat16:
        return torch.bfloat16
    if isinstance(value, str) and value.lower() in _NAMES:
        return _NAMES[value.lower()]
    raise ValueError(f"{name} must be None (fp32 moments), torch.bfloat16 or 'int8', got "
                     f"{value!r} (names accepted: {', '.join(sorted(_NAMES))})")


@dataclass(frozen=True)
class StateFormat:
    """A group's low-bit moments: ``dtype`` torch.bfloat16 or "int8", and the int8 format's
    ``block_size`` (elements per fp32 scale)."""

    dtype: object
    block_size: int = 256

    @property
    def name(self) -> str:
        return "bf16" if self.dtype == torch.bfloat16 else "int8"

    @property
    def blocked(self) -> bool:
        return self.dtype == "int8"

    def num_blocks(self, numel: int) -> int:
        return -(-numel // self.block_size) if self.blocked else 0


def state_bytes(numel: int, fmt: Optional[StateFormat]) -> int:
    """Bytes of both AdamW moments over ``numel`` elements: fp32 8/element, bf16 4, int8 2 plus
    two fp32 scales per block."""
    if fmt is None:
        return 8 * numel
    if not fmt.blocked:
        return 4 * numel
    return 2 * numel + 8 * fmt.num_blocks(numel)


def split_group_formats(param_groups: Optional[Sequence[dict]]
                        ) -> Tuple[Optional[List[dict]], List[object]]:
    """``(groups without "state_dtype", each group's key)``: the key's value, or the
    sentinel ``...`` where a group does not set it (the optimizer's ``state_dtype`` applies)."""
    if param_groups is None or not isinstance(param_groups, (list, tuple)):
        return param_groups, []
    out, keys = [], []
    for g in param_groups:
        if isinstance(g, dict) and "state_dtype" in g:
            keys.append(g["state_dtype"])
            g = {k: v for k, v in g.items() if k != "state_dtype"}
        else:
            keys.append(...)
        out.append(g)
    return out, keys


def group_formats(specs: Sequence, keys: Sequence, state_dtype, block_size: int
                  ) -> List[Optional[StateFormat]]:
    """Each group's :class:`StateFormat` (None: fp32 moments).

    Args:
        specs: each group's ``OptimizerSpec`` (a torch class keeps its own fp32 state).
        keys: :func:`split_group_formats`' values (``...``: not set), or empty.
        state_dtype, block_size: the optimizer's default and the int8 block size (checked by
            ``StateConfig``).

    Raises:
        ValueError: a low-bit format asked of a group that runs a torch class, or a form the
            group's definition does not have (named).
    """
    out = []
    for gi, spec in enumerate(specs):
        key = keys[gi] if gi < len(keys) else ...
        where = "state_dtype" if key is ... else f"param_groups[{gi}]['state_dtype']"
        dtype = state_dtype if key is ... else parse_state_dtype(key, where)
        fmt = None if dtype is None else StateFormat(dtype, block_size)
        if fmt is not None and spec.definition is not None:   # a fused element-wise rule:
            spec.definition.check_form(fmt.name, where)        # the forms its definition has
        elif fmt is not None and not spec.fused:
            raise ValueError(f"{where}={dtype!r} applies to the fused AdamW only; "
                             f"param_groups[{gi}] runs torch.optim.{spec.name}, whose state "
                             f"the class keeps in fp32 (give that group 'state_dtype': None)")
        out.append(fmt)
    return out


def block_align(formats: Sequence[Optional[StateFormat]]) -> int:
    """The element alignment every parameter and shard start needs so that no quantization
    block crosses a parameter's or a shard's boundary (1: no blocked format)."""
    return max([f.block_size for f in formats if f is not None and f.blocked], default=1)


def moment_bytes(fmt: Optional[StateFormat]) -> int:
    """Bytes of one element of one moment: fp32 4, bf16 2, int8 1 (scales apart)."""
    return 4 if fmt is None else 2 if not fmt.blocked else 1


def slot_moments(formats: Sequence[Optional[StateFormat]]) -> Tuple[int, int]:
    """``(moment_bytes, block_size)`` of an NVMe slot that holds any of ``formats``' moments
    (the widest moment; ``block_size`` 0 where no format is blocked): the slot arena's shape
    (``offload_config.nvme_slot_views``)."""
    bs = block_align(formats)
    return max(map(moment_bytes, formats), default=4), bs if bs > 1 else 0
