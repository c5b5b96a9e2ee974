"""Benchmark section "cpu_optim": the native CPU Lion, SGD and low-bit AdamW beside their
peers, same run, same threads.

Rows (per size): the native SGD with momentum and weight decay (20 B/param: p, g, b read;
p, b written) beside ``torch.optim.SGD(foreach=True)``
(``_multi_tensor_sgd``, the issue's peer) and ``(fused=True)`` where torch has it; the native
Lion (20 B/param: p, g, m read, p, m written) beside ``zkernels.reference.lion_step`` (torch
has no Lion; the reference is the plain-PyTorch composition a user would write); and the
offloaded SGD step (bf16 grads in, unscale, SGD, bf16 params out) natively in one pass beside
torch's separate casts; AdamW over low-bit moments (int8: 16 B/param, p and g fp32, 1-byte codes
read and written; bf16: 20 B/param) natively in one pass beside the unfused torch composition
a user would write: dequantize the moments with torch ops, ``torch.optim.adamw.adamw(...,
foreach=True)`` on the fp32 copies, requantize (blockwise absmax and 8-bit float codes, the
second moment by its square root) or round back to bf16 with torch ops. Timed in interleaved
rounds with
``cpu_adam``'s timer; ``speedup`` is the peer's median over ours (>= 1.0: ours is faster), ``speedup_vs_torch_fused`` the same
against ``SGD(fused=True)``. The torch compositions allocate fresh temporaries every step
(foreach SGD's weight-decay sum; the reference Lion's products and sign), which at these sizes
are fresh pages each call: part of what the one-pass native step saves.

``python -m zkernels.bench --sections cpu_optim`` or ``python -m zkernels.bench.cpu_optim``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable, List, Optional

import torch

from ._common import SectionUnavailable, format_table
from .cpu_adam import DEFAULT_NUMELS, _meta, _time_interleaved

SGD = dict(lr=1e-2, momentum=0.9, weight_decay=1e-4)
LION = dict(lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.1)
STEP_BYTES = 20                  # fp32 p, g, state read + p, state written
OFFLOAD_BYTES = 8 + 2 + 8 + 2    # p, b read, bf16 grad read, p, b written, bf16 out

COLUMNS = ["name", "numel", "threads", "median_ms", "min_ms", "max_ms", "gbps", "peer",
           "speedup", "speedup_vs_torch_fused"]

SGD_NATIVE = "zkernels cpu sgd (momentum, wd)"
SGD_FOREACH = "torch.optim.SGD(foreach=True)"
SGD_FUSED = "torch.optim.SGD(fused=True)"
LION_NATIVE = "zkernels cpu lion"
LION_REF = "reference lion_step (torch ops)"
OFF_NATIVE = "offload sgd: zkernels one pass (bf16 g in, bf16 p out)"
OFF_TORCH = "offload sgd: torch foreach SGD + separate casts"
LOWBIT = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
LOWBIT_BLOCK = 256
LOWBIT_BYTES = {"int8": 8 + 4 + 2 + 2, "bf16": 8 + 4 + 4 + 4}  # p r/w, g, m r/w, v r/w


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=None,
                    help=f"parameter counts (default {DEFAULT_NUMELS})")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default="bench_results/cpu_optim.json")
    return ap


def _row(name: str, numel: int, threads: int, bytes_per: int, t, **extra) -> dict:
    gbps = bytes_per * numel / (t["median_ms"] * 1e-3) / 1e9
    return dict(section="cpu_optim", name=name, numel=numel, threads=threads,
                bytes_per_elem=bytes_per, gbps=gbps, **t, **extra)


def _tensors(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen), torch.randn(n, generator=gen)


def _torch_sgd(n: int, grad: Optional[torch.Tensor] = None, **mode):
    p, g = _tensors(n)
    param = torch.nn.Parameter(p)
    param.grad = g if grad is None else grad
    return param, torch.optim.SGD([param], **SGD, **mode)


def _sgd_stepper(p, g, b, **kw) -> Callable[[], None]:
    from zkernels import _cpu
    step = [0]

    def fn():
        step[0] += 1
        _cpu.sgd_step(p, g, b, step=step[0], **SGD, **kw)
    return fn


def _sgd_rows(n: int, threads: int, reps: int, warm: int) -> List[dict]:
    p, g = _tensors(n)
    fns = {SGD_NATIVE: _sgd_stepper(p, g, torch.zeros(n))}
    keep = [_torch_sgd(n, foreach=True)]  # optimizers and params stay alive for the timing
    fns[SGD_FOREACH] = keep[-1][1].step
    try:
        keep.append(_torch_sgd(n, fused=True))
        keep[-1][1].step()  # a torch without CPU fused SGD raises here: no row
        fns[SGD_FUSED] = keep[-1][1].step
    except (RuntimeError, TypeError, ValueError):
        pass
    t = _time_interleaved(fns, reps, warm)
    rows = {name: _row(name, n, threads, STEP_BYTES, t[name]) for name in fns}
    rows[SGD_NATIVE].update(peer=SGD_FOREACH,
                            speedup=rows[SGD_FOREACH]["median_ms"] / t[SGD_NATIVE]["median_ms"])
    if SGD_FUSED in t:  # not the peer, shown beside it
        rows[SGD_NATIVE]["speedup_vs_torch_fused"] = t[SGD_FUSED]["median_ms"] / \
            t[SGD_NATIVE]["median_ms"]
    return list(rows.values())


def _lion_rows(n: int, threads: int, reps: int, warm: int) -> List[dict]:
    from zkernels import _cpu, reference
    (p, g), (q, _) = _tensors(n), _tensors(n, seed=1)
    m, k = torch.zeros(n), torch.zeros(n)
    fns = {LION_NATIVE: lambda: _cpu.lion_step(p, g, m, **LION),
           LION_REF: lambda: reference.lion_step(q, g, k, **LION)}
    t = _time_interleaved(fns, reps, warm)
    mine = _row(LION_NATIVE, n, threads, STEP_BYTES, t[LION_NATIVE], peer=LION_REF,
                speedup=t[LION_REF]["median_ms"] / t[LION_NATIVE]["median_ms"])
    return [mine, _row(LION_REF, n, threads, STEP_BYTES, t[LION_REF])]


def _offload_rows(n: int, threads: int, reps: int, warm: int) -> List[dict]:
    scale = 1024.0
    p, g32 = _tensors(n)
    grad = (g32 * scale).to(torch.bfloat16)
    del g32
    out, out_torch = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    param, opt = _torch_sgd(n, foreach=True)

    def separate():
        param.grad = grad.float() / scale
        opt.step()
        out_torch.copy_(param.detach())
    fns = {OFF_NATIVE: _sgd_stepper(p, grad, torch.zeros(n), grad_scale=scale, out=out),
           OFF_TORCH: separate}
    t = _time_interleaved(fns, reps, warm)
    mine = _row(OFF_NATIVE, n, threads, OFFLOAD_BYTES, t[OFF_NATIVE], peer=OFF_TORCH,
                speedup=t[OFF_TORCH]["median_ms"] / t[OFF_NATIVE]["median_ms"])
    return [mine, _row(OFF_TORCH, n, threads, OFFLOAD_BYTES, t[OFF_TORCH])]


def _lowbit_native(fmt: str) -> str:
    return f"zkernels cpu adamw, {fmt} moments (one pass)"


def _lowbit_torch(fmt: str) -> str:
    return f"torch ops: dequantize, adamw(foreach), requantize ({fmt})"


def _torch_lowbit_stepper(p, g, st: dict, fmt: str) -> Callable[[], None]:
    """The unfused composition: fp32 moments from the stored ones (the reference's torch-op
    decoding of the 8-bit float codes), torch's foreach AdamW, the stored ones back from them
    (the reference's torch-op encoding)."""
    from torch.optim.adamw import adamw
    from zkernels.reference.adamw_lowbit import (dequantize_exp_avg, dequantize_exp_avg_sq,
                                                 quantize_exp_avg, quantize_exp_avg_sq)
    hyper = dict(amsgrad=False, maximize=False, beta1=LOWBIT["beta1"], beta2=LOWBIT["beta2"],
                 lr=LOWBIT["lr"], weight_decay=LOWBIT["weight_decay"], eps=LOWBIT["eps"])
    step = torch.zeros(())
    bs = LOWBIT_BLOCK

    def fn():
        if fmt == "bf16":
            m, v = st["exp_avg"].float(), st["exp_avg_sq"].float()
        else:
            m = dequantize_exp_avg(st["exp_avg"], st["exp_avg_scales"], bs)
            v = dequantize_exp_avg_sq(st["exp_avg_sq"], st["exp_avg_sq_scales"], bs)
        adamw([p], [g], [m], [v], [], [step], foreach=True, **hyper)
        if fmt == "bf16":
            st["exp_avg"].copy_(m)
            st["exp_avg_sq"].copy_(v)
            return
        for x, key, quant in ((m, "exp_avg", quantize_exp_avg),
                              (v, "exp_avg_sq", quantize_exp_avg_sq)):
            codes, scales = quant(x, bs)
            st[key].copy_(codes)
            st[key + "_scales"].copy_(scales)
    return fn


def _lowbit_rows(n: int, threads: int, reps: int, warm: int) -> List[dict]:
    from zkernels import _cpu
    from zkernels.reference.adamw_lowbit import new_lowbit_state
    n = max(LOWBIT_BLOCK, n - n % LOWBIT_BLOCK)  # the torch composition views whole blocks
    rows = []
    for fmt, state_dtype in (("int8", "int8"), ("bf16", torch.bfloat16)):
        (p, g), (q, _) = _tensors(n), _tensors(n, seed=1)
        ours = new_lowbit_state(n, state_dtype, block_size=LOWBIT_BLOCK)
        theirs = new_lowbit_state(n, state_dtype, block_size=LOWBIT_BLOCK)
        step = [0]

        def native(st=ours, p=p, g=g):
            step[0] += 1
            _cpu.adamw_step_lowbit(p, g, st["exp_avg"], st["exp_avg_sq"],
                                   st.get("exp_avg_scales"), st.get("exp_avg_sq_scales"),
                                   step=step[0], block_size=LOWBIT_BLOCK, **LOWBIT)
        mine, peer = _lowbit_native(fmt), _lowbit_torch(fmt)
        t = _time_interleaved({mine: native, peer: _torch_lowbit_stepper(q, g, theirs, fmt)},
                              reps, warm)
        rows += [_row(mine, n, threads, LOWBIT_BYTES[fmt], t[mine], peer=peer,
                      speedup=t[peer]["median_ms"] / t[mine]["median_ms"],
                      block=LOWBIT_BLOCK),
                 _row(peer, n, threads, LOWBIT_BYTES[fmt], t[peer], block=LOWBIT_BLOCK)]
    return rows


def run(args: Optional[argparse.Namespace] = None) -> List[dict]:
    """Measure every row at ``args.threads`` threads (torch and native alike).

    Args:
        args: ``parser()``'s namespace or ``python -m zkernels.bench``'s (sizes, threads,
            repeat, warmup); None: defaults.

    Returns:
        One dict per row: name, numel, threads, median/min/max ms, gbps, and for the native
        rows the peer's name and ``speedup`` (the peer's median over ours).
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
            rows += _sgd_rows(n, threads, args.repeat, args.warmup)
            rows += _lion_rows(n, threads, args.repeat, args.warmup)
            rows += _offload_rows(n, threads, args.repeat, args.warmup)
            rows += _lowbit_rows(n, threads, args.repeat, args.warmup)
    finally:
        torch.set_num_threads(before)
    return [dict(r, **{k: meta[k] for k in ("cpu_isa", "load_avg_1min")}) for r in rows]


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    rows = run(args)
    meta = _meta()
    print(", ".join(f"{k}={v}" for k, v in meta.items() if k != "kind"))
    print(format_table(rows, COLUMNS))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([meta] + rows, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
