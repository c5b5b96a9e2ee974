"""zkernels.checkpoint save / load / consolidate against torch.save / torch.load of the same
state, on one process. Example:

    python benchmarks/checkpoint.py --numel 25000000 --out bench_results/checkpoint.json

The peer is what ``examples/train_gpt.py`` did before: ``torch.save({"model":
model.state_dict(), "opt": opt.state_dict()})`` (pickle + zip, one file per rank) and
``torch.load(weights_only=True)`` + ``load_state_dict``. Both write the same bytes (fp32
master = the parameters, two moments) into the page cache; fsync is off for both in the
timed rows (one row with it on, to show what durability costs on this disk). Reads come
from the page cache for both. Medians of ``--repeat`` runs, min and max beside them.
"""
import argparse
import os
import shutil
import sys
import tempfile
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import torch  # noqa: E402

import zkernels as zk  # noqa: E402
from zkernels.bench._common import format_table, gbps, metadata, timeit, write_json  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=25_000_000, help="parameters (fp32)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    ap.add_argument("--out", default=None, help="JSON rows here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    width = 1024
    layers = max(1, args.numel // (width * (width + 1)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = zk.ZeroOptimizer(model, stage=1, lr=1e-3)
    for st in opt.shard_update.states:   # non-trivial moments
        st.exp_avg.normal_()
        st.exp_avg_sq.uniform_()
        st.step = 3
    numel = sum(p.numel() for p in model.parameters())
    state_bytes = 3 * 4 * numel
    root = args.dir or tempfile.mkdtemp(prefix="zk-ckpt-bench-")
    ck, pt = os.path.join(root, "ck"), os.path.join(root, "state.pt")
    dev = torch.device("cpu")
    rows = []

    def row(name, peer, fn, num_bytes):
        t = timeit(fn, dev, repeat=args.repeat, warmup=1)
        rows.append(dict(op=name, peer=peer, median_ms=t["median_ms"], min_ms=t["min_ms"],
                         max_ms=t["max_ms"], GBps=gbps(num_bytes, t["median_ms"])))

    row("save", "zkernels", lambda: zk.checkpoint.save(opt, ck, fsync=False), state_bytes)
    row("save", "torch.save",
        lambda: torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, pt),
        state_bytes)
    row("save+fsync", "zkernels", lambda: zk.checkpoint.save(opt, ck, fsync=True), state_bytes)
    row("load", "zkernels", lambda: zk.checkpoint.load(opt, ck), state_bytes)

    def torch_load():
        sd = torch.load(pt, weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])
    row("load", "torch.load", torch_load, state_bytes)
    out = os.path.join(root, "w.safetensors")
    row("consolidate", "zkernels",
        lambda: zk.checkpoint.consolidate_to_file(ck, out), 4 * numel)
    try:
        from safetensors.torch import save_file
        row("consolidate", "safetensors.save_file(state_dict)",
            lambda: save_file(model.state_dict(), out), 4 * numel)
    except ImportError:
        pass
    buf = os.urandom(64 << 20)
    row("crc32 (zlib)", "-", lambda: zlib.crc32(buf), len(buf))
    meta = dict(metadata(dev), numel=numel, state_bytes=state_bytes)
    print(f"{numel:,} fp32 parameters, {state_bytes / 2**20:.0f} MiB of optimizer state, "
          f"{args.threads} thread(s), page cache warm")
    print(format_table(rows, ["op", "peer", "median_ms", "min_ms", "max_ms", "GBps"]))
    if args.out:
        write_json(args.out, [meta] + rows)
    if args.dir is None:
        shutil.rmtree(root)
    return rows


if __name__ == "__main__":
    main()
