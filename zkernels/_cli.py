"""What the subcommands (plan, demo, bench, checkpoint) share on their command lines: argparse
types that check a value before any work starts, so that a bad option costs one clear line
(argparse's ``error: argument --json: ...``, exit status 2), never a run that dies at its end;
and the entry point's exit, quiet when the reader of stdout has gone (``... | head``).
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
from typing import Callable, List, NoReturn, Optional

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
UNIT_NAMES = "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)"


def output_file(text: str) -> str:
    """An argparse ``type=`` for a file the command will write: its folder must exist and be
    writable, and the path must not be a folder. Nothing is created (a typo in a folder name
    must not leave a new folder behind)."""
    if not text:
        raise argparse.ArgumentTypeError("needs a file name")
    path = os.path.abspath(os.path.expanduser(text))
    folder = os.path.dirname(path)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file name")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"the folder {folder} does not exist (create it "
                                         f"first)")
    if not os.access(folder, os.W_OK | os.X_OK) or (
            os.path.exists(path) and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text!r} is not writable")
    return text


def writable_folder(text: str) -> str:
    """An argparse ``type=`` for ``--offload-dir``: an existing folder that can hold files,
    probed by writing (``ZeroOptimizer``'s own check of ``offload_dir``), so that ``/proc``,
    which exists and takes no file, is one usage line before any rank starts. Nothing is
    left behind."""
    if not text or not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an existing folder")
    from .zero.state.swap import OffloadIOError, check_writable
    try:
        check_writable(text)
    except OffloadIOError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace(f"offload_dir={text!r}",
                                                          repr(text), 1)) from None
    return text


def parse_bytes(text: str, name: str = "--device-memory", bare_unit: str = "") -> int:
    """A size with its unit -> bytes: '80GB' -> 80e9, '24GiB' -> 24 * 2**30, '1.5e9B'.

    A bare number is refused unless ``bare_unit`` names its unit ('B' for a flag whose name
    says bytes): '16' could mean 16 GB or 16 GiB, or 16 bytes, and a plan computed for the
    wrong one is silently wrong. Raises ValueError naming ``name``.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = (m.group(2) or bare_unit).lower() if m else ""
    if m and not m.group(2) and not bare_unit:
        raise ValueError(f"{name} needs a unit, got the bare number {text!r}: write e.g. "
                         f"{m.group(1)}GB or {m.group(1)}GiB ({UNIT_NAMES})")
    if not m or unit not in _UNITS:
        raise ValueError(f"{name} must be a size like 80GB, 24GiB or 512MiB ({UNIT_NAMES}), "
                         f"got {text!r}")
    return int(float(m.group(1)) * _UNITS[unit])


def byte_size(name: str, bare_unit: str = ""):
    """An argparse ``type=`` wrapping :func:`parse_bytes` for the flag ``name``."""
    def parse(text: str) -> int:
        try:
            return parse_bytes(text, name, bare_unit)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).replace(f"{name} ", "", 1)) from None
    parse.__name__ = "size"      # argparse's fallback message says "invalid size value"
    return parse


def positive_int(text: str) -> int:
    """An argparse ``type=``: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def param_count(text: str) -> int:
    """An argparse ``type=``: a number of parameters, a whole number >= 1 ('7.5e9' is fine)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of parameters like 7.5e9, got "
                                         f"{text!r}") from None
    if not math.isfinite(value) or value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"must be a whole number of parameters >= 1, got "
                                         f"{text!r}")
    return int(value)


def exit_quietly_on_broken_pipe(main: Callable[[Optional[List[str]]], object],
                                argv: Optional[List[str]] = None) -> NoReturn:
    """``sys.exit(main(argv))`` for a ``python -m`` entry point, without a BrokenPipeError
    traceback when stdout's reader exits early (``python -m zkernels plan ... | head``).

    Python ignores SIGPIPE, so a write to a closed pipe raises BrokenPipeError, in a print or
    in the flush at exit. As Python's documentation of SIGPIPE recommends: flush inside the
    ``try``, and on the error point stdout at devnull (so that the flush at interpreter exit
    has nowhere to fail) and exit with status 1. argparse's ``-h`` exits through SystemExit
    with its text still buffered, so that exit is flushed here too.
    """
    try:
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        rc = 1
    sys.exit(rc)
