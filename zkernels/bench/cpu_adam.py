"""Benchmark section "cpu_adam": the native CPU AdamW against its peers, same run, same threads.

Rows (per size): the machine's in-place bandwidth (``a.add_(b, alpha=s)``, 12 B/elem), the
native AdamW (28 B/param: read p, g, m, v; write p, m, v), ``torch.optim.AdamW(fused=True)``
and ``(foreach=True)``, DeepSpeed's ``DeepSpeedCPUAdam`` when importable, and the whole
offloaded step (bf16 grads in, unscale, AdamW, params out as bf16) natively in one pass
against torch's separate casts (``grad.float() / scale``, fused AdamW, ``out.copy_(param)``).
Medians over repeats with min/max; GB/s counts the bytes the step must move at least.

Self-contained timing/table code: ``run(args)`` returns the rows, ``main()`` prints the table
and writes JSON (``python -m zkernels.bench.cpu_adam --help``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
ADAM_BYTES = 28          # fp32 p, g, m, v read + p, m, v written
OFFLOAD_BYTES = 12 + 2 + 12 + 2  # p, m, v read, bf16 grad read, p, m, v written, bf16 out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numels", type=int, nargs="+", default=[16 * 2**20, 64 * 2**20])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default="bench_results/cpu_adam.json")
    return ap


def _time(fn: Callable[[], None], repeats: int, warmup: int) -> Dict[str, float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return dict(median_ms=1e3 * statistics.median(times), min_ms=1e3 * min(times),
                max_ms=1e3 * max(times))


def _row(name: str, numel: int, threads: int, bytes_per: int, t: Dict[str, float],
         **extra) -> dict:
    gbps = bytes_per * numel / (t["median_ms"] * 1e-3) / 1e9
    return dict(section="cpu_adam", name=name, numel=numel, threads=threads,
                bytes_per_elem=bytes_per, gbps=gbps, **t, **extra)


def _bandwidth(n: int, threads: int, reps: int, warm: int) -> dict:
    a, b = torch.rand(n), torch.rand(n)
    t = _time(lambda: a.add_(b, alpha=1e-3), reps, warm)
    return _row("bandwidth a.add_(b, alpha=s)", n, threads, 12, t)


def _state(n: int):
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    return p, torch.randn(n, generator=gen), torch.zeros(n), torch.rand(n) * 1e-3


def _native_adam(n: int, threads: int, reps: int, warm: int) -> dict:
    from zkernels import _cpu
    p, g, m, v = _state(n)
    step = [0]

    def fn():
        step[0] += 1
        _cpu.adamw_step(p, g, m, v, step=step[0], **HYPER)
    return _row("zkernels cpu adamw (fp32 grads)", n, threads, ADAM_BYTES, _time(fn, reps, warm))


def _torch_adam(n: int, threads: int, reps: int, warm: int, mode: str) -> dict:
    p, g, _, _ = _state(n)
    param = torch.nn.Parameter(p)
    param.grad = g
    opt = torch.optim.AdamW([param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                            eps=HYPER["eps"], weight_decay=HYPER["weight_decay"],
                            **{mode: True})
    return _row(f"torch.optim.AdamW({mode}=True)", n, threads, ADAM_BYTES,
                _time(opt.step, reps, warm))


def _deepspeed_adam(n: int, threads: int, reps: int, warm: int) -> Optional[dict]:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:  # noqa: BLE001 - not installed or its op fails to build: no row
        return None
    p, g, _, _ = _state(n)
    param = torch.nn.Parameter(p)
    param.grad = g
    opt = DeepSpeedCPUAdam([param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                           eps=HYPER["eps"], weight_decay=HYPER["weight_decay"],
                           adamw_mode=True)
    return _row("deepspeed DeepSpeedCPUAdam", n, threads, ADAM_BYTES, _time(opt.step, reps, warm))


def _offload(n: int, threads: int, reps: int, warm: int) -> List[dict]:
    from zkernels import _cpu
    scale = 1024.0
    p, g32, m, v = _state(n)
    grad = (g32 * scale).to(torch.bfloat16)
    del g32
    out = torch.empty(n, dtype=torch.bfloat16)
    step = [0]

    def native():
        step[0] += 1
        _cpu.adamw_step(p, grad, m, v, step=step[0], grad_scale=scale, out=out, **HYPER)
    mine = _row("offload step: zkernels one pass (bf16 g in, bf16 p out)", n, threads,
                OFFLOAD_BYTES, _time(native, reps, warm))
    param = torch.nn.Parameter(p)
    opt = torch.optim.AdamW([param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                            eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], fused=True)

    def separate():
        param.grad = grad.float() / scale
        opt.step()
        out.copy_(param.detach())
    peer = _row("offload step: torch fused AdamW + separate casts", n, threads, OFFLOAD_BYTES,
                _time(separate, reps, warm))
    mine.update(peer=peer["name"], speedup=peer["median_ms"] / mine["median_ms"])
    return [mine, peer]


def _meta() -> dict:
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=Path(__file__).resolve().parent).stdout.strip()
    except OSError:
        rev = ""
    from zkernels import _cpu
    isa = _cpu._C.cpu_best_isa() if _cpu.AVAILABLE else "none"
    return dict(machine=model, num_cpus=os.cpu_count(), torch=torch.__version__,
                python=platform.python_version(), git_rev=rev or "unknown", cpu_isa=isa,
                time_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="seconds"))


def run(args: Optional[argparse.Namespace] = None) -> List[dict]:
    """Measure every row at ``args.threads`` threads (torch and native alike).

    Args:
        args: ``parser()``'s namespace (numels, threads, repeats, warmup); None: defaults.

    Returns:
        One dict per row: name, numel, threads, median/min/max ms, gbps, and for the native
        rows the peer's name with ``frac_of_bandwidth`` or ``speedup``; plus machine info.
    """
    from zkernels import _cpu
    if not _cpu.AVAILABLE:
        raise RuntimeError(f"zkernels._C is not built ({_cpu.IMPORT_ERROR}); "
                           "run `python setup.py build_ext --inplace` or `pip install -e .`")
    args = args if args is not None else parser().parse_args([])
    before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    meta, rows = _meta(), []
    try:
        for n in args.numels:
            reps, warm = args.repeats, args.warmup
            bw = _bandwidth(n, args.threads, reps, warm)
            mine = _native_adam(n, args.threads, reps, warm)
            mine.update(peer=bw["name"], frac_of_bandwidth=mine["gbps"] / bw["gbps"])
            peers = [_torch_adam(n, args.threads, reps, warm, "fused"),
                     _torch_adam(n, args.threads, reps, warm, "foreach")]
            ds = _deepspeed_adam(n, args.threads, reps, warm)
            peers += [ds] if ds else []
            mine["speedup_vs_torch_fused"] = peers[0]["median_ms"] / mine["median_ms"]
            rows += [bw, mine, *peers, *_offload(n, args.threads, reps, warm)]
    finally:
        torch.set_num_threads(before)
    return [dict(r, **meta) for r in rows]


def table(rows: List[dict]) -> str:
    head = f"{'numel':>10} {'thr':>3} {'row':<58} {'median ms':>10} {'min..max':>17} " \
           f"{'GB/s':>7}  vs peer"
    lines = [head, "-" * len(head)]
    for r in rows:
        note = ""
        if "frac_of_bandwidth" in r:
            note = f"{100 * r['frac_of_bandwidth']:.0f}% of bandwidth, " \
                   f"{r['speedup_vs_torch_fused']:.2f}x torch fused"
        elif "speedup" in r:
            note = f"{r['speedup']:.2f}x"
        lines.append(f"{r['numel']:>10} {r['threads']:>3} {r['name']:<58} "
                     f"{r['median_ms']:>10.2f} {r['min_ms']:>8.2f}..{r['max_ms']:<8.2f} "
                     f"{r['gbps']:>7.2f}  {note}")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    rows = run(args)
    print(f"# {rows[0]['machine']} | torch {rows[0]['torch']} | isa {rows[0]['cpu_isa']} | "
          f"git {rows[0]['git_rev']} | {rows[0]['time_utc']}")
    print(table(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
