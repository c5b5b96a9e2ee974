"""A checkpoint folder replaced atomically: the temporary folder beside it, the two renames
that publish it, and the recovery from a writer that died part way. ``save`` (ours) and
``export_dcp`` (torch's DCP layout) publish through it, so a crash while saving either
leaves the previous folder, or the new one, whole ([Note: the save protocol] in save.py)."""
from __future__ import annotations

import os
import shutil
from typing import Callable

from .errors import CheckpointError

TMP_SUFFIX = ".zk-tmp"
OLD_SUFFIX = ".zk-old"


def prepare(path: str, is_ours: Callable[[str], bool], refusal: str) -> str:
    """Make ``PATH.zk-tmp`` empty and return it; first recover what an earlier writer left:
    a ``PATH.zk-old`` is renamed back where it died between the two renames (no ``PATH``),
    else deleted. An existing ``path`` that ``is_ours`` does not recognise is refused with
    ``refusal`` (an empty folder is taken)."""
    tmp, old = path + TMP_SUFFIX, path + OLD_SUFFIX
    if os.path.lexists(old):
        if not os.path.lexists(path) and is_ours(old):
            os.rename(old, path)    # an earlier writer died between its two renames
        else:
            shutil.rmtree(old)      # an earlier writer died before deleting it
    if os.path.lexists(path) and not is_ours(path):
        if not (os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path)):
            raise CheckpointError(refusal)
        os.rmdir(path)
    if os.path.lexists(tmp):
        shutil.rmtree(tmp)          # an earlier writer died before publishing
    os.makedirs(tmp)
    return tmp


def publish(path: str, fsync: bool) -> None:
    """``PATH`` -> ``PATH.zk-old``, ``PATH.zk-tmp`` -> ``PATH``, then ``PATH.zk-old`` deleted;
    with ``fsync`` the new folder and the parent are flushed around the renames."""
    tmp, old = path + TMP_SUFFIX, path + OLD_SUFFIX
    if fsync:
        fsync_dir(tmp)
    if os.path.lexists(path):
        os.rename(path, old)
    os.rename(tmp, path)
    if fsync:
        fsync_dir(os.path.dirname(path))
    if os.path.lexists(old):
        shutil.rmtree(old)


def write_bytes(path: str, data: bytes, fsync: bool) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
