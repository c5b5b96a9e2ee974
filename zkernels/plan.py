"""``python -m zkernels plan``: print the ladder for a model and mark the rung that fits.

The model is a parameter count (``--params 7.5e9``), a Hugging Face ``config.json`` (counted on
transformers' own model built on the meta device when transformers is installed, else by
:func:`zkernels.hf_params.params_from_hf_config`) or a ``module:function`` factory that returns
an ``nn.Module``. Bytes per rank come from :func:`zkernels.estimate_memory`.

[Note: comparing rungs]
Every row, data parallel included, reduces gradients in the same dtype (``--reduce-dtype``),
shown in the table's last column: data parallel all-reduces them (2·r·Ψ·(N−1)/N bytes sent),
stages 1-2 reduce-scatter them and all-gather the parameters in the compute dtype
((r + p)·Ψ·(N−1)/N). With r = p (``--reduce-dtype bf16``, ``--paper``) the two are equal: the
paper's 2Ψ. With an fp32 reduction of bf16 parameters stages 1-2 send less than data parallel,
whose all-gather half carries fp32 gradients. A data parallel row reduced in its own dtype would
compare a bf16 all-reduce with an fp32 reduce-scatter.

[Note: when compressed communication pays]
``--link-gbps G`` adds each row's communication time per step (bytes sent × 8 / G: the
bandwidth term of one link, with no latency and no overlap with compute) and, after the
ladder, the quantized collectives (ZeRO++'s qwZ and qgZ: ``ZeroOptimizer(quantize_weights=,
quantize_grads=)``) as choices: for the chosen rung (or, without ``--device-memory``, for stages
1-3) the same rung with int8 or int4 gradients and, at stage 3, int8 weights alone and with
int4 gradients. They hold the same memory and send fewer bytes; the last lines say how much
time per step each saves at G. Compression pays when that time is not already hidden behind
compute (a step whose compute takes longer than its communication gains little) and exceeds
the quantize/dequantize cost (a pass over the bytes on the device, small beside a slow link);
training quality is measured in benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from dataclasses import asdict
from typing import List, NamedTuple, Optional

from ._cli import _UNITS, byte_size, output_file, param_count, parse_bytes, positive_int
from .hf_params import (count_hf_config, gathered_from_hf_config, largest_unit_from_hf_config,
                        params_from_hf_config)
from .optimizers import REGISTRY
from .zero.planning.estimate import comm_seconds, estimate_memory, parse_dtype
from .zero.planning.phases import PHASES, estimate_phases
from .zero.planning.ladder import NoRungFitsError, choose_rung, ladder_rows, quantized_choices

__all__ = ["ladder_table", "load_model_spec", "main", "params_from_hf_config", "parse_bytes",
           "render"]


def load_model_spec(spec: str):
    """A config.json path -> (parameter count, how it was counted, parameters stage 3 gathers
    at once); 'module:function' -> (the nn.Module it returns, None, None: counted from its
    units)."""
    if spec.endswith(".json"):
        with open(spec) as f:
            cfg = json.load(f)
        if not isinstance(cfg, dict):
            raise ValueError(f"--model {spec}: not a Hugging Face config (a JSON object)")
        num, how = count_hf_config(cfg)
        return num, how, gathered_from_hf_config(cfg, num)
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
    return model, None, None


def _fmt(value: float, unit: int) -> str:
    v = value / unit
    return f"{v:.1f}" if v >= 1 or v == 0 else f"{v:.3g}"


def ladder_table(model, world_size: int, *, param_dtype, reduce_dtype, grad_shard_dtype,
                 bucket_bytes: Optional[int],
                 device_bytes: Optional[int], headroom: float, host_bytes: Optional[int] = None,
                 disk_bytes: Optional[int] = None, frozen_numel: Optional[int] = None,
                 frozen_dtype=None, shard_size: Optional[int] = None,
                 link_gbps: Optional[float] = None, gathered_numel: Optional[int] = None,
                 optimizer="adamw", optimizer_kwargs: Optional[dict] = None,
                 state_dtype=None, master_dtype=None):
    """Rows (estimates of data parallel and every rung) and the choice; see :func:`main`.
    ``link_gbps``: also rows for the quantized collectives (see [Note: when compressed
    communication pays]), after the ladder's.
    ``frozen_numel``: with a parameter count, how many of them are frozen (a module counts its
    own), see [Note: frozen parameters in the estimate] in ``zero/planning/estimate.py``.
    ``shard_size``: hybrid sharding's K (the rungs shard over K ranks, data parallel
    nothing). ``gathered_numel``: with a parameter count, the parameters stage 3 gathers at
    once (its transient column; a module counts its own units). ``optimizer``,
    ``optimizer_kwargs``: as ``estimate_memory`` takes them (its state bytes per element).
    ``state_dtype``: the fused AdamW's moments in bf16 or "int8" (on every rung, NVMe's files
    and slots too). ``master_dtype``: torch.bfloat16 for a bf16 master on the ZeRO rungs (data
    parallel keeps its own)."""
    kw = dict(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
              grad_shard_dtype=grad_shard_dtype, bucket_bytes=bucket_bytes,
              shard_size=shard_size, gathered_numel=gathered_numel, optimizer=optimizer,
              optimizer_kwargs=optimizer_kwargs)
    if state_dtype is not None:
        kw["state_dtype"] = state_dtype
    if frozen_numel is not None:
        kw.update(frozen_numel=frozen_numel, frozen_dtype=frozen_dtype)
    rows = [estimate_memory(model, world_size, 0, **kw)]
    if master_dtype is not None:
        kw["master_dtype"] = master_dtype
    rows += [estimate_memory(model, world_size, s, offload=o, offload_params=op, **kw)
             for s, o, op in ladder_rows()]
    choice = None
    if device_bytes is not None:
        try:
            choice = choose_rung(model, world_size, device_bytes, headroom=headroom,
                                 host_budget_bytes=host_bytes, disk_budget_bytes=disk_bytes,
                                 **kw)
        except NoRungFitsError as exc:
            choice = exc
    if link_gbps is not None:
        comm_seconds(0, link_gbps)   # checked before rows are added
        if choice is not None and not isinstance(choice, Exception):
            (stage, offload), est, _ = choice
            bases = [(stage, offload, est.offload_params)]
        else:
            bases = [(s, None, False) for s in (1, 2, 3)]
        rows += [estimate_memory(model, world_size, s, offload=o, offload_params=op,
                                 quantize_weights=qw, quantize_grads=qg, **kw)
                 for s, o, op in bases for qw, qg in quantized_choices(s)]
    return rows, choice


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "").replace("float32", "fp32").replace(
        "bfloat16", "bf16").replace("float16", "fp16")


def render(rows, choice, unit_name: str = "GB", reduce_dtype=None,
           link_gbps: Optional[float] = None) -> str:
    """The table: one row per rung, sizes in ``unit_name``, '*' on the chosen rung; with
    ``link_gbps`` a column of communication seconds per step."""
    unit = _UNITS[unit_name.lower()]
    cols = ["rung", "params", "grads", "master", "optim", "states", "buffers", "transient",
            "device", "host", "disk", "comm/step", "reduce"]
    if link_gbps is not None:
        cols[-1:-1] = ["comm s"]
    hybrid = any(e.shard_size is not None for e in rows)
    if hybrid:  # hybrid sharding: where the bytes go (the cross-group link is the slow one)
        cols[-1:-1] = ["within", "across"]
    chosen = None if choice is None or isinstance(choice, Exception) else \
        (*choice[0], choice[1].offload_params)
    reduce_name = _dtype_name(reduce_dtype) if reduce_dtype is not None else "fp32"
    body = []
    for e in rows:
        quantized = e.quantize_weights is not None or e.quantize_grads is not None
        mark = "*" if chosen == (e.stage, e.offload, e.offload_params) and not quantized \
            else " "
        vals = [e.params_bytes, e.grads_bytes, e.master_bytes, e.optimizer_states_bytes,
                e.model_states_bytes, e.buffers_bytes, e.transient_bytes, e.device_bytes,
                e.host_bytes, e.disk_bytes, e.comm_bytes]
        if hybrid:
            vals += [e.comm_within_group_bytes, e.comm_across_groups_bytes]
        times = [f"{e.comm_seconds(link_gbps):.3g}"] if link_gbps is not None else []
        body.append([f"{mark} {e.name}"] + [_fmt(v, unit) for v in vals] + times +
                    [reduce_name])
    widths = [max(len(r[i]) for r in body + [cols]) for i in range(len(cols))]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                               for i, (c, w) in enumerate(zip(r, widths)))
    out = [line(cols), line(["-" * w for w in widths])] + [line(r) for r in body]
    return "\n".join(out)


def phase_rows(model, world_size: int, rows, *, file_dtype, max_unit_numel=None, **kw):
    """``[(rung name, PhaseEstimate)]`` for the ZeRO rungs of ``rows`` (not data parallel,
    not the quantized rows): bytes per rank while building on the meta device and loading
    ``file_dtype`` files, training and saving (see [Note: memory while building, loading and
    saving] in ``zero/planning/phases.py``). ``kw``: ``ladder_table``'s estimate keywords;
    ``max_unit_numel``: stage 3's largest unit for a parameter count (a module counts its
    own; None: not counted)."""
    out = []
    for e in rows:
        if e.stage == 0 or e.quantize_weights is not None or e.quantize_grads is not None:
            continue
        unit = {"max_unit_numel": max_unit_numel} \
            if max_unit_numel is not None and isinstance(model, int) else {}
        out.append((e.name, estimate_phases(model, world_size, e.stage, offload=e.offload,
                                            offload_params=e.offload_params,
                                            file_dtype=file_dtype, **unit, **kw)))
    return out


def render_phases(phases, unit_name: str = "GB") -> str:
    """The start-up table: per ZeRO rung, the peak per rank while building on the meta device
    (``build``), loading pretrained files (``load``), training (``train``) and saving."""
    unit = _UNITS[unit_name.lower()]
    cols = ["rung"] + list(PHASES)
    body = [[name] + [_fmt(ph.peak_bytes(k), unit) for k in PHASES]
            for name, ph in phases]
    widths = [max(len(r[i]) for r in body + [cols]) for i in range(len(cols))]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                               for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(r) for r in body])


def _compression_lines(rows, link_gbps: float) -> str:
    """What each quantized row saves per step against its rung at ``link_gbps`` (see [Note:
    when compressed communication pays])."""
    plain = {(e.stage, e.offload, e.offload_params): e for e in rows
             if e.quantize_weights is None and e.quantize_grads is None}
    out = [f"\nat {link_gbps:g} Gbit/s (bandwidth only, no overlap with compute; see [Note: "
           f"when compressed communication pays] in zkernels/plan.py):"]
    for e in rows:
        if e.quantize_weights is None and e.quantize_grads is None:
            continue
        base = plain[(e.stage, e.offload, e.offload_params)]
        t0, t1 = base.comm_seconds(link_gbps), e.comm_seconds(link_gbps)
        ratio = e.comm_bytes / base.comm_bytes if base.comm_bytes else 1.0
        out.append(f"  {e.name}: {ratio:.2f}x the bytes of {base.name}, "
                   f"{t0 - t1:.3g} s less communication per step ({t1:.3g} s instead of "
                   f"{t0:.3g} s)")
    return "\n".join(out)


class Trainable(NamedTuple):
    """``--trainable`` as written: a fraction of the parameters, or a count of them."""
    value: float        # a fraction in (0, 1], or a whole count >= 1
    is_count: bool
    explicit: bool      # a count written with its unit, '2p': taken however small
    text: str


# A bare count under this fraction of the model is refused: '--trainable 2' is far more often
# 2% (or 0.02) mistyped than a model with two trainable parameters.
SMALL_COUNT = 0.01


def _trainable(text: str) -> Trainable:
    """``--trainable``: a fraction in (0, 1] (``0.01``, or ``1%``), a count >= 2 (``4e6``) or
    a count with its unit ``p`` (``2p``: parameters, however few)."""
    pct, explicit = text.endswith("%"), text.lower().endswith("p")
    try:
        value = float(text[:-1] if pct or explicit else text)
    except ValueError:
        value = float("nan")
    if pct:
        value /= 100
    whole = math.isfinite(value) and value == int(value)
    if explicit and not (value >= 1 and whole):
        raise argparse.ArgumentTypeError(f"a count of parameters written with p must be a "
                                         f"whole number >= 1 (2p, 4e6p), got {text!r}")
    if not (explicit or 0 < value <= 1 or (not pct and value >= 2 and whole)):
        raise argparse.ArgumentTypeError(f"must be a fraction of the parameters in (0, 1] "
                                         f"(0.01 or 1%), a whole count >= 2 (4e6) or a count "
                                         f"with p (2p), got {text!r}")
    count = explicit or value > 1
    return Trainable(int(value) if count else value, count, explicit, text)


def frozen_from_trainable(num_params: int, trainable: Optional[Trainable]) -> Optional[int]:
    """The frozen count ``--trainable`` implies for ``num_params`` parameters (None: all
    train). ``trainable``: ``--trainable`` parsed (:class:`Trainable`).

    Raises:
        ValueError: a count larger than ``num_params``, or a bare count below 1% of them
            (written without ``p``).
    """
    if trainable is None:
        return None
    if not trainable.is_count:
        return num_params - max(round(num_params * trainable.value), 1)
    count = int(trainable.value)
    if count > num_params:
        raise ValueError(f"--trainable {count:,} exceeds the model's {num_params:,} "
                         f"parameters")
    if not trainable.explicit and count < SMALL_COUNT * num_params:
        share = f"{count / 100:g} or {count}%" if count <= 100 else "e.g. 0.01 or 1%"
        raise ValueError(f"--trainable {trainable.text} means {count:,} parameters, under "
                         f"{SMALL_COUNT:.0%} of the model's {num_params:,}: write "
                         f"{trainable.text}p if you mean that count, or a fraction "
                         f"({share}) for a share")
    return num_params - count


def _headroom(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1), got {text!r}")
    return value


def _gbps(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a bandwidth in Gbit/s > 0, e.g. 100, got "
                                         f"{text!r}")
    return value


_BUCKET_SIZE = byte_size("--bucket-bytes", "B")


def _bucket_bytes(text: str):
    """``--bucket-bytes``: "auto" (None: sized from the model) or a size."""
    return None if text == "auto" else _BUCKET_SIZE(text)


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m zkernels plan", description=(
        "Bytes per rank (by kind and location) and bytes sent per step for each rung of the "
        "ZeRO ladder; '*' marks the rung stage='auto' would take for --device-memory. Sizes "
        "need a unit: 80GB, 24GiB, 512MB (a bare number is refused, except for "
        "--bucket-bytes, where it is bytes)."))
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=param_count, help="number of parameters, e.g. 7.5e9")
    src.add_argument("--model", help="a Hugging Face config.json (counted on transformers' "
                     "model built on the meta device when transformers is installed, else "
                     "from its sizes; nothing is downloaded), or 'module:function' returning "
                     "an nn.Module")
    ap.add_argument("--trainable", type=_trainable, default=None, help="the parameters that "
                    "train, as a fraction (0.01 or 1%%) or a count (4e6); the rest are frozen "
                    "(a LoRA's base: no gradient, no optimizer state; sharded at stage 3). A "
                    "count below 1%% of the model's parameters is refused unless written with "
                    "p (2p: two parameters), as 2 is more likely 2%% mistyped. "
                    "Default: all. A 'module:function' model counts its own (requires_grad)")
    ap.add_argument("--frozen-dtype", default="fp32", help="dtype the frozen parameters are "
                    "loaded in (fp32, default; bf16 for a base loaded in bf16): their bytes at "
                    "data parallel and stages 1-2; stage 3 keeps them in --param-dtype")
    ap.add_argument("--world-size", type=positive_int, required=True, help="ranks N")
    ap.add_argument("--shard-size", type=positive_int, default=None, metavar="K",
                    help="hybrid sharding: shard over groups of K ranks (K divides N), "
                    "replicate across the N/K groups; adds the bytes sent within and across "
                    "groups")
    ap.add_argument("--param-dtype", default="bf16", help="compute dtype: bf16 (default), "
                    "fp16, or fp32 (no master copy)")
    ap.add_argument("--reduce-dtype", default="fp32", help="gradient reduction dtype of every "
                    "row, data parallel included (fp32, ZeroOptimizer's default)")
    ap.add_argument("--grad-shard-dtype", default="fp32", help="dtype of the gradient shard "
                    "kept at stages 2-3 (fp32, as ZeroOptimizer keeps it)")
    ap.add_argument("--paper", action="store_true", help="the ZeRO paper's recipe: fp16 "
                    "params, gradients reduced and sharded in fp16 (overrides the dtypes)")
    ap.add_argument("--bucket-bytes", type=_bucket_bytes, default="auto",
                    help="gradient bucket size (a bare number is bytes), or auto (default: "
                    "sized from the model, as ZeroOptimizer does)")
    ap.add_argument("--device-memory", type=byte_size("--device-memory"), default=None,
                    metavar="SIZE", help="memory per device with its unit, e.g. 80GB, 24GiB: "
                    "marks the lowest rung that fits")
    ap.add_argument("--headroom", type=_headroom, default=0.10, help="fraction of "
                    "--device-memory kept for activations etc. (0.10)")
    ap.add_argument("--host-memory", type=byte_size("--host-memory"), default=None,
                    metavar="SIZE", help="host RAM per rank for offload rungs, e.g. 256GB")
    ap.add_argument("--disk", type=byte_size("--disk"), default=None, metavar="SIZE",
                    help="disk per rank for nvme offload, e.g. 2TB")
    ap.add_argument("--link-gbps", type=_gbps, default=None, metavar="G",
                    help="link bandwidth per rank in Gbit/s: adds each row's communication "
                    "time per step (bytes x 8 / G) and the quantized collectives "
                    "(quantize_weights / quantize_grads) as choices, with the time they save")
    ap.add_argument("--unit", default="GB", choices=["GB", "GiB", "MB", "MiB", "KB", "KiB",
                                                     "B"])
    ap.add_argument("--optimizer", default="adamw", help="adamw (default: the fused AdamW, "
                    "8 B/param of state), a fused element-wise definition ("
                    + ", ".join(n for n in REGISTRY if n != "adamw") + ": the bytes of its "
                    "states) or a torch.optim element-wise class by name (adam, adagrad, "
                    "rmsprop, ...): its state bytes per parameter; muon or "
                    "adafactor (whole matrices on owner ranks) also add the owners' exchanges "
                    "to comm (2·4·Ψ·(N-1)/N² per step)")
    ap.add_argument("--state-dtype", default="fp32", choices=["fp32", "bf16", "int8"],
                    help="the fused AdamW's moments: fp32 (8 B/param), bf16 (4) or int8 "
                    "blockwise (2 + 8 per block of 256); a fused definition's states: the "
                    "low-bit forms it lists (bf16: 2 B per state)")
    ap.add_argument("--master-dtype", default="fp32", choices=["fp32", "bf16"],
                    help="the fused AdamW's master on the ZeRO rungs: fp32 (4 B/param) or "
                    "bf16 (with --param-dtype bf16: the weights themselves, 0 B/param; 2 with "
                    "CPU offload and NVMe)")
    ap.add_argument("--momentum", type=float, default=None, help="the optimizer's momentum "
                    "(sgd, rmsprop): SGD keeps a 4 B/param buffer only with momentum")
    ap.add_argument("--file-dtype", default="bf16", help="dtype of the pretrained files "
                    "the start-up table loads (default bf16)")
    ap.add_argument("--json", type=output_file, default=None, metavar="PATH",
                    help="also write the rows as JSON to this file (its folder must exist)")
    args = ap.parse_args(argv)
    if args.shard_size is not None and args.world_size % args.shard_size:
        ap.error(f"--shard-size must divide --world-size ({args.world_size}), got "
                 f"{args.shard_size}")
    return args


def _master_dtype(args):
    """``--master-dtype`` as ``master_dtype`` (None: fp32)."""
    return None if args.master_dtype == "fp32" else parse_dtype(args.master_dtype,
                                                                "--master-dtype")


def _phases_for(args, model, rows, pdt, rdt, gdt, frozen, gathered):
    """:func:`phase_rows` with ``main``'s keywords (a config.json's largest unit)."""
    unit = None
    if args.model is not None and args.model.endswith(".json"):
        with open(args.model) as f:
            unit = largest_unit_from_hf_config(json.load(f), model)
    kw = dict(param_dtype=pdt, reduce_dtype=rdt, grad_shard_dtype=gdt,
              bucket_bytes=args.bucket_bytes, shard_size=args.shard_size,
              gathered_numel=gathered, optimizer=args.optimizer,
              optimizer_kwargs={} if args.momentum is None else {"momentum": args.momentum},
              state_dtype=None if args.state_dtype == "fp32" else args.state_dtype,
              **({} if _master_dtype(args) is None else {"master_dtype": _master_dtype(args)}))
    if frozen is not None:
        kw.update(frozen_numel=frozen, frozen_dtype=parse_dtype(args.frozen_dtype,
                                                                "--frozen-dtype"))
    return phase_rows(model, args.world_size, rows, file_dtype=parse_dtype(
        args.file_dtype, "--file-dtype"), max_unit_numel=unit, **kw)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    how = gathered = None
    try:
        if args.params is not None:
            model = args.params
        else:
            model, how, gathered = load_model_spec(args.model)
        if args.trainable is not None and not isinstance(model, int):
            raise ValueError("--trainable applies to --params or a config.json: a "
                             "'module:function' model's frozen parameters are counted from "
                             "requires_grad")
        frozen = frozen_from_trainable(model, args.trainable) if isinstance(model, int) \
            else None
        if args.paper:
            args.param_dtype = args.reduce_dtype = args.grad_shard_dtype = "fp16"
        pdt = parse_dtype(args.param_dtype, "--param-dtype")
        rdt = parse_dtype(args.reduce_dtype, "--reduce-dtype")
        gdt = parse_dtype(args.grad_shard_dtype, "--grad-shard-dtype")
        rows, choice = ladder_table(
            model, args.world_size, param_dtype=pdt, reduce_dtype=rdt, grad_shard_dtype=gdt,
            bucket_bytes=args.bucket_bytes, device_bytes=args.device_memory,
            headroom=args.headroom, host_bytes=args.host_memory, disk_bytes=args.disk,
            frozen_numel=frozen,
            frozen_dtype=parse_dtype(args.frozen_dtype, "--frozen-dtype") if frozen else None,
            shard_size=args.shard_size, link_gbps=args.link_gbps, gathered_numel=gathered,
            optimizer=args.optimizer, optimizer_kwargs=(
                {} if args.momentum is None else {"momentum": args.momentum}),
            state_dtype=None if args.state_dtype == "fp32" else args.state_dtype,
            master_dtype=_master_dtype(args))
        phases = _phases_for(args, model, rows, pdt, rdt, gdt, frozen, gathered)
    except (ValueError, TypeError, ImportError, OSError) as exc:
        print(f"zkernels plan: error: {exc}", file=sys.stderr)
        return 2
    e0 = rows[0]
    uncounted = ", not counted for --params: no layer sizes" if args.params is not None else ""
    p, r, g = (_dtype_name(d) for d in (pdt, rdt, gdt))
    split = f" ({e0.trainable_numel:,} trainable, {e0.frozen_numel:,} frozen: no grads or " \
        f"states, whole at data parallel and stages 1-2, sharded at stage 3)" \
        if e0.frozen_numel else ""
    print(f"{e0.num_params:,} params{split}, {args.world_size} ranks, params {p}, grads reduced in "
          f"{r} on every rung and sharded in {g}, {args.state_dtype} {args.optimizer}"
          f"{' + fp32 master' if e0.master_bytes else ''}"
          f"{' (bf16 on the ZeRO rungs)' if args.master_dtype == 'bf16' else ''}; "
          f"{args.unit} per rank. states = "
          f"params + grads + master + optim (the ZeRO paper's count); transient = inside a "
          f"step only (stage 1's reduced shards, stage 3's gathered units: the root and two "
          f"layers{uncounted}); device = peak; "
          f"comm = bytes sent per step: data parallel all-reduces the grads in {r} (2·r·Ψ), "
          f"stages 1-2 reduce-scatter them in {r} and all-gather the params in {p} "
          f"((r + p)·Ψ: " + ("equal to data parallel's, the paper's 2Ψ" if r == p else
                             "the paper's 2Ψ when r = p") + "), times (N-1)/N")
    if e0.comm_matrix_bytes or rows[-1].comm_matrix_bytes:
        print(f"{args.optimizer}: comm adds the owners' exchanges of the whole matrices "
              f"(gradient pieces to the owners, updated pieces back): 2·4·Ψ·(N-1)/N² on "
              f"the rungs, Ψ counted as matrices")
    if args.shard_size is not None:
        k = args.shard_size
        print(f"hybrid: the rungs shard over groups of K = {k} ranks (bytes per rank: N -> K) "
              f"and replicate across {args.world_size // k} groups; within = the group's "
              f"collectives times (K-1)/K, across = the all-reduce of the gradient shard "
              f"(2·r·Ψ/K times (G-1)/G, G = N/K)")
    if how:
        print(f"Ψ of {args.model}: {how}")
    print(render(rows, choice, args.unit, rdt, args.link_gbps))
    if args.link_gbps is not None:
        print(_compression_lines(rows, args.link_gbps))
    print(f"\nPeak per rank ({args.unit}) while building on the meta device, loading "
          f"{args.file_dtype} files (zk.checkpoint.load_pretrained), training and saving "
          f"(save_pretrained); the model built in fp32"
          f"{'' if how or not isinstance(model, int) else ', its units not counted for --params'}:")
    print(render_phases(phases, args.unit))
    if isinstance(choice, Exception):
        print(f"\nnothing fits: {choice}")
    elif choice is not None:
        size = _fmt(args.device_memory, _UNITS[args.unit.lower()])
        print(f"\nchosen for {size} {args.unit} per device: {choice[2]}")
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"rows": [asdict(e) | {"name": e.name,
                                             "model_states_bytes": e.model_states_bytes,
                                             "trainable_numel": e.trainable_numel,
                                             "reduce_dtype": r}
                                for e in rows],
                       "phases": {name: ph.by_phase for name, ph in phases},
                       "chosen": None if choice is None or isinstance(choice, Exception)
                       else list(choice[0])}, f, indent=1)
        os.replace(tmp, args.json)
    return 1 if isinstance(choice, Exception) else 0


if __name__ == "__main__":   # python -m zkernels.plan: the same as python -m zkernels plan
    from .__main__ import main as _cli
    sys.exit(_cli(["plan"] + sys.argv[1:]))
