"""``python -m zkernels.bench``: run the benchmark sections, print a table per section and
write every row (after one metadata row) as JSON.

[Note: benchmark sections]
A section is a module ``zkernels.bench.<name>`` listed in ``SECTIONS`` that defines
``run(args) -> list[dict]``: one dict per measurement, JSON-serializable, with at least
``section`` and, for timings, ``median_ms``/``min_ms``/``max_ms``. ``args`` is the namespace
parsed here: ``sizes`` (list of element counts, or None for the section's own defaults),
``ops`` (names to run, or None for all), ``threads``, ``repeat``, ``warmup``, ``device``
(None: CUDA when present, else CPU). A section may define ``COLUMNS`` (the keys its table
shows, in order) and ``legend(rows) -> str | None`` (printed under its table).
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional, Sequence

import torch

from .._cli import output_file
from ._common import SectionUnavailable, format_table, metadata, write_json

SECTIONS = ["kernels", "cpu_adam", "cpu_optim"]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m zkernels.bench",
                                 description="zkernels microbenchmarks (see [Note: benchmark "
                                             "sections] in zkernels/bench/__main__.py)")
    ap.add_argument("--sections", nargs="+", default=None, choices=SECTIONS,
                    help=f"sections to run (default: all of {SECTIONS})")
    ap.add_argument("--sizes", nargs="+", type=int, default=None,
                    help="element counts (default: each section's own, sized to the device)")
    ap.add_argument("--ops", nargs="+", default=None, help="ops to run (default: all)")
    ap.add_argument("--json", type=output_file, default=None, metavar="PATH",
                    help="write all rows to this file (its folder must exist)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: 1 when the device is the CPU, where "
                         "oversubscribed OpenMP threads make timings meaningless; torch's own "
                         "setting otherwise)")
    ap.add_argument("--repeat", type=int, default=5, help="timed calls per measurement")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls first")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    return ap


def _check(ap: argparse.ArgumentParser, args) -> torch.device:
    """Refuse what cannot run, before any of it runs (argparse's one line, exit status 2)."""
    if args.repeat < 1:
        ap.error(f"argument --repeat: must be >= 1, got {args.repeat}")
    if args.warmup < 0:
        ap.error(f"argument --warmup: must be >= 0, got {args.warmup}")
    if any(n < 1 for n in args.sizes or []):
        ap.error(f"argument --sizes: must all be >= 1, got {args.sizes}")
    if args.threads is not None and args.threads < 1:
        ap.error(f"argument --threads: must be >= 1, got {args.threads}")
    if args.ops is not None:
        from .kernels import OPS    # the one section that takes --ops
        unknown = [o for o in args.ops if o not in OPS]
        if unknown:
            ap.error(f"argument --ops: unknown {', '.join(unknown)} (choose from "
                     f"{', '.join(OPS)})")
    if args.device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        ap.error(f"argument --device: cpu or cuda, got {args.device!r}")
    if device.type not in ("cpu", "cuda"):
        ap.error(f"argument --device: cpu or cuda, got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("argument --device: cuda, but torch sees no CUDA device here (a CPU-only "
                 "torch, or no GPU): use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        ap.error(f"argument --device: {args.device}, but this machine has "
                 f"{torch.cuda.device_count()} CUDA device(s)")
    return device


def main(argv: Optional[Sequence[str]] = None) -> List[dict]:
    ap = parser()
    args = ap.parse_args(argv)
    device = _check(ap, args)
    if args.threads is None and device.type == "cpu":
        args.threads = 1
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    meta = metadata(device)
    print(", ".join(f"{k}={v}" for k, v in meta.items() if k != "kind"))
    rows = [meta]
    for name in args.sections or SECTIONS:
        module = importlib.import_module(f"{__package__}.{name}")
        try:
            section_rows = module.run(args)
        except SectionUnavailable as exc:
            print(f"\n== {name}: skipped: {exc}")
            continue
        rows.extend(section_rows)
        columns = getattr(module, "COLUMNS", None) or sorted({k for r in section_rows for k in r})
        print(f"\n== {name} ({len(section_rows)} rows)")
        print(format_table(section_rows, columns))
        legend = getattr(module, "legend", None)
        text = legend(section_rows) if legend else None
        if text:
            print("peers:\n" + text)
    if args.json:
        write_json(args.json, rows)
        print(f"\nwrote {len(rows)} rows to {args.json}")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
