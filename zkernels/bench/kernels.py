"""Benchmark section "kernels": each fused op of ``zkernels.ops`` against the PyTorch way of
doing the same thing, measured in the same run, plus the device's plain copy bandwidth.

On CUDA the Triton kernels run; on CPU the reference path (and the ``cpp`` backend where
``zkernels.ops.available("cpp")`` and it implements the op). ``default`` marks the row of the
backend ``zkernels.ops`` picks on its own for the device (the implementation users run; a
reference row beside a native one is the test oracle, shown for scale). GB/s counts the bytes
an op must read and write at least (``num_bytes``, see each case); ``peer_bytes`` is what the
peer moves (more where it writes an fp32 temporary); ``frac_copy`` is the op's GB/s as a
fraction of a ``dst.copy_(src)`` of the same size measured the same way in the same run, the
practical ceiling of a memory-bound op; ``bound`` says "memory" from 0.6 of it up (the op runs
at copy speed), "overhead" below (its time is fixed per-call cost or arithmetic).

Timing: the peer and each backend of an op are timed round by round, side by side
(``timeit_interleaved``), so a burst of load from other jobs on a shared machine slows them
alike; ``speedup`` is the peer's median over the op's, ``paired`` the median of the per-round
ratios (the steadier of the two where the machine is busy). ``--threads`` sets the thread count
of torch and of the native ops alike.
"""
from __future__ import annotations

import contextlib
import gc
import os
from typing import Callable, Iterator, List, NamedTuple, Optional, Sequence

import torch

from .. import ops
from ..layout import FlatLayout
from ._common import gbps, timeit, timeit_interleaved

NUM_TENSORS = 32
DEFAULT_SIZES = {"cpu": [1 << 18, 1 << 21], "cuda": [1 << 24, 1 << 26]}
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)

PEERS = {
    "flatten": "torch.cat(tensors, out=flat)",
    "unflatten": "torch._foreach_copy_(outs, flat.split(numels))",
    "bucket_pack": "torch._foreach_copy_(bucket views, torch._foreach_mul(grads, 1/8))",
    "bucket_unpack": "torch._foreach_copy_(grads, bucket views); torch._foreach_mul_(grads, 8)",
    "cast": "out.copy_(x)  (fp32 -> bf16)",
    "unscale": "torch._amp_foreach_non_finite_check_and_unscale_",
    "adamw": "torch.optim.AdamW(fused=True).step(); out.copy_(param)  (bf16 out)",
    "sgd": "torch.optim.SGD(momentum=0.9, foreach=True).step(); out.copy_(param)  (bf16 out)",
    "lion": "lion-pytorch's update (mul_, add, sign_, add_, mul_, add_); out.copy_(param)  "
            "(bf16 out)",
    "sum_squares": "torch.linalg.vector_norm(torch.stack(torch._foreach_norm(ts))) ** 2",
    "quantize": "b = x.view(-1, 256); s = b.abs().amax(1, keepdim=True) / 127; "
                "(b / s).round().clamp(-127, 127).to(int8)  (fp32 in)",
    "quantize_int4": "the same with 7, then (q[:, ::2] & 0xF) | (q[:, 1::2] << 4)  (fp32 in)",
    "dequantize": "out.view(-1, 256).copy_(q.view(-1, 256).float() * s[:, None])  "
                  "(int8 -> bf16)",
    "dequantize_sum": "int4 nibbles by shifts, stacked, .float().view(8, -1, 256) * s, "
                      ".sum(0) * 0.125 -> out  (8 chunks -> fp32 shard)",
}
OPS = tuple(PEERS)


class Case(NamedTuple):
    """One op at one size: the zkernels call, its PyTorch peer, the bytes the op must move and
    the bytes the peer moves (its temporaries included)."""

    zkernels: Callable[[], object]
    peer: Callable[[], object]
    num_bytes: int
    peer_bytes: Optional[int] = None


def split_numels(numel: int, num_tensors: int = NUM_TENSORS) -> List[int]:
    """``numel`` split into tensors of mixed sizes (weights 1..4, the rest to the last one):
    many sizes, none aligned to a block."""
    weights = [1 + i % 4 for i in range(num_tensors)]
    sizes = [numel * w // sum(weights) for w in weights]
    sizes[-1] += numel - sum(sizes)
    return sizes


def _build(op: str, numel: int, device: torch.device) -> Case:
    f32, bf16 = torch.float32, torch.bfloat16
    numels = split_numels(numel)
    rand = lambda n, dtype=f32: torch.randn(n, device=device).to(dtype)  # noqa: E731
    if op in ("flatten", "unflatten"):
        ts = [rand(n) for n in numels]
        flat = rand(numel)
        if op == "flatten":
            return Case(lambda: ops.flatten(ts, out=flat), lambda: torch.cat(ts, out=flat),
                        8 * numel)
        return Case(lambda: ops.unflatten(flat, out=ts),
                    lambda: torch._foreach_copy_(ts, list(flat.split(numels))), 8 * numel)
    if op in ("bucket_pack", "bucket_unpack"):
        # A rank-aligned bf16 bucket of 8 ranks, 16-byte aligned tensors.
        layout = FlatLayout.build(numels, world_size=8, align=8)
        grads = [rand(n) for n in numels]
        bucket = torch.zeros(layout.padded_numel, dtype=bf16, device=device)
        views = [bucket[o:o + n] for o, n in zip(layout.offsets, numels)]
        if op == "bucket_pack":
            # peer: read grads, write and re-read the fp32 product, write the bucket
            return Case(lambda: ops.bucket_pack(grads, bucket, layout.offsets, scale=0.125),
                        lambda: torch._foreach_copy_(views, torch._foreach_mul(grads, 0.125)),
                        6 * numel, 14 * numel)

        def unpack_peer():
            torch._foreach_copy_(grads, views)
            torch._foreach_mul_(grads, 8.0)
        # peer: read the bucket, write the grads, then read and write them again to scale
        return Case(lambda: ops.bucket_unpack(bucket, grads, layout.offsets, scale=8.0),
                    unpack_peer, 6 * numel, 14 * numel)
    if op == "cast":
        x, out = rand(numel), torch.empty(numel, dtype=bf16, device=device)
        return Case(lambda: ops.cast(x, out=out), lambda: out.copy_(x), 6 * numel)
    if op == "unscale":
        # inv_scale 1: a full read-modify-write pass that never drifts into subnormals.
        x, found = rand(numel), torch.zeros(1, device=device)
        inv = torch.ones(1, device=device)
        return Case(lambda: ops.unscale_and_check_(x, inv, found),
                    lambda: torch._amp_foreach_non_finite_check_and_unscale_([x], found, inv),
                    8 * numel)
    if op == "adamw":
        return _adamw_case(numel, device)
    if op == "sgd":
        return _sgd_case(numel, device)
    if op == "lion":
        return _lion_case(numel, device)
    if op == "sum_squares":
        ts = [rand(n) for n in numels]
        return Case(lambda: ops.sum_squares(ts),
                    lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(ts))) ** 2,
                    4 * numel)
    if op in _QUANT_OPS:
        return _quant_case(op, numel, device)
    raise ValueError(f"op must be one of {OPS}, got {op!r}")


def _adamw_case(numel: int, device: torch.device) -> Case:
    # Read p, g, m, v (16 B), write p, m, v (12 B) and the bf16 compute copy (2 B).
    p, g = torch.randn(numel, device=device), torch.randn(numel, device=device) * 1e-3
    m, v = torch.zeros(numel, device=device), torch.zeros(numel, device=device)
    out = torch.empty(numel, dtype=torch.bfloat16, device=device)
    steps = [0]

    def mine():
        steps[0] += 1
        ops.adamw_step(p, g, m, v, step=steps[0], out=out, **HYPER)
    param = torch.nn.Parameter(p.clone())
    param.grad = g.clone()
    opt = torch.optim.AdamW([param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                            eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], fused=True)

    def peer():
        opt.step()
        out.copy_(param.detach())
    # peer: the fused step (28 B) then a second pass reading the params for the copy (6 B)
    return Case(mine, peer, 30 * numel, 34 * numel)


def _sgd_case(numel: int, device: torch.device) -> Case:
    # Read p, g, b (12 B), write p, b (8 B) and the bf16 compute copy (2 B).
    p, g = torch.randn(numel, device=device), torch.randn(numel, device=device) * 1e-3
    b = torch.zeros(numel, device=device)
    out = torch.empty(numel, dtype=torch.bfloat16, device=device)
    steps = [0]

    def mine():
        steps[0] += 1
        ops.sgd_step(p, g, b, lr=1e-2, momentum=0.9, step=steps[0], out=out)
    param = torch.nn.Parameter(p.clone())
    param.grad = g.clone()
    opt = torch.optim.SGD([param], lr=1e-2, momentum=0.9, foreach=True)

    def peer():
        opt.step()
        out.copy_(param.detach())
    # peer: the foreach step (20 B) then a second pass reading the params for the copy (6 B)
    return Case(mine, peer, 22 * numel, 26 * numel)


def _lion_case(numel: int, device: torch.device) -> Case:
    # Read p, g, m (12 B), write p, m (8 B) and the bf16 compute copy (2 B).
    p, g = torch.randn(numel, device=device), torch.randn(numel, device=device) * 1e-3
    m = torch.zeros(numel, device=device)
    out = torch.empty(numel, dtype=torch.bfloat16, device=device)
    q, k = p.clone(), m.clone()
    hyper = dict(lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.1)

    def mine():
        ops.lion_step(p, g, m, out=out, **hyper)

    def peer():  # lucidrains/lion-pytorch's update_fn
        q.mul_(1.0 - hyper["lr"] * hyper["weight_decay"])
        update = k.clone().mul_(hyper["beta1"]).add(g, alpha=1.0 - hyper["beta1"]).sign_()
        q.add_(update, alpha=-hyper["lr"])
        k.mul_(hyper["beta2"]).add_(g, alpha=1.0 - hyper["beta2"])
        out.copy_(q)
    # peer: p (2 passes), m (clone, 3 passes over the temporary), g twice, m again, the copy
    return Case(mine, peer, 22 * numel, 58 * numel)


_QUANT_OPS = ("quantize", "quantize_int4", "dequantize", "dequantize_sum")
QUANT_BLOCK = 256
QUANT_CHUNKS = 8   # dequantize_sum: ranks whose chunks of one shard are summed


def _as_blocks(t: torch.Tensor, block: int) -> torch.Tensor:
    """(num_blocks, block) view of flat ``t``, zero-padded when ragged (a copy: bench sizes
    are powers of two, so only the smoke test's size pays it)."""
    t = t.reshape(-1)
    pad = (-t.numel()) % block
    return (torch.nn.functional.pad(t, (0, pad)) if pad else t).view(-1, block)


def _quant_case(op: str, numel: int, device: torch.device) -> Case:
    """The quantization ops against the torch ops a user would write for them. Bytes: the op
    reads its input and writes codes + scales (or the reverse); the peer's count is its passes
    (each elementwise op reads and writes its fp32 temporary)."""
    B, n_scales = QUANT_BLOCK, -(-numel // QUANT_BLOCK)
    x = torch.randn(numel, device=device)
    if op in ("quantize", "quantize_int4"):
        bits = 8 if op == "quantize" else 4
        qmax = 127 if bits == 8 else 7
        q, s = ops.quantize(x, bits=bits, block_size=B)

        def peer():
            b = _as_blocks(x, B)
            scale = b.abs().amax(1, keepdim=True) / qmax
            c = (b / scale).round().clamp(-qmax, qmax).to(torch.int8)
            if bits == 4:
                c = (c[:, ::2] & 0xF) | (c[:, 1::2] << 4)
            return c, scale
        out_bytes = numel if bits == 8 else (numel + 1) // 2
        # peer: abs (8), amax (4), div (8), round (8), clamp (8), to int8 (5) [+ pack (3)]
        return Case(lambda: ops.quantize(x, bits=bits, block_size=B, out=q, scales=s), peer,
                    4 * numel + out_bytes + 4 * n_scales,
                    (41 if bits == 8 else 44) * numel)
    if op == "dequantize":
        q, s = ops.quantize(x, bits=8, block_size=B)
        out = torch.empty(numel, dtype=torch.bfloat16, device=device)

        def peer():
            res = _as_blocks(q, B).float() * s[:, None]
            out.copy_(res.view(-1)[:numel])
        # peer: .float() (5), * s (8), copy to bf16 (6)
        return Case(lambda: ops.dequantize(q, s, bits=8, block_size=B, out=out), peer,
                    3 * numel + 4 * n_scales, 19 * numel)
    # dequantize_sum: numel elements received in all, QUANT_CHUNKS chunks of one shard.
    shard = max(1, numel // QUANT_CHUNKS)
    n_scales = -(-shard // B)
    xs = torch.randn(QUANT_CHUNKS, shard, device=device)
    q = torch.stack([ops.quantize(r, bits=4, block_size=B)[0] for r in xs])
    s = torch.stack([ops.quantize(r, bits=4, block_size=B)[1] for r in xs])
    out = torch.empty(shard, device=device)
    scale = 1.0 / QUANT_CHUNKS

    def peer():
        lo = (q << 4).view(torch.int8) >> 4          # sign-extended low nibbles
        hi = q.view(torch.int8) >> 4                 # and high
        codes = torch.stack((lo, hi), dim=-1).view(QUANT_CHUNKS, -1)[:, :shard].float()
        if shard % B:
            codes = torch.nn.functional.pad(codes, (0, n_scales * B - shard))
        vals = codes.view(QUANT_CHUNKS, n_scales, B) * s.view(QUANT_CHUNKS, n_scales, 1)
        out.copy_(vals.sum(0).view(-1)[:shard] * scale)
    total = QUANT_CHUNKS * shard
    # peer per received element: shifts (~2), stack (2), float (5), * s (8), sum (4), * (~1)
    return Case(lambda: ops.dequantize_sum(q, s, out, bits=4, block_size=B, scale=scale),
                peer, total // 2 + 4 * QUANT_CHUNKS * n_scales + 4 * shard, 22 * total)


@contextlib.contextmanager
def forced_backend(name: str) -> Iterator[None]:
    """Run ``zkernels.ops`` on backend ``name`` (the documented ZKERNELS_BACKEND switch)."""
    old = os.environ.get("ZKERNELS_BACKEND")
    os.environ["ZKERNELS_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            del os.environ["ZKERNELS_BACKEND"]
        else:
            os.environ["ZKERNELS_BACKEND"] = old


def backends(device: torch.device) -> List[str]:
    """The zkernels paths measured on ``device``."""
    if device.type == "cuda":
        return ["triton"]
    return ["reference"] + (["cpp"] if ops.available("cpp") else [])


_OP_NAMES = {"unscale": "unscale_and_check_", "adamw": "adamw_step", "sgd": "sgd_step",
             "lion": "lion_step",
             "quantize_int4": "quantize"}


def copy_bandwidth(numel: int, device: torch.device, repeat: int, warmup: int) -> dict:
    """The plain device copy ``dst.copy_(src)`` of ``numel`` fp32 (read + write bytes)."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    t = timeit(lambda: dst.copy_(src), device, repeat, warmup)
    return dict(section="kernels", op="copy_", numel=numel, backend="torch",
                num_bytes=8 * numel, gbps=gbps(8 * numel, t["median_ms"]), frac_copy=1.0, **t)


def run(args) -> List[dict]:
    """Measure every op of ``args.ops`` (default all) at every size of ``args.sizes`` (default
    per device type), ``args.repeat`` timed calls after ``args.warmup``, on ``args.device``.

    Returns:
        the copy-bandwidth row of each size, then one row per (op, size, backend) with the
        peer's time, the ratio to it and the fraction of that size's copy bandwidth.
    """
    device = torch.device(getattr(args, "device", None) or
                          ("cuda" if torch.cuda.is_available() else "cpu"))
    sizes: Sequence[int] = args.sizes or DEFAULT_SIZES[device.type]
    selected = args.ops or list(OPS)
    unknown = [o for o in selected if o not in OPS]
    if unknown:
        raise ValueError(f"--ops: unknown {unknown}; choose from {list(OPS)}")
    # Per size: small sizes run from cache, so the ceiling differs with the size.
    copy_gbps = {}
    rows = []
    for numel in sizes:
        rows.append(copy_bandwidth(numel, device, args.repeat, args.warmup))
        copy_gbps[numel] = rows[-1]["gbps"]
        _free(device)
    for op in selected:
        for numel in sizes:
            rows.extend(_measure(op, numel, device, args.repeat, args.warmup, copy_gbps[numel]))
            _free(device)
    return rows


def _measure(op: str, numel: int, device: torch.device, repeat: int, warmup: int,
             copy_gbps: float) -> List[dict]:
    case = _build(op, numel, device)
    peer_bytes = case.peer_bytes or case.num_bytes
    name = _OP_NAMES.get(op, op)
    default = ops.choose(name, device) if "ZKERNELS_BACKEND" not in os.environ else None
    runnable = []
    for backend in backends(device):
        try:
            with forced_backend(backend):
                ops.choose(name, device)
        except RuntimeError as exc:  # backend lacks this op here: no row, said in the table
            if "not available" not in str(exc):
                raise
            continue
        runnable.append(backend)
    # The peer and every backend side by side, round by round (see timeit_interleaved).
    with forced_backend(runnable[0] if runnable else "reference"):
        times = timeit_interleaved([case.peer] + [case.zkernels] * len(runnable), device,
                                   repeat, warmup,
                                   setups=[None] + [_set_backend(b) for b in runnable])
    peer = times[0]
    rows = []
    for backend, t in zip(runnable, times[1:]):
        rate = gbps(case.num_bytes, t["median_ms"])
        paired = t.pop("paired")
        rows.append(dict(section="kernels", op=op, numel=numel, backend=backend,
                         default="yes" if backend == default else "",
                         num_bytes=case.num_bytes, gbps=rate, frac_copy=rate / copy_gbps,
                         bound="memory" if rate / copy_gbps >= MEMORY_BOUND else "overhead",
                         peer=PEERS[op], peer_median_ms=peer["median_ms"],
                         peer_bytes=peer_bytes, peer_gbps=gbps(peer_bytes, peer["median_ms"]),
                         speedup=peer["median_ms"] / t["median_ms"], paired=paired, **t))
    return rows


def _set_backend(name: str) -> Callable[[], None]:
    """Switches ZKERNELS_BACKEND to ``name`` (inside ``forced_backend``, which restores it)."""
    def setup() -> None:
        os.environ["ZKERNELS_BACKEND"] = name
    return setup


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# An op at this fraction of the same-size plain copy's GB/s, or above, is memory-bound.
MEMORY_BOUND = 0.6

COLUMNS = ["op", "numel", "backend", "default", "median_ms", "min_ms", "max_ms", "num_bytes",
           "gbps", "frac_copy", "bound", "peer_median_ms", "peer_bytes", "peer_gbps", "speedup",
           "paired"]


def legend(rows: Sequence[dict]) -> Optional[str]:
    """What each op's peer is (the table's 'peer_*' and 'speedup' columns), the copy ceiling
    per size, and which default rows are memory-bound at what fraction of it."""
    used = [op for op in OPS if any(r.get("op") == op for r in rows)]
    lines = [f"  {op:>13}: {PEERS[op]}" for op in used]
    copies = [r for r in rows if r.get("op") == "copy_"]
    if copies:
        lines.append("copy ceiling (dst.copy_(src), fp32, read + write): " + ", ".join(
            f"{r['numel']}: {r['gbps']:.3g} GB/s" for r in copies))
    mem = [r for r in rows if r.get("default") == "yes" and r.get("bound") == "memory"]
    if mem:
        lines.append("memory-bound (default rows at >= %.1f of that copy): " % MEMORY_BOUND +
                     ", ".join(f"{r['op']}@{r['numel']} {r['frac_copy']:.2f}" for r in mem))
    return "\n".join(lines) or None
