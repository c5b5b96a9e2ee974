"""The demo's tables and plot, from rank 0's results (see :mod:`zkernels.demo.worker`).

[Note: what the demo's losses show]
All rungs see the same batches from the same initial weights in fp32. The ZeRO rungs (stages
1, 2 and 3, with or without offload) run the same reduction and the same fused AdamW on the same
shards, so their losses are bit-identical at every step. Data parallel (DDP +
``torch.optim.AdamW``) orders its fp32 AdamW arithmetic differently: its losses equal the ZeRO
rungs' for the first steps (11 in the default run), then differ by an ulp here and there, and
training amplifies that round-off (each step's update depends on the last one's parameters):
1.6e-5 at most over the default 60 steps, 3.5e-3 over 100. The table says which of these it
measured.
"""
from __future__ import annotations

import textwrap
from typing import Dict, List, Optional, Tuple

KINDS = ("params", "grads", "master", "optimizer_states", "buffers")
PLACES = ("device", "host", "disk")
_KIND_HEADS = dict(params="params", grads="grads", master="master", optimizer_states="optim",
                   buffers="buffers")


def _dtype(meta: dict) -> str:
    """'fp32', or 'bf16 (data parallel fp32)' for a demo run with --param-dtype bf16, and the
    moments' dtype of a run with --state-dtype bf16 / int8."""
    dt = meta.get("args", {}).get("param_dtype", "fp32")
    sd = meta.get("args", {}).get("state_dtype", "fp32")
    state = "" if sd == "fp32" else f", ZeRO rungs' AdamW moments {sd}"
    return (dt if dt == "fp32" else f"ZeRO rungs {dt} (data parallel fp32)") + state


def _short(rung: dict) -> str:
    if "short" in rung:
        return rung["short"]
    return "DP" if rung["name"] == "data parallel" else rung["name"].replace("stage ", "S")


def _unit(rungs: List[dict]) -> Tuple[str, int]:
    """MiB when the largest amount held is a MiB or more, else KiB."""
    top = max((r["memory_bytes"].get("total", 0) for r in rungs), default=0)
    return ("MiB", 2**20) if top >= 2**20 else ("KiB", 2**10)


def _size(num_bytes: float, unit: int) -> str:
    return f"{num_bytes / unit:,.2f}" if unit > 1024 else f"{num_bytes / unit:,.1f}"


def _agreement(first: dict, other: dict) -> str:
    """How ``other``'s losses compare with ``first``'s: bit-identical at every step, or the
    steps they are identical for and the largest difference after."""
    diffs = [abs(a - b) for a, b in zip(other["losses"], first["losses"])]
    same = next((i for i, d in enumerate(diffs) if d != 0), len(diffs))
    if same == len(diffs):
        return f"{other['name']} identical at every step"
    return (f"{other['name']} identical for {same} step{'s' * (same != 1)}, then within "
            f"{max(diffs):.3g}")


def _loss_sentence(rungs: List[dict]) -> Optional[str]:
    """One sentence on the losses: the first ZeRO rung against data parallel, then every other
    rung against that ZeRO rung (those bit-identical to it named together)."""
    if len(rungs) < 2:
        return None
    zero = [r for r in rungs if r.get("rung") != "ddp"]
    base = zero[0] if zero and rungs[0].get("rung") == "ddp" else rungs[0]
    parts = []
    if base is not rungs[0]:
        parts.append(f"{_agreement(rungs[0], base)} (vs {rungs[0]['name']})")
    others = [r for r in rungs if r is not base and r is not rungs[0]] if base is not rungs[0] \
        else rungs[1:]
    same = [r["name"] for r in others if list(r["losses"]) == list(base["losses"])]
    if same:
        parts.append(f"{', '.join(same)} identical to {base['name']} at every step")
    parts += [f"{_agreement(base, r)} (vs {base['name']})" for r in others
              if list(r["losses"]) != list(base["losses"])]
    if all(list(r["losses"]) == list(rungs[0]["losses"]) for r in rungs):
        return "losses: " + "; ".join(parts)
    quantized = [r["name"] for r in rungs if r.get("quantize_weights") or r.get("quantize_grads")]
    why = (f"; {', '.join(quantized)}: the quantized collectives' error, amplified the same way "
           f"(final losses compared in benchmarks/README.md)") if quantized else ""
    return ("losses: " + "; ".join(parts) + ". fp32 round-off, amplified by training where the "
            "AdamW arithmetic differs (see [Note: what the demo's losses show] in "
            "zkernels/demo/report.py)" + why)


def _has_eval(rungs: List[dict]) -> bool:
    """Whether the run scored its rungs on eval batches (``--eval-batches N``, N > 0)."""
    return bool(rungs) and all(r.get("eval_loss") is not None for r in rungs)


def _eval_sentence(rungs: List[dict], meta: dict) -> str:
    """What the eval loss is, and each rung's against the first rung's, in percent."""
    args = meta.get("args", {})
    n = rungs[0].get("eval_batches") or args.get("eval_batches")
    rows = meta["world_size"] * args.get("batch_size", 0)
    text = (f"eval loss: the mean loss over {n} fixed batches of {rows} sequences of "
            f"{args.get('block_size')} tokens, drawn apart from the training batches (the same "
            f"for every rung), with the parameters after the last step")
    if len(rungs) < 2:
        return text
    base = rungs[0]["eval_loss"]
    return text + f"; vs {rungs[0]['name']}: " + ", ".join(
        f"{100 * (r['eval_loss'] / base - 1):+.2f}% ({r['name']})" for r in rungs[1:])


def held(rung: dict, place: str, estimate: bool = False) -> Dict[str, int]:
    """Bytes by kind (and ``"total"``) that ``rung`` holds per rank in ``place`` ("device",
    "host", "disk"): measured (``stats()["memory_bytes_by_location"]``) or, with
    ``estimate``, estimated (between steps; see ``worker._estimate``)."""
    by = rung["estimate"]["by_location"] if estimate else rung["memory_bytes_by_location"]
    kinds = by.get(place) or {}
    out = {k: int(kinds.get(k, 0)) for k in KINDS}
    out["total"] = sum(out.values())
    return out


def _plan_line(plan: Optional[dict], names: List[str]) -> Optional[str]:
    if not plan:
        return None
    size = f"--device-memory {_bytes_text(plan['device_memory'])} " \
           f"({plan['headroom']:.0%} headroom)"
    if plan.get("rung") is None:
        return f"{size}: {plan['reason']}"
    where = "*: " if plan["name"] in names else \
        f"(not among the rungs trained: add {plan['rung']} to --rungs) "
    usable = plan["device_memory"] * (1 - plan["headroom"])
    return (f"{where}plan's choice for {size}, fp32: {plan['name']}, the lowest rung whose "
            f"estimated peak fits ({_bytes_text(plan['device_bytes'])} of "
            f"{_bytes_text(usable)} usable)")


def _bytes_text(num_bytes: int) -> str:
    for name, unit in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= unit:
            return f"{num_bytes / unit:.3g} {name}"
    return f"{num_bytes} B"


def _columns(header: List[str], body: List[List[str]], left: int) -> List[str]:
    """Aligned lines: the first ``left`` columns flush left, the rest flush right."""
    widths = [max(len(x[i]) for x in body + [header]) for i in range(len(header))]

    def line(row):
        return "  ".join(c.ljust(w) if i < left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(row, widths))).rstrip()
    return [line(header), line(["-" * w for w in widths])] + [line(x) for x in body]


def _build_cells(rung: dict, unit: int) -> List[str]:
    """The peak while building, measured and estimated ('-' for results without them)."""
    meas, est = rung.get("build_peak_bytes"), rung["estimate"].get("build_peak")
    return ["-" if v is None else _size(v, unit) for v in (meas, est)]


def render_table(results: dict) -> Tuple[str, dict]:
    """The comparison tables (text) and a summary dict: max loss difference across rungs over
    all steps, max parameter difference from the first rung, measured/estimated ratios (see
    [Note: what the demo's losses show]).

    The first table has one row per rung: loss, step time, bytes sent per step and bytes held
    per rank on the device, in host RAM and on disk, each beside its estimate ('*' marks the
    rung ``plan`` chooses for ``results["plan"]``'s ``--device-memory``). The second has one
    row per rung and place that holds anything: the bytes held there by kind, measured, and
    the total beside its estimate."""
    meta, rungs = results["meta"], results["rungs"]
    plan = results.get("plan")
    unit_name, unit = _unit(rungs)
    chosen = plan.get("name") if plan else None
    mark = any(r["name"] == chosen for r in rungs)
    evals = _has_eval(rungs)
    builds = any(r.get("build_peak_bytes") is not None for r in rungs)
    cols = ["rung", f"loss@{meta['args']['steps']}"] + (["eval loss"] if evals else []) + \
        ["step ms", "x" + _short(rungs[0]), "sent/step", "est"] + \
        (["build", "est"] if builds else []) + [c for p in PLACES for c in (p, "est")]
    rows = []
    for r in rungs:
        paired = r.get("step_time_ratio_paired")
        name = (("* " if r["name"] == chosen else "  ") if mark else "") + r["name"]
        cells = [name, f"{r['final_loss']:.6f}"] + \
            ([f"{r['eval_loss']:.6f}"] if evals else []) + \
            [f"{1e3 * r['step_time_s']:.1f}", "-" if paired is None else f"{paired:.3f}",
             _size(r["comm_bytes"], unit), _size(r["estimate"]["comm_bytes"], unit)] + \
            (_build_cells(r, unit) if builds else [])
        for place in PLACES:
            cells += [_size(held(r, place)["total"], unit),
                      _size(held(r, place, estimate=True)["total"], unit)]
        rows.append(cells)
    kind_cols = ["rung", "held in"] + [_KIND_HEADS[k] for k in KINDS] + ["total", "est",
                                                                         "meas/est"]
    kind_rows = []
    for r in rungs:
        first = True
        for place in PLACES:
            meas, est = held(r, place), held(r, place, estimate=True)
            if not meas["total"] and not est["total"]:
                continue
            ratio = f"{meas['total'] / est['total']:.3f}" if est["total"] else "-"
            kind_rows.append([r["name"] if first else "", place] +
                             [_size(meas[k], unit) for k in KINDS] +
                             [_size(meas["total"], unit), _size(est["total"], unit), ratio])
            first = False

    steps = len(rungs[0]["losses"])
    max_loss_diff = max((abs(a - b) for r in rungs[1:] for a, b in
                         zip(r["losses"], rungs[0]["losses"])), default=0.0)
    max_param_diff = max((r["max_param_diff"] for r in rungs), default=0.0)
    summary = dict(max_loss_diff=max_loss_diff, max_param_diff=max_param_diff,
                   step_time_ratio_paired={r["name"]: r.get("step_time_ratio_paired")
                                           for r in rungs},
                   # measured / estimated bytes held on the device, and in every place
                   memory_ratio={r["name"]: held(r, "device")["total"] /
                                 held(r, "device", estimate=True)["total"] for r in rungs
                                 if held(r, "device", estimate=True)["total"]},
                   memory_ratio_by_place={place: {r["name"]: held(r, place)["total"] /
                                                  held(r, place, estimate=True)["total"]
                                                  for r in rungs
                                                  if held(r, place, estimate=True)["total"]}
                                          for place in PLACES},
                   build_peak_ratio={r["name"]: r["build_peak_bytes"] /
                                     r["estimate"]["build_peak"] for r in rungs
                                     if r.get("build_peak_bytes") is not None and
                                     r["estimate"].get("build_peak")},
                   eval_loss_vs_first={r["name"]: r["eval_loss"] / rungs[0]["eval_loss"] - 1
                                       for r in rungs[1:]} if evals else None,
                   plan=plan)
    table = _columns(cols, rows, 1)
    width = max(100, max(len(line) for line in table))   # prose wrapped to the table

    def wrap(note):
        return textwrap.fill(note, width, subsequent_indent="  ", break_on_hyphens=False)
    text = [wrap(f"{rungs[0]['num_params']:,} params, {meta['world_size']} ranks on "
                 f"{meta['device']}, {_dtype(meta)}, {steps} steps per rung. {unit_name} per "
                 f"rank sent per step and held between steps, measured beside estimate_memory's (est)"
                 + ("; build: tensor bytes at the peak while building the rung (ZeRO: on the "
                    "meta device, then load_pretrained), beside estimate_phases' (est)"
                    if builds else ""))]
    text += table
    notes = []
    plan_line = _plan_line(plan, [r["name"] for r in rungs])
    if plan_line:
        notes.append(plan_line)
    notes.append(f"max |loss difference| from {rungs[0]['name']} over all {steps} steps: "
                 f"{max_loss_diff:.3g}; max |parameter difference| after the last step: "
                 f"{max_param_diff:.3g}")
    losses = _loss_sentence(rungs)
    if losses:
        notes.append(losses)
    if evals:
        notes.append(_eval_sentence(rungs, meta))
    if "step_time_ratio_paired" in rungs[0]:
        notes.append(f"x{_short(rungs[0])}: step time as the median of per-step ratios to "
                     f"{rungs[0]['name']} (the rungs take their steps in turn, so a change in "
                     f"the machine's load lands on all of them)")
    text += [wrap(n) for n in notes]
    text += ["", wrap(f"{unit_name} held per rank by kind and place (stats()), the total "
                      f"beside estimate_memory's (host buffers: staging, NVMe's slots, "
                      f"parameter bounces)")]
    text += _columns(kind_cols, kind_rows, 2)
    return "\n".join(text), summary


LABELS = dict(params="params", grads="grads", master="fp32 master",
              optimizer_states="AdamW states", buffers="buffers (reduce, staging)")
_PLACE_LABELS = dict(device="dev", host="host", disk="disk")


def _wrap(name: str) -> str:
    """'stage 3 + cpu offload + params on host' -> one part per line."""
    return name.replace(" + ", " +\n")


def plot(results: dict, path: str) -> None:
    """Draw :func:`figure` to ``path`` (a PNG)."""
    import matplotlib.pyplot as plt
    fig = figure(results)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def figure(results: dict):
    """The demo's figure: the loss of every rung over the steps (the curves lie on top of each
    other) with, under it, each rung's distance from the first rung's loss (a marker at every
    step where they differ, so that a lone step among identical ones shows on the log axis,
    where the line between points is broken by the identical steps); the step time of
    each rung (median and quartiles of the timed steps, ratio to the first rung); and, below,
    the ZeRO paper's memory figure from measured bytes: per rung, the bytes each rank holds on
    the device (and, offloaded, in host RAM and on disk), stacked by kind, each measured bar
    beside ``estimate_memory``'s (hatched). With ``--device-memory``, a line marks what
    ``plan`` leaves usable on the device and the chosen rung's name is starred."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rungs, meta = results["rungs"], results["meta"]
    plan = results.get("plan")
    names = [r["name"] for r in rungs]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig = plt.figure(figsize=(16, 10.5), layout="constrained")
    grid = fig.add_gridspec(3, 2, width_ratios=[1.5, 1], height_ratios=[3, 1.2, 5.2])
    ax_loss = fig.add_subplot(grid[0, 0])
    ax_diff = fig.add_subplot(grid[1, 0], sharex=ax_loss)
    ax_time = fig.add_subplot(grid[:2, 1])
    ax_mem = fig.add_subplot(grid[2, :])

    styles = [dict(lw=3.0, alpha=0.45), dict(lw=1.6, ls="--"), dict(lw=1.2, ls=":")]
    ref = rungs[0]["losses"]
    steps = list(range(1, len(ref) + 1))
    for i, r in enumerate(rungs):
        ax_loss.plot(steps, r["losses"], label=r["name"], color=colors[i % len(colors)],
                     **styles[i % len(styles)])
        if i:
            diff = [abs(a - b) for a, b in zip(r["losses"], ref)]
            # NaN at identical steps (no point on a log axis): a line alone would draw only
            # runs of differing steps, never a step whose neighbours are identical.
            ax_diff.plot(steps, [d if d > 0 else float("nan") for d in diff],
                         color=colors[i % len(colors)], marker="o", ms=3,
                         **dict(styles[i % len(styles)], alpha=1.0))
    if _has_eval(rungs):   # each rung's eval loss after the last step, at the last step
        for i, r in enumerate(rungs):
            ax_loss.plot([len(ref)], [r["eval_loss"]], marker="o", ms=6, ls="none",
                         color=colors[i % len(colors)],
                         label="eval loss after the last step" if i == 0 else None)
    ax_loss.set_ylabel("loss (mean over ranks)")
    ax_loss.set_title("loss per step (the curves overlap)")
    ax_loss.legend(loc="upper right", fontsize=8)
    ax_loss.tick_params(labelbottom=False)
    if any(d > 0 for r in rungs[1:] for d in (abs(a - b) for a, b in zip(r["losses"], ref))):
        ax_diff.set_yscale("log")
    ax_diff.set_ylabel(f"|loss - {_short(rungs[0])}|", fontsize=8)
    ax_diff.set_xlabel("step (no point: identical losses)")

    medians = [1e3 * r["step_time_s"] for r in rungs]
    quartiles = []
    for r, med in zip(rungs, medians):
        ts = sorted(1e3 * t for t in r.get("step_times_s") or [r["step_time_s"]])
        q1, q3 = ts[len(ts) // 4], ts[(3 * len(ts)) // 4]
        quartiles.append((med - min(q1, med), max(q3, med) - med))
    xs = range(len(rungs))
    ax_time.bar(xs, medians, 0.6, color=[colors[i % len(colors)] for i in xs], alpha=0.8,
                yerr=list(zip(*quartiles)), capsize=4)
    for i, med in enumerate(medians):
        # the paired ratio where the rungs took their steps in turn (see worker.py)
        ratio = rungs[i].get("step_time_ratio_paired") or med / medians[0]
        ax_time.annotate(f"{med:.0f} ms\n{ratio:.2f}x", (i, med + quartiles[i][1]),
                         xytext=(0, 3), textcoords="offset points", ha="center", va="bottom",
                         fontsize=8)
    ax_time.set_xticks(list(xs))
    ax_time.set_xticklabels([_short(r) for r in rungs], rotation=30, ha="right",
                            rotation_mode="anchor", fontsize=8)
    ax_time.set_ylim(0, 1.25 * max(m + q[1] for m, q in zip(medians, quartiles)))
    ax_time.set_ylabel("ms per step (median, bars: quartiles)")
    ax_time.set_title(f"step time (paired ratio to {names[0]})")

    width, gap = 0.36, 0.5
    kinds = [k for k in KINDS if any(held(r, p, e)[k] for r in rungs for p in PLACES
                                     for e in (False, True))]     # no empty legend entry
    x, major, minor, minor_labels = 0.0, [], [], []
    seen_transient = False
    for r in rungs:
        places = [p for p in PLACES if p == "device" or held(r, p)["total"] or
                  held(r, p, estimate=True)["total"]]
        start = x
        for place in places:
            for offset, est, hatch in ((0.0, False, None), (width, True, "//")):
                bottom = 0.0
                source = held(r, place, estimate=est)
                for kind in kinds:
                    mib = source[kind] / 2**20
                    ax_mem.bar(x + offset, mib, width, bottom=bottom, align="edge",
                               color=colors[KINDS.index(kind)], hatch=hatch,
                               alpha=1.0 if place == "device" else 0.55,
                               edgecolor="white", linewidth=0.5,
                               label=LABELS[kind] if r is rungs[0] and not est and
                               place == "device" else None)
                    bottom += mib
            transient = r["estimate"].get("transient", 0) / 2**20
            if place == "device" and transient:
                # what lives only inside a step (stage 1's reduced shards, stage 3's gathered
                # blocks): plan's choice fits the peak, not just what is held between steps
                ax_mem.bar(x + width, transient, width, bottom=bottom, align="edge", fill=False,
                           hatch="..", edgecolor="grey", linewidth=0.5,
                           label="inside a step only (est.)" if not seen_transient else None)
                seen_transient = True
            minor.append(x + width)
            minor_labels.append(_PLACE_LABELS[place])
            x += 2 * width + 0.08
        major.append((start + x - 0.08) / 2)
        x += gap
    chosen = plan.get("name") if plan else None
    ax_mem.set_xticks(major)
    ax_mem.set_xticklabels([("* " if n == chosen else "") + _wrap(n) for n in names],
                           fontsize=9)
    ax_mem.xaxis.remove_overlapping_locs = False   # a minor tick may sit on a major one
    ax_mem.set_xticks(minor, minor=True)
    ax_mem.set_xticklabels(minor_labels, minor=True, fontsize=7)
    ax_mem.tick_params(axis="x", which="major", pad=14, length=0)
    ax_mem.set_xlim(-gap / 2, x - gap / 2)
    ax_mem.set_ylabel("MiB per rank")
    ax_mem.set_title("bytes held per rank by kind, measured by stats() | hatched: "
                     "estimate_memory; dev: on the device, host: host RAM (paler), disk: NVMe "
                     "files")
    top = max(max(held(r, p, e)["total"] for p in PLACES for e in (False, True))
              + r["estimate"].get("transient", 0) for r in rungs) / 2**20
    if plan and plan.get("device_memory"):
        usable = plan["device_memory"] * (1 - plan["headroom"]) / 2**20
        if usable < 2 * top:
            ax_mem.axhline(usable, color="black", ls="--", lw=1)
            ax_mem.annotate(f"device memory usable for --device-memory "
                            f"{_bytes_text(plan['device_memory'])} (* plan's choice)",
                            (x - gap / 2, usable), xytext=(-4, 3), textcoords="offset points",
                            ha="right", va="bottom", fontsize=8)
            top = max(top, usable)
    ax_mem.set_ylim(0, 1.3 * top)     # room for the legend
    ax_mem.legend(loc="upper right", fontsize=8, ncol=len(kinds) + seen_transient)

    fig.suptitle(f"zkernels demo: {rungs[0]['num_params']:,} params, {meta['world_size']} "
                 f"ranks on {meta['device']}, {_dtype(meta)}, {len(ref)} steps per rung")
    return fig
