"""Reading a peer's ``.pt`` file: ``torch.load(weights_only=True)`` and a minimal allow-list.

[Note: what a DeepSpeed checkpoint pickles]
Beside tensors and plain containers (dict, list, tuple, OrderedDict, numbers, strings,
``torch.Size``), DeepSpeed 0.19's ZeRO 1-3 checkpoint files hold instances of three of its
own types (found by listing the GLOBAL opcodes of every file it writes at stages 1-3):

- ``deepspeed.runtime.zero.config.ZeroStageEnum`` (an ``int`` enum: the saving stage);
- ``deepspeed.utils.tensor_fragment.fragment_address`` (a dataclass ``numel, start``: where
  each parameter lies in a rank's fp32 flat group, stages 1-2);
- ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` (the static loss scaler's attributes).

None of them is imported (DeepSpeed is not a dependency): each name is mapped to a plain
stand-in below that only holds the saved values (an ``int``; an object whose attributes the
unpickler sets from the saved dict). Nothing else outside torch's own weights-only set is
allowed: a file naming any other global is refused with :class:`UnsafeCheckpointError`
naming it, before anything of it is used.
"""
from __future__ import annotations

import re

import torch

from .errors import CheckpointError


class UnsafeCheckpointError(CheckpointError):
    """A ``.pt`` file needs a type outside the allow-list to be unpickled; it names it."""


class DeepSpeedStage(int):
    """Stand-in for ``deepspeed.runtime.zero.config.ZeroStageEnum``: the stage number."""


class SavedAttributes:
    """Stand-in for a plain DeepSpeed object (``fragment_address``, ``LossScaler``): the
    unpickler sets its saved attributes, nothing runs."""

    def __repr__(self) -> str:
        return f"SavedAttributes({vars(self)})"


class _FragmentAddress(SavedAttributes):
    pass


class _LossScaler(SavedAttributes):
    pass


ALLOWED = [
    (DeepSpeedStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
]

_NAMED = re.compile(r"(?:GLOBAL|global|function|class) ?['\"]?([\w.]+)")


def load_pt(path: str):
    """The object in the ``.pt`` file ``path``, on the CPU, unpickled with
    ``weights_only=True`` and the allow-list of [Note: what a DeepSpeed checkpoint pickles].

    Raises:
        UnsafeCheckpointError: the file needs another type (named in the message).
        CheckpointError: the file cannot be read as a torch file.
    """
    try:
        with torch.serialization.safe_globals(ALLOWED):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - torch's UnpicklingError and zip errors
        msg = str(exc)
        if "Unsupported global" in msg or "unrecognized function" in msg \
                or "Weights only load failed" in msg:
            named = re.search(r"Unsupported global: GLOBAL ([\w.]+)", msg) \
                or re.search(r"unrecognized function ([^\s]+)", msg)
            what = named.group(1) if named else msg.splitlines()[0]
            raise UnsafeCheckpointError(
                f"{path}: refusing to unpickle {what}: only tensors, plain containers and "
                f"DeepSpeed's ZeroStageEnum, fragment_address and LossScaler are read from "
                f"a peer's checkpoint") from None
        raise CheckpointError(f"{path}: not a readable torch file ({msg.splitlines()[0]})") \
            from exc
