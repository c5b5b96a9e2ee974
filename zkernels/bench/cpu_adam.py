"""Benchmark section "cpu_adam": the native CPU AdamW against its peers, same run, same threads.

Rows (per size): the machine's in-place bandwidth (``a.add_(b, alpha=s)``, 12 B/elem), the
native AdamW (28 B/param: read p, g, m, v; write p, m, v), ``torch.optim.AdamW(fused=True)``
and ``(foreach=True)``, DeepSpeed's ``DeepSpeedCPUAdam`` when importable, and the whole
offloaded step (bf16 grads in, unscale, AdamW, params out as bf16) natively in one pass
against torch's separate casts (``grad.float() / scale``, fused AdamW, ``out.copy_(param)``).
Candidates are timed in interleaved rounds (load drifting over the run hits all alike);
medians with min/max; GB/s counts the bytes the step must move at least.

Self-contained timing/table code: ``run(args)`` returns the rows, ``main()`` prints the table
and writes JSON (``python -m zkernels.bench.cpu_adam --help``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from ._common import SectionUnavailable, format_table, metadata

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
ADAM_BYTES = 28          # fp32 p, g, m, v read + p, m, v written
OFFLOAD_BYTES = 12 + 2 + 12 + 2  # p, m, v read, bf16 grad read, p, m, v written, bf16 out


DEFAULT_NUMELS = [16 * 2**20, 64 * 2**20]
# The table ``python -m zkernels.bench`` prints for this section (see [Note: benchmark sections]).
COLUMNS = ["name", "numel", "threads", "median_ms", "min_ms", "max_ms", "gbps",
           "frac_of_bandwidth", "speedup_vs_torch_fused", "speedup"]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=None,
                    help=f"parameter counts (default {DEFAULT_NUMELS})")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default="bench_results/cpu_adam.json")
    return ap


def _time_interleaved(fns: Dict[str, Callable[[], None]], repeats: int,
                      warmup: int) -> Dict[str, Dict[str, float]]:
    """Median/min/max ms of each callable, timed in rounds (a, b, c, a, b, c, ...) so that
    load from other processes drifting over the run hits every candidate alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: dict(median_ms=1e3 * statistics.median(ts), min_ms=1e3 * min(ts),
                       max_ms=1e3 * max(ts)) for name, ts in times.items()}


def _row(name: str, numel: int, threads: int, bytes_per: int, t: Dict[str, float],
         **extra) -> dict:
    gbps = bytes_per * numel / (t["median_ms"] * 1e-3) / 1e9
    return dict(section="cpu_adam", name=name, numel=numel, threads=threads,
                bytes_per_elem=bytes_per, gbps=gbps, **t, **extra)


def _state(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    return p, torch.randn(n, generator=gen), torch.zeros(n), torch.rand(n) * 1e-3


def _torch_opt(cls, n: int, grad: Optional[torch.Tensor] = None, **kw):
    p, g, _, _ = _state(n)
    param = torch.nn.Parameter(p)
    param.grad = g if grad is None else grad
    return param, cls([param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                      eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], **kw)


def _stepper(p, g, m, v, **kw) -> Callable[[], None]:
    from zkernels import _cpu
    step = [0]

    def fn():
        step[0] += 1
        _cpu.adamw_step(p, g, m, v, step=step[0], **HYPER, **kw)
    return fn


def _plain_rows(n: int, threads: int, reps: int, warm: int) -> List[dict]:
    """Bandwidth, native AdamW and its optimizer peers, timed interleaved."""
    a, b = torch.rand(n), torch.rand(n)
    fns = {BW: lambda: a.add_(b, alpha=1e-3), NATIVE: _stepper(*_state(n))}
    keep = []  # optimizers and params stay alive for the whole timing
    for name, mode in ((FUSED, "fused"), (FOREACH, "foreach")):
        keep.append(_torch_opt(torch.optim.AdamW, n, **{mode: True}))
        fns[name] = keep[-1][1].step
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        keep.append(_torch_opt(DeepSpeedCPUAdam, n, adamw_mode=True))
        fns[DEEPSPEED] = keep[-1][1].step
    except Exception:  # noqa: BLE001 - not installed, or its op cannot build here: no row
        pass
    t = _time_interleaved(fns, reps, warm)
    rows = {name: _row(name, n, threads, 12 if name == BW else ADAM_BYTES, t[name])
            for name in fns}
    mine = rows[NATIVE]
    mine.update(peer=BW, frac_of_bandwidth=mine["gbps"] / rows[BW]["gbps"],
                speedup_vs_torch_fused=rows[FUSED]["median_ms"] / mine["median_ms"])
    return list(rows.values())


def _offload_rows(n: int, threads: int, reps: int, warm: int) -> List[dict]:
    """The offloaded step: bf16 grads in, unscale, AdamW, bf16 params out."""
    scale = 1024.0
    p, g32, m, v = _state(n)
    grad = (g32 * scale).to(torch.bfloat16)
    del g32
    out = torch.empty(n, dtype=torch.bfloat16)
    param, opt = _torch_opt(torch.optim.AdamW, n, fused=True)
    out_torch = torch.empty(n, dtype=torch.bfloat16)

    def separate():
        param.grad = grad.float() / scale
        opt.step()
        out_torch.copy_(param.detach())
    fns = {OFF_NATIVE: _stepper(p, grad, m, v, grad_scale=scale, out=out),
           OFF_TORCH: separate}
    t = _time_interleaved(fns, reps, warm)
    mine = _row(OFF_NATIVE, n, threads, OFFLOAD_BYTES, t[OFF_NATIVE])
    peer = _row(OFF_TORCH, n, threads, OFFLOAD_BYTES, t[OFF_TORCH])
    mine.update(peer=OFF_TORCH, speedup=peer["median_ms"] / mine["median_ms"])
    return [mine, peer]


BW = "bandwidth a.add_(b, alpha=s)"
NATIVE = "zkernels cpu adamw (fp32 grads)"
FUSED = "torch.optim.AdamW(fused=True)"
FOREACH = "torch.optim.AdamW(foreach=True)"
DEEPSPEED = "deepspeed DeepSpeedCPUAdam"
OFF_NATIVE = "offload step: zkernels one pass (bf16 g in, bf16 p out)"
OFF_TORCH = "offload step: torch fused AdamW + separate casts"


def _meta() -> dict:
    """The shared metadata row plus what matters for a CPU-bound run."""
    from zkernels import _cpu
    return dict(metadata(torch.device("cpu")), kind="meta", cpu_isa=_cpu._C.cpu_best_isa(),
                omp_num_threads=os.environ.get("OMP_NUM_THREADS", "unset"),
                load_avg_1min=os.getloadavg()[0])


def run(args: Optional[argparse.Namespace] = None) -> List[dict]:
    """Measure every row at ``args.threads`` threads (torch and native alike).

    Args:
        args: ``parser()``'s namespace or ``python -m zkernels.bench``'s (sizes, threads,
            repeat, warmup); None: defaults.

    Returns:
        One dict per row: name, numel, threads, median/min/max ms, gbps, and for the native
        rows the peer's name with ``frac_of_bandwidth`` or ``speedup``; plus machine info.
    """
    from zkernels import _cpu
    if not _cpu.AVAILABLE:
        raise SectionUnavailable(f"zkernels._C is not built ({_cpu.IMPORT_ERROR}); "
                           "run `python setup.py build_ext --inplace` or `pip install -e .`")
    args = args if args is not None else parser().parse_args([])
    before = torch.get_num_threads()
    threads = args.threads or before
    torch.set_num_threads(threads)
    meta, rows = _meta(), []
    try:
        for n in args.sizes or DEFAULT_NUMELS:
            rows += _plain_rows(n, threads, args.repeat, args.warmup)
            rows += _offload_rows(n, threads, args.repeat, args.warmup)
    finally:
        torch.set_num_threads(before)
    return [dict(r, section="cpu_adam", **{k: meta[k] for k in ("cpu_isa", "load_avg_1min")})
            for r in rows]


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    rows = run(args)
    meta = _meta()
    print(", ".join(f"{k}={v}" for k, v in meta.items() if k != "kind"))
    print(format_table(rows, COLUMNS))
    rows = [meta] + rows
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
