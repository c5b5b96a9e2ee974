"""Stage 2's per-gradient hook path on CPU against DDP's own bucket copy, from a profile of
the same training steps of the demo GPT on 2 gloo ranks (one thread each).

    python benchmarks/hook_path.py                 # small config (0.83 M params), 5 steps
    python benchmarks/hook_path.py --steps 3 --config tiny

Two measurements:

1. The primitives, in one process, same instrument (``timeit`` median), same data, summed
   over the model's parameters = per step. DDP copies every gradient twice a step: into the
   bucket before the all-reduce (its reducer runs ``torch.mul(g, 1/N, out=bucket_view)`` per
   gradient) and back afterwards (``g.copy_(bucket_view)``). Stage 2 copies it once: the hook's
   ``zkernels.ops.bucket_pack([g], bucket, [offset], scale=1/N)``, then one copy per bucket of
   the reduced 1/N shard into the fp32 gradient shard (``shard.copy_(reduced)``).
2. A real step on 2 ranks:

- DDP: its reducer's per-gradient copy into the bucket (``torch::distributed::reducer::mul_out``,
  the grad times 1/N into the bucket view) and, after the all-reduce, the copy back
  (``copy_bucket_to_grad``).
  (``torch.profiler``: its C++ ranges cost ~1 us each).
- zkernels stage 2, in unprofiled steps (a Python ``record_function`` costs ~8 us per range
  here, more than the pack itself, so the profiler would mostly measure itself): wall time
  (``perf_counter``) of ``OpSet.bucket_pack`` inside the post-accumulate-grad hook, of ``_pack``
  (buffer acquire + pack + ``grad = None``), of the whole hook (bookkeeping, pack, starting a
  ready bucket's reduce-scatter), and of ``DeviceGradShards.accumulate`` (stage 2 has no copy
  back: the reduced shard is added into the fp32 gradient shard). Each wrapper costs ~0.5 us a
  call, and the outer ranges contain the inner ones' wrappers.

Prints a table (milliseconds per step, median over steps, rank 0) and writes JSON
(``--json``, default ``bench_results/hook_path.json``). The issue's bar: the stage-2 pack
costs no more per step than DDP's bucket copy.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from zero_step import CONFIGS, REPO_ROOT, _on_path, launch

# the profiler's names of DDP's reducer ranges (stage 2's: our wrappers', named by their key)
DDP_EVENTS = {"ddp_pack": "torch::distributed::reducer::mul_out",
              "ddp_copy_back": "torch.distributed.ddp.reducer::copy_bucket_to_grad"}
# what the table calls each range, in its order
LABELS = {"ddp_pack": "DDP reducer: grad * 1/N into the bucket (mul_out)",
          "ddp_copy_back": "DDP reducer: bucket back into the grads",
          "zk_pack": "zkernels stage 2: pack (OpSet.bucket_pack: 1/N, cast)*",
          "zk_pack_path": "zkernels stage 2: _pack (buffer acquire + pack + grad=None)",
          "zk_acquire": "zkernels stage 2: reduce buffer acquire (waits for a free one)",
          "zk_launch": "zkernels stage 2: reduce-scatter launch",
          "zk_hook": "zkernels stage 2: whole hook (pack + bookkeeping + launch)",
          "zk_accumulate": "zkernels stage 2: reduced shard into the fp32 grad shard"}
_TIMES: dict = {}  # range name -> (seconds, calls) in this step


def _add(name: str, seconds: float) -> None:
    total, calls = _TIMES.get(name, (0.0, 0))
    _TIMES[name] = (total + seconds, calls + 1)


def _instrument_stage2() -> None:
    """Wrap the stage-2 reducer's methods in wall-clock accumulators (this process only)."""
    import time

    from zkernels.ops import OpSet
    from zkernels.zero.gradients import grad_reducers as gr

    def ranged(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _add(name, time.perf_counter() - t0)
        return wrapper
    # The reducer packs through the optimizer's OpSet (backend chosen once, see
    # [Note: ops chosen once]), not through zkernels.ops.bucket_pack; each bucket
    # (GradBucket) owns its gradient hook (on_grad) and pack.
    for owner, attr, key in ((OpSet, "bucket_pack", "zk_pack"),
                             (gr.ReducePool, "acquire", "zk_acquire"),
                             (gr.ReducePool, "launch", "zk_launch"),
                             (gr.GradBucket, "_pack", "zk_pack_path"),
                             (gr.GradBucket, "on_grad", "zk_hook"),
                             (gr.DeviceGradShards, "accumulate", "zk_accumulate")):
        setattr(owner, attr, ranged(key, getattr(owner, attr)))


def _steps(method: str, model, cfg, batch: int, steps: int, rank: int) -> list:
    import torch
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=gen)
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=gen)
    if method == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)

        def step():
            net(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        import zkernels
        opt = zkernels.ZeroOptimizer(model, stage=2, lr=1e-3)

        def step():
            opt.backward(model(x, y))
            opt.step()
            opt.zero_grad()
    names = DDP_EVENTS if method == "ddp" else {k: k for k in LABELS if k.startswith("zk")}
    for _ in range(2):  # warm-up: buffers, pools, first-touch
        step()
    rows = []
    for _ in range(steps):
        _TIMES.clear()
        if method == "ddp":  # the profiler's CPU time of each of the reducer's ranges
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step()
            for e in prof.events():
                if e.name in names.values():
                    _add(e.name, e.cpu_time_total / 1e6)
        else:
            step()
        row = {}
        for key, name in names.items():
            total, calls = _TIMES.get(name, (0.0, 0))
            row[key], row[f"{key}_calls"] = 1e3 * total, calls
        rows.append(row)
    return rows


def primitive(cfg, world_size: int = 2, repeat: int = 7, number: int = 200) -> dict:
    """Per step (ms): stage 2's pack of every gradient vs DDP's reducer op for it."""
    import timeit

    import torch
    import zkernels
    from zkernels.demo.model import GPT
    torch.manual_seed(0)
    params = [p for p in GPT(cfg).parameters()]
    grads = [torch.randn_like(p) for p in params]
    layout = zkernels.FlatLayout.build([p.numel() for p in params], world_size=world_size,
                                       align=8)
    bucket = torch.zeros(layout.padded_numel)
    views = [bucket[o:o + g.numel()].view_as(g) for o, g in zip(layout.offsets, grads)]
    scale = 1.0 / world_size

    # The hook's call: the OpSet ZeroOptimizer builds for the device (ops_backend=None).
    opset = zkernels.ops.for_device("cpu")

    def zk():
        for i, g in enumerate(grads):
            opset.bucket_pack([g], bucket, [layout.offsets[i]], scale=scale)

    def ddp():
        for g, v in zip(grads, views):
            torch.mul(g, scale, out=v)

    def ddp_back():
        for g, v in zip(grads, views):
            g.copy_(v)
    shard = torch.zeros(layout.shard_numel)
    reduced = bucket[:layout.shard_numel]

    def zk_accumulate():
        shard.copy_(reduced)
    out = {}
    for _ in range(2):  # interleaved, twice: the better of two median estimates each
        for name, fn in (("ddp_mul_out", ddp), ("zk_bucket_pack", zk),
                         ("ddp_copy_back", ddp_back), ("zk_accumulate", zk_accumulate)):
            fn()
            t = statistics.median(timeit.repeat(fn, number=number, repeat=repeat)) / number
            out[name] = min(out.get(name, float("inf")), 1e3 * t)
    out["zk_free_grads"] = _free_grads_ms(params, grads, repeat)
    out["num_grads"] = len(grads)
    out["backend"] = opset.backends["bucket_pack"]
    return out


def _free_grads_ms(params, grads, repeat: int) -> float:
    """Per step (ms): the hook's ``p.grad = None`` over every gradient (it frees the full
    gradient, stage 2's memory saving; DDP frees the same in ``zero_grad(set_to_none=True)``),
    median of ``repeat`` rounds, the gradients re-assigned untimed before each."""
    import time
    times = []
    for _ in range(max(repeat, 5)):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        t0 = time.perf_counter()
        for p in params:
            p.grad = None
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def run(rank: int, world_size: int, opts: dict) -> dict:
    """One rank (``zero_step.launch`` spawns it): DDP's steps, then stage 2's, same GPT."""
    import torch
    import torch.distributed as dist

    _instrument_stage2()
    from zkernels.demo.model import GPT, GPTConfig
    cfg = GPTConfig(**CONFIGS[opts["config"]]["model"])
    batch = CONFIGS[opts["config"]]["batch_size"]
    result = {}
    for method in ("ddp", "zk_stage2"):
        torch.manual_seed(0)
        result[method] = _steps(method, GPT(cfg), cfg, batch, opts["steps"], rank)
        dist.barrier()
    result["num_param_tensors"] = len(list(GPT(cfg).parameters()))
    result["num_params"] = sum(p.numel() for p in GPT(cfg).parameters())
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="small")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", default=str(REPO_ROOT / "bench_results" / "hook_path.json"))
    args = ap.parse_args(argv)
    _on_path()  # the spawned ranks copy sys.path: this checkout's zkernels
    try:
        results = dict(enumerate(launch(run, dict(config=args.config, steps=args.steps), 2,
                                        900)))
    except RuntimeError as exc:
        print(exc)
        return 1
    r0 = results[0]

    def med(rows, key):
        return statistics.median(row[key] for row in rows)
    ddp, zk = r0["ddp"], r0["zk_stage2"]
    table = []
    for key, label in LABELS.items():
        rows = ddp if key in DDP_EVENTS else zk
        table.append((label, med(rows, key), med(rows, f"{key}_calls")))
    import torch
    torch.set_num_threads(1)
    from zkernels.demo.model import GPTConfig
    prim = primitive(GPTConfig(**CONFIGS[args.config]["model"]))
    print(f"1. per-gradient primitive, one process, 1 thread, {prim['num_grads']} gradients "
          f"(backend {prim['backend']}), ms per step (timeit median)")
    ddp_total = prim["ddp_mul_out"] + prim["ddp_copy_back"]
    zk_total = prim["zk_bucket_pack"] + prim["zk_accumulate"]
    for label, key, extra in (
            ("DDP in:      torch.mul(g, 1/N, out=bucket_view) per grad:", "ddp_mul_out", ""),
            ("DDP back:    g.copy_(bucket_view) per grad:             ", "ddp_copy_back", ""),
            ("stage 2 in:  OpSet.bucket_pack([g], bucket, [o], 1/N):   ", "zk_bucket_pack",
             f"  ({prim['zk_bucket_pack'] / prim['ddp_mul_out']:.2f}x DDP in)"),
            ("stage 2:     shard.copy_(reduced) per bucket:           ", "zk_accumulate", "")):
        print(f"   {label} {prim[key]:.3f}{extra}")
    print(f"   per step: DDP {ddp_total:.3f}, stage 2 {zk_total:.3f} "
          f"({zk_total / ddp_total:.2f}x)")
    print(f"   (stage 2's hook also frees each gradient, p.grad = None: "
          f"{prim['zk_free_grads']:.3f} per step; DDP frees the same in zero_grad)")
    print(f"2. config={args.config} ({r0['num_params']:,} params in {r0['num_param_tensors']} "
          f"tensors), 2 gloo ranks x 1 thread, {args.steps} steps, rank 0, "
          "median ms per step (DDP: profiler; * stage 2: wall clock, unprofiled steps)")
    width = max(len(t[0]) for t in table)
    print(f"{'what':<{width}}  ms/step  calls/step")
    for name, ms, calls in table:
        print(f"{name:<{width}}  {ms:7.3f}  {calls:10.0f}")
    ratio = med(zk, "zk_pack") / med(ddp, "ddp_pack")
    both = (med(zk, "zk_pack") + med(zk, "zk_accumulate")) / (
        med(ddp, "ddp_pack") + med(ddp, "ddp_copy_back"))
    print(f"in the step: stage-2 pack / DDP copy in {ratio:.2f}x; stage-2 pack + accumulate / "
          f"DDP copy in + back {both:.2f}x")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(dict(config=args.config, steps=args.steps,
                                               primitive=prim, ranks=results,
                                               pack_ratio_to_ddp_in=ratio,
                                               copies_ratio_to_ddp=both), indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
