"""``python -m zkernels <plan|demo|bench|checkpoint> [...]``: the package's command line.

Each subcommand's module is imported only when it runs, so one missing optional piece (the
benchmarks, matplotlib) never breaks the others.
"""
from __future__ import annotations

import importlib
import sys
from typing import List, Optional

SUBCOMMANDS = {
    "plan": ("zkernels.plan", "bytes per rank and traffic for each rung of the ZeRO ladder"),
    "demo": ("zkernels.demo.launch", "train a small GPT on N ranks at every rung and compare"),
    "bench": ("zkernels.bench.__main__", "kernel microbenchmarks"),
    "checkpoint": ("zkernels.checkpoint.__main__", "consolidate (full weights, for "
                   "load_state_dict) or verify a sharded checkpoint"),
}


def _usage() -> str:
    lines = ["usage: python -m zkernels <subcommand> [options]   (<subcommand> -h for help)",
             "       python -m zkernels --version", ""]
    lines += [f"  {name:10s} {doc}" for name, (_, doc) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from . import __version__
        print(f"zkernels {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"zkernels: unknown subcommand {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name = SUBCOMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            print(f"zkernels {name}: this installation has no {module_name} "
                  f"(the '{name}' subcommand is not available)", file=sys.stderr)
            return 2
        raise
    rc = module.main(rest)
    # A subcommand's main returns its exit status, or something else (rows) on success.
    return rc if isinstance(rc, int) and not isinstance(rc, bool) else 0


if __name__ == "__main__":
    from ._cli import exit_quietly_on_broken_pipe
    exit_quietly_on_broken_pipe(main)
