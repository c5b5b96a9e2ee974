"""``python -m zkernels checkpoint consolidate PATH OUT [--dtype bf16]`` and ``verify PATH``
(``python -m zkernels.checkpoint ...`` runs the same :func:`main`)."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from .._cli import exit_quietly_on_broken_pipe
from .consolidate import EXPORT_DTYPES, consolidate_to_file, verify
from .errors import CheckpointError


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zkernels checkpoint",
                                 description="zkernels sharded checkpoints")
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="full weights of a checkpoint, for "
                                           "model.load_state_dict")
    c.add_argument("path", help="checkpoint folder")
    c.add_argument("out", help="output: *.safetensors (streamed, small memory) or *.pt "
                              "(plain tensors: torch.load(out, weights_only=True))")
    c.add_argument("--dtype", choices=sorted(EXPORT_DTYPES), default=None,
                   help="cast floating-point tensors (default: fp32 masters, rest as saved)")
    v = sub.add_parser("verify", help="read every file and check every checksum")
    v.add_argument("path", help="checkpoint folder")
    args = ap.parse_args(argv)
    try:
        if args.command == "consolidate":
            consolidate_to_file(args.path, args.out, args.dtype)
            print(f"wrote {args.out}")
        else:
            info = verify(args.path)
            print(f"{args.path}: {info['files']} files, {info['bytes']} bytes, every "
                  f"checksum matches")
    except (CheckpointError, ValueError) as exc:
        print(f"zkernels checkpoint: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    exit_quietly_on_broken_pipe(main)
