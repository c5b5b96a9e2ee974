"""Peak RSS per rank while building, loading, training and saving a model that is never whole
on any rank: zkernels stage 3 (meta build, ``load_pretrained``, ``save_pretrained``) beside
FSDP2's meta-device flow and DeepSpeed's ``zero.Init``, same model, same ranks, same run.

    python benchmarks/build_peak.py                    # ~170M Llama, 4 gloo ranks, fp32
    python benchmarks/build_peak.py --size tiny        # a few M parameters, for a quick look
    python benchmarks/build_peak.py --methods zk --json bench_results/build_peak.json

The model: a transformers ``LlamaForCausalLM`` (vocab 8192, hidden 1024, 12 layers,
intermediate 2816, 16 heads, untied head: 171M parameters), initialized from seed 0 and saved
once as bf16 safetensors in shards of 100 MB. Each method then runs in fresh spawned ranks
(torch.set_num_threads(1), gloo), fp32 compute and AdamW:

- ``zk``: ``ZeroOptimizer(meta model, stage=3, device="cpu", param_init=None)``,
  ``zk.checkpoint.load_pretrained``, 2 steps, ``zk.checkpoint.save_pretrained``;
- ``fsdp2``: ``fully_shard`` per decoder layer and the root, ``to_empty(device="cpu")``,
  ``init_weights()``, ``torch.optim.AdamW``; rank 0 reads the files
  (``safetensors.torch.load_file``) and ``set_model_state_dict(..., StateDictOptions(
  full_state_dict=True, broadcast_from_rank0=True))``; saving: ``get_model_state_dict(
  full_state_dict=True, cpu_offload=True)`` and rank 0's ``safetensors.torch.save_file``;
- ``deepspeed``: ``deepspeed.zero.Init`` around the constructor (DS_ACCELERATOR=cpu, ZeRO-3,
  ``stage3_param_persistence_threshold`` 0, ``gradient_clipping`` 0, torch's AdamW as the
  client optimizer), ``deepspeed.initialize``; loading as transformers does under ZeRO-3:
  per module ``GatheredParameters(modifier_rank=0)`` with rank 0 copying that module's tensors
  from the files; saving: ``engine.save_16bit_model`` (rank 0 gathers and writes).

Each rank measures the peak RSS of each phase above its RSS after the imports and the process
group (``zkernels.bench.peak_rss``: the kernel's VmHWM reset per phase; see [Note: measuring
peak RSS honestly] there: the safetensors pages a rank maps count). The bound (issue 25), for
zk: build and load within 12Ψ/N·1.05 + the two largest units in fp32 + 128 MiB, save within
the training peak + 128 MiB. The table prints the largest rank's figures; JSON (``--json``)
keeps every rank's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zero_step import _on_path, launch  # noqa: E402 - the shared launcher, from here

SIZES = {
    "170m": dict(vocab_size=8192, hidden_size=1024, intermediate_size=2816,
                 num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=16),
    "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=352,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4),
}
METHODS = ("zk", "fsdp2", "deepspeed")
PHASES = ("build", "load", "train", "save")
SEQ, BATCH, STEPS, LR = 64, 1, 2, 1e-4
MIB = 2.0 ** 20
SLACK = 128 * 2 ** 20
SHARD_BYTES = 100 * 10 ** 6   # max_shard_size of the files written (and of zk's save)


def llama_config(size: str):
    import transformers
    return transformers.LlamaConfig(max_position_embeddings=SEQ, tie_word_embeddings=False,
                                    **SIZES[size])


def write_checkpoint(size: str, folder: str) -> dict:
    """The model from seed 0, saved as bf16 safetensors in 100 MB shards; its sizes."""
    import torch
    import transformers
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config(size)).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size=SHARD_BYTES)
    units = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    psi = sum(p.numel() for p in model.parameters())
    root = psi - sum(units)
    return dict(num_params=psi, largest_units=sorted(units + [root])[-2:])


def _train(meter, rank: int, vocab: int, forward, backward, *updates) -> list:
    """The train phase: ``STEPS`` steps on this rank's batches (seeded by rank); the losses."""
    import torch
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    with meter.phase("train"):
        for _ in range(STEPS):
            x = torch.randint(vocab, (BATCH, SEQ), generator=gen)
            loss = forward(input_ids=x, labels=x).loss
            backward(loss)
            for update in updates:
                update()
            losses.append(loss.item())
    return losses


def _zk(meter, rank, opts):
    import torch
    import transformers

    import zkernels as zk
    cfg = llama_config(opts["size"])
    with meter.phase("build"):
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(cfg)
        opt = zk.ZeroOptimizer(model, stage=3, lr=LR, device="cpu", param_init=None)
    with meter.phase("load"):
        zk.checkpoint.load_pretrained(opt, opts["src"])
    losses = _train(meter, rank, cfg.vocab_size, model, torch.Tensor.backward, opt.step,
                    opt.zero_grad)
    with meter.phase("save"):
        zk.checkpoint.save_pretrained(opt, os.path.join(opts["out"], "zk"),
                                      max_shard_size=SHARD_BYTES)
    opt.close()
    return losses


def _fsdp2(meter, rank, opts):
    import safetensors.torch
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_model_state_dict,
                                                         set_model_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    cfg = llama_config(opts["size"])
    with meter.phase("build"):
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(cfg)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights()
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
    with meter.phase("load"):
        full = {}
        if rank == 0:
            for f in sorted(os.listdir(opts["src"])):
                if f.endswith(".safetensors"):
                    full.update(safetensors.torch.load_file(os.path.join(opts["src"], f)))
        set_model_state_dict(model, full, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))
        del full
    losses = _train(meter, rank, cfg.vocab_size, model, torch.Tensor.backward, opt.step,
                    opt.zero_grad)
    with meter.phase("save"):
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                  cpu_offload=True))
        if rank == 0:
            folder = os.path.join(opts["out"], "fsdp2")
            os.makedirs(folder, exist_ok=True)
            safetensors.torch.save_file(sd, os.path.join(folder, "model.safetensors"))
        del sd
        dist.barrier()
    return losses


def _deepspeed(meter, rank, opts):
    import deepspeed  # its environment set by _run (deepspeed_env)
    import torch
    import torch.distributed as dist
    import transformers
    from _zero_step_methods import Context, DeepSpeedMethod
    from safetensors import safe_open
    cfg = llama_config(opts["size"])
    ctx = Context(lr=LR, world_size=dist.get_world_size(), batch_size=BATCH)
    ds_cfg = DeepSpeedMethod.config(ctx, 3, stage3_gather_16bit_weights_on_model_save=True)
    with meter.phase("build"):
        with deepspeed.zero.Init(config_dict_or_path=ds_cfg, dtype=torch.float32):
            model = transformers.LlamaForCausalLM(cfg)
        engine, _, _, _ = deepspeed.initialize(
            model=model, config=ds_cfg, dist_init_required=False,
            optimizer=torch.optim.AdamW(model.parameters(), lr=LR))
    with meter.phase("load"):
        from zkernels.checkpoint.pretrained import weight_map
        where = weight_map(opts["src"])   # {key: file}, from the index or the one file
        files = {}
        for mod_name, mod in model.named_modules():
            own = dict(mod.named_parameters(recurse=False))
            if not own:
                continue
            with deepspeed.zero.GatheredParameters(list(own.values()), modifier_rank=0):
                if rank == 0:
                    with torch.no_grad():
                        for pname, p in own.items():
                            key = f"{mod_name}.{pname}" if mod_name else pname
                            path = where[key]
                            if path not in files:
                                files[path] = safe_open(path, framework="pt")
                            p.copy_(files[path].get_tensor(key))
        files.clear()
    losses = _train(meter, rank, cfg.vocab_size, engine, engine.backward, engine.step)
    with meter.phase("save"):
        engine.save_16bit_model(os.path.join(opts["out"], "deepspeed"))
        dist.barrier()
    engine.destroy()
    return losses


def _run(rank: int, world_size: int, opts: dict) -> dict:
    """One rank of one method: the imports, the baseline, then the phases."""
    import gc

    import torch  # noqa: F401 - imported before the baseline, as every method needs it
    import transformers.models.llama.modeling_llama  # noqa: F401

    import zkernels  # noqa: F401
    from zkernels.bench.peak_rss import PeakMeter
    if opts["method"] == "deepspeed":
        from _zero_step_methods import deepspeed_env
        deepspeed_env()
        try:
            import deepspeed  # noqa: F401
        except ImportError as exc:
            return {"error": f"deepspeed is not importable here ({exc})"}
    if opts["method"] == "fsdp2":
        import torch.distributed.checkpoint.state_dict  # noqa: F401
        import torch.distributed.fsdp  # noqa: F401
    gc.collect()
    meter = PeakMeter()
    body = {"zk": _zk, "fsdp2": _fsdp2, "deepspeed": _deepspeed}[opts["method"]]
    t0 = time.perf_counter()
    try:
        losses = body(meter, rank, opts)
    except Exception as exc:  # noqa: BLE001 - a peer that cannot run here says why
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
                "peaks": meter.peaks}
    return {"peaks": meter.peaks, "losses": losses, "seconds": time.perf_counter() - t0,
            "baseline_rss": meter.baseline["VmRSS"]}


def bounds(info: dict, world_size: int) -> dict:
    """The issue's bounds for zk, from the model's sizes: ``build_load`` in bytes, and
    ``save`` as the slack over the training peak."""
    psi = info["num_params"]
    return dict(build_load=12 * psi / world_size * 1.05 + 4 * sum(info["largest_units"])
                + SLACK, save_slack=SLACK)


def check(rows: dict, info: dict, world_size: int) -> list:
    """The bound's verdicts for zk's ranks: ``[(what, measured, bound, ok)]``."""
    b = bounds(info, world_size)
    out = []
    for r, res in enumerate(rows["zk"]):
        pk = res["peaks"]
        bl = max(pk["build"]["peak"], pk["load"]["peak"])
        out.append((f"rank {r} build+load", bl, b["build_load"], bl <= b["build_load"]))
        lim = pk["train"]["peak"] + b["save_slack"]
        out.append((f"rank {r} save", pk["save"]["peak"], lim, pk["save"]["peak"] <= lim))
    return out


def estimate_row(size: str, world_size: int):
    """zkernels' estimate of the same phases (``estimate_phases``), or None if absent."""
    try:
        from zkernels.zero.planning.phases import estimate_phases
    except ImportError:
        return None
    import torch
    import transformers
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config(size))
    ph = estimate_phases(model, world_size, stage=3, file_dtype=torch.bfloat16,
                         file_bytes=SHARD_BYTES)
    return {k: ph.peak_bytes(k) for k in PHASES}


def run(size: str, methods, world_size: int, timeout_s: float):
    _on_path()
    with tempfile.TemporaryDirectory(prefix="zk-build-peak-") as tmp:
        src = os.path.join(tmp, "src")
        info = write_checkpoint(size, src)
        rows = {}
        for m in methods:
            t0 = time.perf_counter()
            rows[m] = launch(_run, {"method": m, "size": size, "src": src,
                                    "out": os.path.join(tmp, "out")}, world_size, timeout_s)
            info.setdefault("seconds", {})[m] = time.perf_counter() - t0
    return info, rows


def table(info: dict, rows: dict, world_size: int, est) -> str:
    psi = info["num_params"]
    b = bounds(info, world_size)
    lines = [f"{psi / 1e6:.1f}M parameters, {world_size} ranks, fp32 + AdamW, bf16 files; "
             f"peak RSS above the post-import baseline, largest rank, MiB "
             f"(file: mapped file pages at their sampled peak)", "",
             "| method | build | load | train | save | load: file | note |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for m, ranks in rows.items():
        errs = [r["error"] for r in ranks if "error" in r]
        cells = []
        for ph in PHASES:
            vals = [r["peaks"][ph]["peak"] for r in ranks if ph in r.get("peaks", {})]
            cells.append(f"{max(vals) / MIB:.0f}" if len(vals) == len(ranks) else "-")
        files = [r["peaks"]["load"]["file"] for r in ranks if "load" in r.get("peaks", {})]
        cells.append(f"{max(files) / MIB:.0f}" if files else "-")
        note = errs[0] if errs else ""
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {note} |")
    if est:
        lines.append("| zk estimate (`estimate_phases`) | " + " | ".join(
            f"{est[ph] / MIB:.0f}" for ph in PHASES) + " | | |")
    lines += ["", f"Bound (zk): build and load <= 12Ψ/N·1.05 + two largest units in fp32 + "
              f"128 MiB = {b['build_load'] / MIB:.0f} MiB; save <= train peak + 128 MiB."]
    if "zk" in rows and not any("error" in r for r in rows["zk"]):
        for what, got, lim, ok in check(rows, info, world_size):
            lines.append(f"- {what}: {got / MIB:.0f} MiB <= {lim / MIB:.0f} MiB: "
                         f"{'met' if ok else 'NOT met'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="170m")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--json", default=None, help="write every rank's figures here")
    args = p.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise SystemExit(f"--methods: unknown {bad}; choose from {list(METHODS)}")
    est = estimate_row(args.size, args.world_size)
    info, rows = run(args.size, methods, args.world_size, args.timeout_s)
    print(table(info, rows, args.world_size, est))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(info=info, world_size=args.world_size, rows=rows, estimate=est,
                           bounds=bounds(info, args.world_size)), f, indent=1)
    if "zk" not in rows:
        return 0
    if any("error" in r for r in rows["zk"]):
        return 1
    return 0 if all(v[3] for v in check(rows, info, args.world_size)) else 1


if __name__ == "__main__":
    sys.exit(main())
