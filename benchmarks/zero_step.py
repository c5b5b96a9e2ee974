"""One training step of a small GPT on CPU, 2 gloo ranks: DDP, torch's ZeroRedundancyOptimizer,
FSDP2, DeepSpeed and zkernels ZeRO side by side, with step time, bytes sent and memory per rank.
The rows are ``_zero_step_methods.METHODS`` (a new one is one line there).

    python benchmarks/zero_step.py                       # small config, the default rows
    python benchmarks/zero_step.py --config demo --methods ddp,zk_stage1,zk_stage2 --repeats 3
    python benchmarks/zero_step.py --config large --dtype bfloat16 --repeats 3
    python benchmarks/zero_step.py --steps 3 --config tiny --methods ddp,zk_stage2
    python benchmarks/zero_step.py --world-size 4 --shard-size 2   # hybrid: FSDP2 HSDP beside
    python benchmarks/zero_step.py --offload             # offload rows (cpu, nvme) and peers
    python benchmarks/zero_step.py --quantized           # ZeRO++ options beside DeepSpeed's
    python benchmarks/zero_step.py --baseline-tree DIR   # zkernels rows again from DIR: ratios
    python benchmarks/zero_step.py --optimizer sgd       # or muon: peers with the same optimizer

Prints a table and writes JSON (``--json``, default ``bench_results/zero_step.json``):
``{"meta": {machine, cpu, threads_per_rank, versions, git revision, UTC time, config,
comm_bytes_convention}, "rows": [{method, step_time_s {median, min, max}, comm_bytes_per_rank
{all_reduce, reduce_scatter, all_gather, broadcast, other, total}, memory_bytes_per_rank
{params, grads, master, optimizer_states, buffers, total}, final_loss, step_time_ratio_to_ddp,
step_time_ratio_to_ddp_paired, traffic_ratio_to_ddp, within_5pct_of_ddp, traffic_equal_to_ddp,
...}]}``.
The issue's bar: zkernels stage 1/2 step time at most 1.05x DDP's (the paired ratio, median
over ``--repeats`` runs: ``"repeats"`` in the JSON), traffic equal to DDP's, stage 2's memory
per rank at most stage 1's and within 5% of its formula (4Ψ + 12Ψ/N in fp32, 2Ψ + 16Ψ/N with
bf16 params) plus two buckets. All methods train with AdamW on the same data from the same
initial weights (fp32, or ``--dtype bfloat16``: zkernels with ``param_dtype=torch.bfloat16``
beside the torch rows under bf16 autocast), so the final losses agree to round-off in fp32: a
quick sign that every row trained the same model.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import traceback
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    # 0.83 M parameters: ~35 ms of compute per step alone on one core, ~100-150 ms per step
    # with 2 ranks (one core each, DDP) on the shared 2-core dev machine
    "small": {"model": dict(n_layer=4, n_head=4, n_embd=128, block_size=64), "batch_size": 8},
    # seconds for the whole run: a smoke check
    "tiny": {"model": dict(n_layer=2, n_head=2, n_embd=64, block_size=32), "batch_size": 4},
    # the demo's model and batch at its defaults (python -m zkernels demo)
    "demo": {"model": dict(n_layer=4, n_head=2, n_embd=128, block_size=64), "batch_size": 8},
    # 6.4 M parameters: eight times the demo's compute and traffic per step
    "large": {"model": dict(n_layer=8, n_head=4, n_embd=256, block_size=64), "batch_size": 8},
}
DTYPES = ("float32", "bfloat16")
# The rows themselves: _zero_step_methods.METHODS. These are the sets the flags pick.
ALL_METHODS = ("ddp", "torch_zero", "fsdp2", "zk_stage1", "zk_stage2", "deepspeed", "zk_stage3",
               "deepspeed_stage3")
# --offload: the offload comparison (issue 9), each beside its non-offloaded stage.
OFFLOAD_SET = ("ddp", "zk_stage2", "zk_stage2_cpu", "zk_stage2_nvme", "ds_stage2_cpu",
               "ds_stage2_nvme", "zk_stage3", "zk_stage3_cpu", "zk_stage3_cpu_params",
               "zk_stage3_nvme", "zk_stage3_nvme_params", "ds_stage3_cpu",
               "ds_stage3_cpu_params", "fsdp2", "fsdp2_cpu_offload")
# --shard-size K: hybrid sharding (groups of K ranks, replicated across), beside the plain rows.
HYBRID_SET = ("ddp", "fsdp2", "zk_stage3", "fsdp2_hsdp", "zk_stage3_hybrid", "zk_stage2",
              "zk_stage2_hybrid")
# --quantized: ZeRO++'s compressed collectives (issue 17), zkernels' options beside DeepSpeed's.
QUANT_SET = ("ddp", "zk_stage2", "zk_stage2_qg8", "zk_stage3", "zk_stage3_qw", "zk_stage3_qg8",
             "zk_stage3_qg4", "zk_stage3_qw_qg4", "deepspeed_stage3", "ds_stage3_qw",
             "ds_stage3_qg", "ds_stage3_qw_qg")
# --optimizer sgd|muon: stages 1-3 beside ZeroRedundancyOptimizer and DeepSpeed's stages 1-3.
OPTIMIZER_SET = ("ddp", "torch_zero", "zk_stage1", "zk_stage2", "zk_stage3", "deepspeed_stage1",
                 "deepspeed", "deepspeed_stage3")
OPTIMIZER_PEERS = (("zk_stage1", "torch_zero"), ("zk_stage1", "deepspeed_stage1"),
                   ("zk_stage2", "deepspeed"), ("zk_stage3", "deepspeed_stage3"))

# --baseline-tree without --methods: every zkernels rung that runs on 2 ranks, DDP beside.
BASELINE_SET = ("ddp", "zk_stage1", "zk_stage2", "zk_stage3", "zk_stage2_cpu", "zk_stage2_nvme",
                "zk_stage3_cpu", "zk_stage3_cpu_params", "zk_stage3_nvme", "zk_stage3_nvme_params")


def _on_path() -> None:
    """Run from anywhere: this checkout's zkernels and the benchmark's modules first (the
    spawned ranks copy sys.path)."""
    for path in (str(REPO_ROOT), str(REPO_ROOT / "benchmarks")):
        if path not in sys.path:
            sys.path.insert(0, path)


def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="timed steps per method")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per method first")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--config", choices=sorted(CONFIGS), default="small")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="float32, or bfloat16 (zkernels param_dtype, torch rows autocast)")
    p.add_argument("--repeats", type=int, default=1,
                   help="independent runs (fresh ranks each); ratios: median over runs")
    p.add_argument("--methods", default=None,
                   help="comma-separated rows of _zero_step_methods.METHODS (default: "
                   f"{','.join(ALL_METHODS)}; with --dtype bfloat16: the rows marked bf16)")
    p.add_argument("--offload", action="store_true", help="run the offload comparison: "
                   + ",".join(OFFLOAD_SET) + " (overrides --methods)")
    p.add_argument("--offload-dir", default=None, help="folder for the NVMe rows (default: a "
                   "new temporary folder under /tmp, removed afterwards)")
    p.add_argument("--nvme-budget", type=int, default=256 * 1024, help="host RAM bytes of "
                   "zkernels' NVMe slots (default 256 KiB: the small GPT's moments per rank "
                   "are >10x that)")
    p.add_argument("--shard-size", type=int, default=None, metavar="K",
                   help="hybrid sharding: groups of K consecutive ranks (K divides "
                   "--world-size); default methods " + ",".join(HYBRID_SET) + "; every row's "
                   "bytes are split within / across groups")
    p.add_argument("--optimizer", default="adamw", help="what every row trains with: adamw, "
                   "sgd (momentum 0.9) or muon (on the 2-D matrices, AdamW on the rest); "
                   "sgd/muon default methods " + ",".join(OPTIMIZER_SET))
    p.add_argument("--json", default="bench_results/zero_step.json", help="output path")
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=900.0,
                   help="kill every rank after this long instead of hanging")
    p.add_argument("--quantized", action="store_true", help="run the compressed-collective "
                   "comparison: " + ",".join(QUANT_SET) + " (overrides --methods)")
    p.add_argument("--baseline-tree", default=None, metavar="DIR", help="run the zkernels rows "
                   "a second time with zkernels imported from the checkout DIR (with its "
                   "compiled _C), and report after/before ratios of step time, memory and "
                   "traffic per row (benchmarks/README.md: before and after in one run)")
    _on_path()
    from _zero_step_methods import METHODS, OPTIMIZERS
    known = tuple(METHODS)
    bf16 = tuple(m for m, spec in METHODS.items() if spec.bf16)
    args = p.parse_args(argv)
    if args.shard_size is not None and (args.shard_size < 1
                                        or args.world_size % args.shard_size):
        p.error(f"--shard-size must be >= 1 and divide --world-size ({args.world_size}), got "
                f"{args.shard_size}")
    if args.optimizer not in OPTIMIZERS:
        p.error(f"--optimizer must be one of {','.join(OPTIMIZERS)}, got {args.optimizer!r}")
    if args.methods is None:
        args.methods = ",".join(HYBRID_SET if args.shard_size is not None else
                                OPTIMIZER_SET if args.optimizer != "adamw" else
                                BASELINE_SET if args.baseline_tree is not None else
                                ALL_METHODS if args.dtype == "float32" else bf16)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.offload or args.quantized:
        methods = list(OFFLOAD_SET if args.offload else QUANT_SET)
    bad = [m for m in methods if m not in known]
    if bad or not methods:
        p.error(f"--methods: expected a comma-separated subset of {known}, got {bad}")
    if "ddp" not in methods:
        methods.insert(0, "ddp")  # every ratio is to DDP measured in the same run
    args.methods = methods
    for name, low in (("steps", 1), ("world_size", 1), ("threads_per_rank", 1), ("repeats", 1),
                      ("warmup", 0)):
        if getattr(args, name) < low:
            p.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if args.dtype != "float32" and any(m not in bf16 for m in methods):
        p.error(f"--dtype {args.dtype}: only {','.join(bf16)} run in bf16 here, got "
                f"{','.join(m for m in methods if m not in bf16)}")
    if args.baseline_tree is not None:
        args.baseline_tree = str(Path(args.baseline_tree).resolve())
        if not (Path(args.baseline_tree) / "zkernels" / "__init__.py").is_file():
            p.error(f"--baseline-tree: expected a zkernels checkout (DIR/zkernels/__init__.py), "
                    f"got {args.baseline_tree!r}")
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(run, rank: int, world_size: int, port: int, opts: dict, queue) -> None:
    """One spawned rank: ``opts["threads_per_rank"]`` threads (1), a gloo group, then ``run(rank,
    world_size, opts)``; puts ``(rank, True, its result)`` or ``(rank, False, traceback)``."""
    from datetime import timedelta

    import torch.distributed as dist
    try:
        torch.set_num_threads(opts.get("threads_per_rank", 1))
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=opts.get("pg_timeout_s", 1800)))
        try:
            result = run(rank, world_size, opts)
        finally:
            dist.destroy_process_group()
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        queue.put((rank, False, traceback.format_exc()))


def launch(run, opts: dict, world_size: int, timeout_s: float) -> list:
    """``run(rank, world_size, opts)`` on each of ``world_size`` spawned gloo ranks; return
    each rank's result, or raise with the failing rank's trace. Also the launcher of
    hook_path.py, after_backward.py and build_peak.py."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(run, r, world_size, port, opts, queue),
                         daemon=True) for r in range(world_size)]
    for proc in procs:
        proc.start()
    results, errors = {}, {}
    try:
        for _ in range(world_size):
            try:
                rank, ok, payload = queue.get(timeout=timeout_s)
            except Exception as exc:  # queue.Empty
                raise RuntimeError(f"ranks did not finish within {timeout_s}s") from exc
            (results if ok else errors)[rank] = payload
            if errors:
                break
    finally:
        for proc in procs:
            proc.join(timeout=10 if not errors else 1)
            if proc.is_alive():
                proc.kill()
    if errors:
        rank = min(errors)
        raise RuntimeError(f"rank {rank} failed:\n{errors[rank]}")
    return [results[r] for r in range(world_size)]


def _check_trees(per_rank: list, opts: dict) -> None:
    """Every rank imported zkernels from the checkouts it was given (the before/after
    comparison measures what it says it does)."""
    from _zero_step_trees import BEFORE

    want = {"": str(Path(opts["zk_root"]).resolve() / "zkernels")}
    if opts.get("baseline_root"):
        want[BEFORE] = str(Path(opts["baseline_root"]).resolve() / "zkernels")
    for r in per_rank:
        if r["_zkernels"] != want:
            raise RuntimeError(f"a rank imported zkernels from {r['_zkernels']}, expected {want}")


def _stage3_verdict(rows: list, num_params: int, n: int) -> None:
    """Issue 8's bar for the zk_stage3 row: step time <= 1.25x DDP and below fsdp2's and
    deepspeed_stage3's (same run), traffic 3.00Ψ (Ψ = 4·num_params·(N-1)/N bytes per rank, the
    ring volume of one fp32 pass), memory within 2% of 16Ψ/N plus the gathered units' bound and
    the reduce buffers (memory is measured between steps, where nothing is gathered: the
    gathered units count there as what ``stats()`` says is gathered then). Adds
    ``traffic_psi`` to every row."""
    psi_bytes = 4 * num_params * (n - 1) / n
    by = {r["method"]: r for r in rows if "error" not in r}
    for r in by.values():
        r["traffic_psi"] = r["comm_bytes_per_rank"]["total"] / psi_bytes if psi_bytes else None
    z = by.get("zk_stage3")
    if z is None:
        return
    peers = {m: by[m]["step_time_s"]["median"] for m in ("fsdp2", "deepspeed_stage3") if m in by}
    t = z["step_time_s"]["median"]
    mem = z["memory_bytes_per_rank"]
    gather = (z.get("zk_stats_last") or {}).get("gather", {})
    bound = 16 * num_params / n + gather.get("gathered_bytes", 0) + mem.get("buffers", 0)
    z["stage3_bar"] = {
        "time_ratio_to_ddp": z["step_time_ratio_to_ddp"],
        "within_1_25x_ddp": z["step_time_ratio_to_ddp"] <= 1.25,
        "below_peers": {m: t < pt for m, pt in peers.items()},
        "traffic_psi": z["traffic_psi"],
        "memory_total": mem.get("total"), "memory_16psi_over_n_plus_gathered_and_buffers": bound,
        "memory_within_2pct": abs(mem.get("total", 0) - bound) <= 0.02 * bound,
        "peak_gathered_bytes": gather.get("peak_gathered_bytes"),
        "gather_limit_bytes": gather.get("limit_bytes"),
    }
    print(f"zk_stage3: x{z['step_time_ratio_to_ddp']:.3f} DDP (bar 1.25), "
          + ", ".join(f"{'below' if t < pt else 'NOT below'} {m} (x{t / pt:.3f})"
                      for m, pt in peers.items())
          + f"; traffic {z['traffic_psi']:.3f}Ψ (bar 3.00; "
          + ", ".join(f"{m} {by[m]['traffic_psi']:.3f}Ψ" for m in peers)
          + f"); memory held between steps {mem.get('total', 0) / 2**20:.2f} MiB vs 16Ψ/N + "
          f"gathered + buffers {bound / 2**20:.2f} MiB (x{mem.get('total', 0) / bound:.4f}); "
          f"peak gathered in the step {gather.get('peak_gathered_bytes', 0) / 2**20:.2f} MiB "
          f"(bound {gather.get('limit_bytes', 0) / 2**20:.2f} MiB)")


def main(argv=None) -> int:
    args = _parse_args(argv)
    from zkernels.demo.model import GPT, GPTConfig
    from _comm_meter import __doc__ as convention_doc
    from _zero_step_worker import run
    from zkernels.bench._common import cpu_model, git_revision
    from _zero_step_report import (add_ratios, check_memory, compare_trees, format_baseline,
                                   format_table, repeat_summary, summarize)

    config = CONFIGS[args.config]
    num_params = sum(p.numel() for p in GPT(GPTConfig(**config["model"])).parameters())
    cleanup, nvme = None, any("_nvme" in m for m in args.methods)
    if nvme and args.offload_dir is None:
        import tempfile
        args.offload_dir = cleanup = tempfile.mkdtemp(prefix="zk-bench-nvme-")
    # every flag (methods, steps, warmup, lr, seed, dtype, shard_size, nvme_budget, ...) and:
    opts = dict(vars(args), model=config["model"], batch_size=config["batch_size"],
                zk_root=str(REPO_ROOT), pg_timeout_s=min(120.0, args.timeout_s))
    n = args.world_size
    meta = {
        "benchmark": "zero_step",
        "utc_time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_revision": git_revision(),
        "machine": {"hostname": platform.node(), "platform": platform.platform(),
                    "arch": platform.machine(), "num_cpus": os.cpu_count()},
        "cpu": cpu_model(),
        "threads_per_rank": args.threads_per_rank,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "backend": "gloo", "device": "cpu", "world_size": n, "dtype": args.dtype,
        "shard_size": args.shard_size,
        "repeats": args.repeats,
        "config": args.config, "model": config["model"], "batch_size_per_rank":
            config["batch_size"], "num_params": num_params,
        "data": "random tokens, one micro-batch per rank per step, same for every method",
        "steps": args.steps, "warmup": args.warmup, "optimizer": {
            "adamw": f"AdamW(lr={args.lr})",
            "sgd": f"SGD(lr={args.lr}, momentum=0.9)",
            "muon": f"Muon(lr=0.02) on 2-D non-embedding matrices, AdamW(lr={args.lr}) on the "
                    f"rest"}[args.optimizer],
        # 2Ψ per step in the ring convention: what DDP and ZeRO-1/2 should each send per rank
        "data_parallel_bytes_per_rank": 2 * num_params * 4 * (n - 1) / n,
        "comm_bytes_convention": convention_doc.split("[Note: byte convention]")[1]
                                 .split("\n\n")[0].strip(),
        "step_time": "max over ranks of barrier-to-barrier time per step; median, min, max",
    }
    print(f"zero_step: {args.config} GPT ({num_params / 1e6:.2f} M params), {n} gloo ranks x "
          f"{args.threads_per_rank} thread, {args.dtype}, batch {config['batch_size']}x"
          f"{config['model']['block_size']} per rank, {args.warmup} warm-up + {args.steps} "
          f"timed steps, methods {','.join(args.methods)}, {args.repeats} run(s)", flush=True)
    meta["load_average_before"] = os.getloadavg()
    if args.baseline_tree is not None:  # the zkernels rows again, zkernels from that checkout
        from _zero_step_methods import METHODS
        from _zero_step_trees import BEFORE
        opts["baseline_root"] = meta["baseline_tree"] = args.baseline_tree
        # each row beside its twin: the round order then differs between the two only by
        # which one goes first (_zero_step_worker.py alternates that)
        opts["methods"] = [x for m in args.methods
                           for x in ([m, m + BEFORE] if METHODS[m].lib == "zk" else [m])]
    runs = []
    try:
        for _ in range(args.repeats):
            per_rank = launch(run, opts, n, args.timeout_s)
            _check_trees(per_rank, opts)
            rows = [summarize(m, [r[m] for r in per_rank], n) for m in opts["methods"]]
            # bf16: zkernels rounds its parameters to bf16, autocast keeps fp32 ones: losses
            # part by bf16 round-off (~1e-2 after a few dozen steps), and DDP all-reduces fp32
            # grads (8Ψ sent) where zkernels sends an fp32 reduce-scatter + a bf16 all-gather
            # (6Ψ).
            add_ratios(rows, loss_tolerance=1e-4 if args.dtype == "float32" else 5e-2,
                       lossy=_quantized)
            check_memory(rows, num_params, n, args.dtype)
            runs.append(rows)
            print(format_table(rows), flush=True)
    finally:
        if cleanup is not None:
            import shutil
            shutil.rmtree(cleanup, ignore_errors=True)
    meta["nvme_budget_bytes"] = args.nvme_budget if nvme else None
    meta["load_average_after"] = os.getloadavg()
    rows = runs[-1]
    repeats = repeat_summary(runs)
    print(f"\nAR/RS/AG/BC/A2A: all-reduce / reduce-scatter / all-gather / broadcast / other "
          f"(all-to-all: zkernels' reduce-scatter on gloo, see [Note: reduce-scatter over gloo] "
          f"in zkernels/comm/torch_comm.py) MiB sent per "
          f"rank per step (ring convention; mean over ranks); memory: the fullest rank. "
          f"<=1.05: paired step time at most 1.05x DDP's; =DDP: traffic equal to DDP's (within "
          f"0.1%). "
          f"Data-parallel ideal 2Ψ(N-1)/N = {meta['data_parallel_bytes_per_rank'] / 2**20:.2f} "
          f"MiB.")
    for r in rows:
        if r["method"] in ("zk_stage1", "zk_stage2"):
            rep = repeats.get(r["method"])
            verdict = ("not measured: " + r["error"].splitlines()[0]) if "error" in r or \
                rep is None else (
                f"paired x{rep['paired_ratio_median']:.3f} DDP (median of "
                f"{len(rep['paired_ratios'])} run(s): "
                f"{', '.join(f'{x:.3f}' for x in rep['paired_ratios'])}), <= 1.05: "
                f"{'yes' if rep['within_5pct_of_ddp'] else 'no'}; traffic = DDP: "
                f"{'yes' if r['traffic_equal_to_ddp'] else 'no'}"
                f" (x{r['traffic_ratio_to_ddp'] or float('nan'):.4f})"
                + (f"; {r['memory_verdict']}" if "memory_verdict" in r else ""))
            print(f"{r['method']}: {verdict}")
    _stage3_verdict(rows, num_params, n)
    _hybrid_verdict(rows)
    _quant_verdict(rows)
    _offload_verdicts(rows, meta)
    if args.optimizer != "adamw":
        for ours, peer, _, _, ratio, paired in _vs_peers(rows, OPTIMIZER_PEERS):
            print(f"{args.optimizer}: {ours} vs {peer}: step x{ratio:.3f} (paired x{paired:.3f})")
        for r in rows:
            if "error" in r:
                lines = r["error"].strip().splitlines()
                print(f"{args.optimizer}: {r['method']} not run: "
                      + " ... ".join(dict.fromkeys((lines[0], lines[-1]))))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"meta": meta, "rows": rows, "repeats": repeats, "runs": runs[:-1]}
    if args.baseline_tree is not None:
        result["baseline"] = compare_trees(runs)
        print(format_baseline(result["baseline"], args.baseline_tree, len(runs)))
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


def _hybrid_verdict(rows) -> None:
    """Issue 16's bar: zkernels hybrid stage 3 no slower than FSDP2 HSDP in the same run
    (``--shard-size``); both rows' bytes within and across groups."""
    for ours, peer, zk, fs, ratio, paired in _vs_peers(rows, (
            ("zk_stage3_hybrid", "fsdp2_hsdp"), ("zk_stage2_hybrid", "fsdp2_hsdp"),
            ("zk_stage3_hpz", "fsdp2_hpz"))):
        zs, fsc = zk.get("comm_scopes_per_rank", {}), fs.get("comm_scopes_per_rank", {})
        print(f"{ours} vs {peer}: x{ratio:.3f} (paired per-step x{paired:.3f}): "
              f"{'no slower' if paired <= 1.0 else 'SLOWER'}; MiB/rank/step within/across: "
              f"{zs.get('within_group', 0) / 2**20:.3f}/{zs.get('across_groups', 0) / 2**20:.3f}"
              f" vs {fsc.get('within_group', 0) / 2**20:.3f}/"
              f"{fsc.get('across_groups', 0) / 2**20:.3f}")


def _vs_peers(rows, pairs):
    """For each ``(ours, peer)`` of ``pairs`` where both rows ran: ``(ours, peer, our row,
    peer row, ratio of the median steps, median of the per-step ratios)``; both ratios go
    into our row (``step_time_ratio_to_<peer>``, ``..._paired``)."""
    by = {r["method"]: r for r in rows if "error" not in r}
    for ours, peer in pairs:
        zk, other = by.get(ours), by.get(peer)
        if zk and other:
            ratio = zk["step_time_s"]["median"] / other["step_time_s"]["median"]
            paired = statistics.median(
                a / b for a, b in zip(zk["step_times_s"], other["step_times_s"]))
            zk[f"step_time_ratio_to_{peer}"] = ratio
            zk[f"step_time_ratio_to_{peer}_paired"] = paired
            yield ours, peer, zk, other, ratio, paired


def _spec(method: str):
    """The table row of ``method`` (a baseline twin ``name@before`` has its row's spec)."""
    from _zero_step_methods import METHODS
    return METHODS[method.partition("@")[0]]


def _quantized(method: str) -> bool:
    return any(k.startswith(("quantize_", "zero_quantized_")) for k in _spec(method).kw)


def _quant_verdict(rows) -> None:
    """Issue 17: each quantized row (``quantize_*``, DeepSpeed's ``zero_quantized_*``) beside
    the same row without quantization in the same run (and from the same tree, for
    ``--baseline-tree`` twins): bytes sent, step time, final loss. Adds ``quantized_vs``."""
    def base(method):
        spec = _spec(method)
        return (spec.lib, method.partition("@")[2], tuple(sorted(
            (k, v) for k, v in spec.kw.items()
            if not k.startswith(("quantize_", "zero_quantized_")))))

    by = {r["method"]: r for r in rows if "error" not in r}
    plain = {base(m): m for m in by if not _quantized(m)}
    for name, r in by.items():
        peer = plain.get(base(name))
        if peer is None or not _quantized(name):
            continue
        p = by[peer]
        r["quantized_vs"] = {
            "method": peer,
            "traffic_ratio": r["comm_bytes_per_rank"]["total"] / p["comm_bytes_per_rank"]["total"],
            "step_time_ratio": r["step_time_s"]["median"] / p["step_time_s"]["median"],
            "final_loss_rel_diff": (r["final_loss"] - p["final_loss"]) / p["final_loss"]}
        q = r["quantized_vs"]
        print(f"{name} vs {peer}: sent x{q['traffic_ratio']:.3f}, step x{q['step_time_ratio']:.3f}"
              f", final loss {100 * q['final_loss_rel_diff']:+.2f}%")


def _offload_verdicts(rows, meta) -> None:
    """The offload issue's bars: zk stage 2 cpu offload faster than DeepSpeed's in the same
    run; NVMe host RAM within its budget while the moments are >= 10x the budget."""
    for ours, peer, _, _, ratio, paired in _vs_peers(rows, (
            ("zk_stage2_cpu", "ds_stage2_cpu"), ("zk_stage3_cpu", "ds_stage3_cpu"),
            ("zk_stage3_cpu_params", "ds_stage3_cpu_params"),
            ("zk_stage3_cpu_params", "fsdp2_cpu_offload"))):
        print(f"{ours} vs {peer}: x{ratio:.3f} (paired per-step x{paired:.3f}): "
              f"{'faster' if ratio < 1 else 'NOT faster'}")
    by = {r["method"]: r for r in rows if "error" not in r}
    for name in ("zk_stage2_nvme", "zk_stage3_nvme", "zk_stage3_nvme_params"):
        nv = by.get(name)
        if not (nv and meta.get("nvme_budget_bytes")):
            continue
        st = nv["zk_stats_last"]
        host = nv["memory_location_bytes_per_rank"]["host"]
        moments = max(m["optimizer_states"] for m in nv["memory_bytes_by_rank"])
        budget = meta["nvme_budget_bytes"]
        nv["nvme_state_to_budget_ratio"] = moments / budget
        # offload_params: the parameter shards are files too, read through two host bounces
        # of the largest unit shard, outside the slot budget (param_nvme.py)
        bounces = st["offload"].get("param_bounce_bytes", 0)
        nv["nvme_host_within_budget"] = host - bounces <= budget
        print(f"{name}: host RAM {host - bounces} B <= budget {budget} B: "
              f"{'yes' if host - bounces <= budget else 'NO'}"
              + (f" (+ {bounces} B of parameter bounces, offload_params; the parameter "
                 f"shards are files: {st['memory_bytes_by_location']['disk']['params']} B)"
                 if bounces else "")
              + f"; moments on disk {moments} B = {moments / budget:.1f}x the budget; "
              f"O_DIRECT: {st['offload'].get('direct_io')}")
    blocked = [r for r in rows if r["method"] == "ds_stage2_nvme" and "error" in r]
    if blocked:
        print(f"ds_stage2_nvme: blocked here: {blocked[0]['error'].splitlines()[0]}")


if __name__ == "__main__":
    sys.exit(main())
