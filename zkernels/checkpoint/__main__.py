"""``python -m zkernels checkpoint consolidate PATH OUT [--dtype bf16]`` and ``verify PATH``
(``python -m zkernels.checkpoint ...`` runs the same :func:`main`)."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from .._cli import exit_quietly_on_broken_pipe
from .consolidate import EXPORT_DTYPES, consolidate_to_file, verify
from .errors import CheckpointError
from .pretrained import consolidate_to_pretrained


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
    c.add_argument("--hf", action="store_true",
                   help="write OUT as a Hugging Face model folder (model.safetensors, or "
                        "shards + model.safetensors.index.json), as zk.checkpoint."
                        "save_pretrained writes it")
    c.add_argument("--max-shard-size", default="5GB",
                   help="with --hf: bytes per file ('5GB', '500MB', an int)")
    c.add_argument("--config", default=None,
                   help="with --hf: a config.json (or a model folder holding one) to copy "
                        "beside the weights, so that from_pretrained loads OUT")
    v = sub.add_parser("verify", help="read every file and check every checksum")
    v.add_argument("path", help="checkpoint folder")
    args = ap.parse_args(argv)
    try:
        if args.command == "consolidate" and args.hf:
            consolidate_to_pretrained(args.path, args.out, args.max_shard_size, args.dtype,
                                      args.config)
        elif args.command == "consolidate":
            if args.config is not None:
                ap.error("--config applies to --hf output only")
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
