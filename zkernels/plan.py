"""``python -m zkernels plan``: print the ladder for a model and mark the rung that fits.

The model is a parameter count (``--params 7.5e9``), a Hugging Face ``config.json`` (counted by
:func:`params_from_hf_config`, no transformers import) or a ``module:function`` factory that
returns an ``nn.Module``. Bytes per rank come from :func:`zkernels.estimate_memory`.
"""
from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from dataclasses import asdict
from typing import List, Optional

from .zero.estimate import estimate_memory, parse_dtype
from .zero.ladder import NoRungFitsError, choose_rung
from .zero.policy import RUNGS, implemented_stages, rung_implemented
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_GATED_MLP_TYPES = {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "gemma",
                    "gemma2", "gemma3_text", "phi3", "olmo", "olmo2", "granite", "cohere"}


def parse_bytes(text: str, name: str = "--device-memory") -> int:
    """'80GB' -> 80e9, '24GiB' -> 24 * 2**30, '1.5e9' -> bytes (decimal and binary units)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS | {"": 1}:
        raise ValueError(f"{name} must be a size like 80GB, 24GiB or 1.5e9, got {text!r}")
    return int(float(m.group(1)) * _UNITS.get(unit, 1))


def params_from_hf_config(cfg: dict) -> int:
    """Parameters of a decoder-only transformer from its Hugging Face config (biases ignored:
    well under 0.1% for models of this size).

    Ψ = V·h·(1 if tied else 2) + P·h (learned positions: GPT-2-style configs with
    n_positions/max_position_embeddings and no rotary) + L·(h·(h + 2·h_kv) + h·h
    + E·m·h·I + 2h) + h, with V vocab, h hidden size, L layers, h_kv = h·kv_heads/heads, I the
    MLP width (default 4h), m = 3 for gated MLPs (llama family, silu) else 2, E experts (MoE).
    """
    def get(*keys, default=None):
        for k in keys:
            if k in cfg and cfg[k] is not None:
                return cfg[k]
        if default is None:
            raise ValueError(f"config.json has none of {keys}: cannot count parameters")
        return default

    h = int(get("hidden_size", "n_embd", "d_model"))
    num_layers = int(get("num_hidden_layers", "n_layer", "num_layers"))
    vocab = int(get("vocab_size"))
    heads = int(get("num_attention_heads", "n_head", default=1))
    kv_heads = int(get("num_key_value_heads", default=heads))
    inter = int(get("intermediate_size", "n_inner", "ffn_dim", default=4 * h) or 4 * h)
    model_type = str(cfg.get("model_type", ""))
    gated = model_type in _GATED_MLP_TYPES or cfg.get("hidden_act") in ("silu", "swiglu")
    experts = int(get("num_local_experts", "num_experts", default=1))
    tied = bool(cfg.get("tie_word_embeddings", True))
    rotary = "rope_theta" in cfg or "rotary_dim" in cfg or model_type in _GATED_MLP_TYPES
    positions = 0 if rotary else int(get("n_positions", "max_position_embeddings", default=0))
    h_kv = h * kv_heads // heads
    per_layer = h * (h + 2 * h_kv) + h * h + experts * (3 if gated else 2) * h * inter + 2 * h
    return vocab * h * (1 if tied else 2) + positions * h + num_layers * per_layer + h


def load_model_spec(spec: str):
    """A config.json path -> parameter count; 'module:function' -> the nn.Module it returns."""
    if spec.endswith(".json"):
        with open(spec) as f:
            return params_from_hf_config(json.load(f))
    if ":" not in spec:
        raise ValueError(f"--model must be a config.json path or 'module:function', got {spec!r}")
    mod_name, fn_name = spec.split(":", 1)
    fn = getattr(importlib.import_module(mod_name), fn_name, None)
    if not callable(fn):
        raise ValueError(f"--model {spec!r}: {mod_name} has no callable {fn_name!r}")
    import torch
    model = fn()
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"--model {spec!r} returned {type(model).__name__}, not an nn.Module")
    return model


def _fmt(value: float, unit: int) -> str:
    v = value / unit
    return f"{v:.1f}" if v >= 1 or v == 0 else f"{v:.3g}"


def ladder_table(model, world_size: int, *, param_dtype, reduce_dtype, grad_shard_dtype,
                 bucket_bytes: Optional[int],
                 device_bytes: Optional[int], headroom: float, host_bytes: Optional[int] = None,
                 disk_bytes: Optional[int] = None):
    """Rows (estimates of data parallel and every rung) and the choice; see :func:`main`."""
    kw = dict(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
              grad_shard_dtype=grad_shard_dtype, bucket_bytes=bucket_bytes)
    rows = [estimate_memory(model, world_size, 0, **kw)]
    rows += [estimate_memory(model, world_size, s, offload=o, **kw) for s, o in RUNGS]
    choice = None
    if device_bytes is not None:
        try:
            choice = choose_rung(model, world_size, device_bytes, headroom=headroom,
                                 host_budget_bytes=host_bytes, disk_budget_bytes=disk_bytes,
                                 **kw)
        except NoRungFitsError as exc:
            choice = exc
    return rows, choice


def render(rows, choice, unit_name: str = "GB") -> str:
    unit = _UNITS[unit_name.lower()]
    cols = ["rung", "params", "grads", "master", "optim", "states", "buffers", "transient",
            "device", "host", "disk", "comm/step"]
    chosen = None if choice is None or isinstance(choice, Exception) else choice[0]
    body = []
    for e in rows:
        mark = "*" if chosen == (e.stage, e.offload) else " "
        vals = [e.params_bytes, e.grads_bytes, e.master_bytes, e.optimizer_states_bytes,
                e.model_states_bytes, e.buffers_bytes, e.transient_bytes, e.device_bytes,
                e.host_bytes, e.disk_bytes, e.comm_bytes]
        body.append([f"{mark} {e.name}"] + [_fmt(v, unit) for v in vals])
    widths = [max(len(r[i]) for r in body + [cols]) for i in range(len(cols))]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                               for i, (c, w) in enumerate(zip(r, widths)))
    out = [line(cols), line(["-" * w for w in widths])] + [line(r) for r in body]
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zkernels plan", description=(
        "Bytes per rank (by kind and location) and bytes sent per step for each rung of the "
        "ZeRO ladder; '*' marks the rung stage='auto' would take for --device-memory."))
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=float, help="number of parameters, e.g. 7.5e9")
    src.add_argument("--model", help="a Hugging Face config.json (parameters counted from "
                     "its sizes, no transformers needed), or 'module:function' returning an "
                     "nn.Module")
    ap.add_argument("--world-size", type=int, required=True, help="ranks N")
    ap.add_argument("--param-dtype", default="bf16", help="compute dtype: bf16 (default), "
                    "fp16, or fp32 (no master copy)")
    ap.add_argument("--reduce-dtype", default="fp32", help="gradient reduction dtype (fp32, "
                    "ZeroOptimizer's default)")
    ap.add_argument("--grad-shard-dtype", default="fp32", help="dtype of the gradient shard "
                    "kept at stages 2-3 (fp32, as ZeroOptimizer keeps it)")
    ap.add_argument("--paper", action="store_true", help="the ZeRO paper's recipe: fp16 "
                    "params, gradients reduced and sharded in fp16 (overrides the dtypes)")
    ap.add_argument("--bucket-bytes", default="auto", help="gradient bucket size, e.g. 25MiB, "
                    "or auto (default: sized from the model, as ZeroOptimizer does)")
    ap.add_argument("--device-memory", default=None, help="memory per device, e.g. 80GB, "
                    "24GiB: marks the lowest rung that fits")
    ap.add_argument("--headroom", type=float, default=0.10, help="fraction of "
                    "--device-memory kept for activations etc. (0.10)")
    ap.add_argument("--host-memory", default=None, help="host RAM per rank for offload rungs")
    ap.add_argument("--disk", default=None, help="disk per rank for nvme offload")
    ap.add_argument("--unit", default="GB", choices=["GB", "GiB", "MB", "MiB", "KB", "B"])
    ap.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    args = ap.parse_args(argv)
    try:
        if args.world_size < 1:
            raise ValueError(f"--world-size must be >= 1, got {args.world_size}")
        model = args.params if args.params is not None else load_model_spec(args.model)
        if args.paper:
            args.param_dtype = args.reduce_dtype = args.grad_shard_dtype = "fp16"
        pdt = parse_dtype(args.param_dtype, "--param-dtype")
        rdt = parse_dtype(args.reduce_dtype, "--reduce-dtype")
        gdt = parse_dtype(args.grad_shard_dtype, "--grad-shard-dtype")
        size = lambda s, n: None if s is None else parse_bytes(s, n)  # noqa: E731
        rows, choice = ladder_table(
            model, args.world_size, param_dtype=pdt, reduce_dtype=rdt, grad_shard_dtype=gdt,
            bucket_bytes=None if args.bucket_bytes == "auto" else
            size(args.bucket_bytes, "--bucket-bytes"),
            device_bytes=size(args.device_memory, "--device-memory"), headroom=args.headroom,
            host_bytes=size(args.host_memory, "--host-memory"), disk_bytes=size(args.disk,
                                                                               "--disk"))
    except (ValueError, TypeError, ImportError, OSError) as exc:
        print(f"zkernels plan: error: {exc}", file=sys.stderr)
        return 2
    e0 = rows[0]
    name = lambda d: str(d).replace("torch.", "")  # noqa: E731
    print(f"{e0.num_params:,} params, {args.world_size} ranks, params {name(pdt)}, grads "
          f"reduced in {name(rdt)} and sharded in {name(gdt)}, fp32 AdamW"
          f"{' + fp32 master' if e0.master_bytes else ''}; {args.unit} per rank. states = "
          f"params + grads + master + optim (the ZeRO paper's count); transient = inside a "
          f"step only (stage 1's reduced shards, stage 3's gathered layers); device = peak; "
          f"comm = bytes sent per step")
    if args.model and args.model.endswith(".json"):
        print("Ψ from config.json: V·h·(1 if tied else 2) + P·h (learned positions) + "
              "L·(h·(h + 2·h_kv) + h·h + E·m·h·I + 2h) + h, biases not counted "
              "(see zkernels.plan.params_from_hf_config)")
    print(render(rows, choice, args.unit))
    if isinstance(choice, Exception):
        print(f"\nnothing fits: {choice}")
    elif choice is not None:
        (stage, offload), _, reason = choice
        avail = "" if rung_implemented(stage, offload) else (
            f" (not available in this version, which implements stages "
            f"{', '.join(map(str, implemented_stages()))})")
        print(f"\nchosen for {args.device_memory} per device: {reason}{avail}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [asdict(e) | {"name": e.name,
                                             "model_states_bytes": e.model_states_bytes}
                                for e in rows],
                       "chosen": None if choice is None or isinstance(choice, Exception)
                       else list(choice[0])}, f, indent=1)
    return 1 if isinstance(choice, Exception) else 0
