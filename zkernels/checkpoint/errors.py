"""What can be wrong with a checkpoint, as exception types a caller can tell apart.

Every message names the path (and file, block or parameter) at fault and what was expected.
"""
from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error ``zkernels.checkpoint`` raises about a checkpoint."""


class NotACheckpointError(CheckpointError, FileNotFoundError):
    """The path does not exist, or holds no zkernels manifest."""


class CorruptCheckpointError(CheckpointError):
    """A file is missing, truncated, unreadable, or fails its checksum; or the manifest is
    malformed or names a file outside the checkpoint folder."""


class UnsupportedVersionError(CheckpointError):
    """The checkpoint was written by a newer format version than this zkernels reads."""


class IncompatibleCheckpointError(CheckpointError, ValueError):
    """The checkpoint is sound but does not fit this model or optimizer (parameter names,
    shapes, param groups)."""


class SaveAbortedError(CheckpointError):
    """A save did not complete on every rank; the previous checkpoint at the path is intact."""
