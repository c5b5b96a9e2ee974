"""The demo's table and plot, from rank 0's results (see :mod:`zkernels.demo.worker`).

[Note: what the demo's losses show]
All rungs see the same batches from the same initial weights in fp32. Stages 1 and 2 run the
same reduction and the same fused AdamW, so their losses are bit-identical at every step. Data
parallel (DDP + ``torch.optim.AdamW``) orders its fp32 AdamW arithmetic differently: its losses
equal the ZeRO rungs' for the first steps, then differ by an ulp here and there, and training
amplifies that round-off (each step's update depends on the last one's parameters) to ~1e-3
after 100 steps of the default run. The table says which of these it measured.
"""
from __future__ import annotations

from typing import Tuple

KINDS = ("params", "grads", "master", "optimizer_states", "buffers")


def _short(rung: dict) -> str:
    return "DP" if rung["name"] == "data parallel" else rung["name"].replace("stage ", "S")


def _kib(num_bytes: float) -> str:
    return f"{num_bytes / 1024:,.1f}"


def _agreement(first: dict, other: dict) -> str:
    """How ``other``'s losses compare with ``first``'s: bit-identical at every step, or the
    steps they are identical for and the largest difference after."""
    diffs = [abs(a - b) for a, b in zip(other["losses"], first["losses"])]
    same = next((i for i, d in enumerate(diffs) if d != 0), len(diffs))
    if same == len(diffs):
        return f"{other['name']} identical at every step"
    return (f"{other['name']} identical for {same} step{'s' * (same != 1)}, then within "
            f"{max(diffs):.3g}")


def render_table(results: dict) -> Tuple[str, dict]:
    """The comparison table (text) and a summary dict: max loss difference across rungs over
    all steps, max parameter difference from the first rung, measured/estimated ratios (see
    [Note: what the demo's losses show])."""
    meta, rungs = results["meta"], results["rungs"]
    cols = ["rung", f"loss@{meta['args']['steps']}", "step ms", "x" + _short(rungs[0]),
            "sent/step KiB", "est KiB", "mem/rank KiB", "est KiB", "meas/est",
            "params", "grads", "master", "optim", "buffers"]
    rows = []
    for r in rungs:
        mem, est = r["memory_bytes"], r["estimate"]
        ratio = mem["total"] / est["total"] if est["total"] else float("nan")
        paired = r.get("step_time_ratio_paired")
        rows.append([r["name"], f"{r['final_loss']:.6f}", f"{1e3 * r['step_time_s']:.1f}",
                     "-" if paired is None else f"{paired:.3f}",
                     _kib(r["comm_bytes"]), _kib(est["comm_bytes"]), _kib(mem["total"]),
                     _kib(est["total"]), f"{ratio:.3f}"] + [_kib(mem.get(k, 0)) for k in KINDS])
    widths = [max(len(x[i]) for x in rows + [cols]) for i in range(len(cols))]

    def line(r):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths)))
    steps = len(rungs[0]["losses"])
    max_loss_diff = max((abs(a - b) for r in rungs[1:] for a, b in
                         zip(r["losses"], rungs[0]["losses"])), default=0.0)
    max_param_diff = max((r["max_param_diff"] for r in rungs), default=0.0)
    summary = dict(max_loss_diff=max_loss_diff, max_param_diff=max_param_diff,
                   step_time_ratio_paired={r["name"]: r.get("step_time_ratio_paired")
                                           for r in rungs},
                   memory_ratio={r["name"]: r["memory_bytes"]["total"] / r["estimate"]["total"]
                                 for r in rungs})
    text = [f"{rungs[0]['num_params']:,} params, {meta['world_size']} ranks on "
            f"{meta['device']}, fp32, {steps} steps per rung; per rank: bytes sent per step "
            f"and bytes held (measured, by kind on the right) beside estimate_memory's "
            f"estimate", line(cols), line(["-" * w for w in widths])]
    text += [line(r) for r in rows]
    text.append(f"max |loss difference| from {rungs[0]['name']} over all {steps} steps: "
                f"{max_loss_diff:.3g}; max |parameter difference| after the last step: "
                f"{max_param_diff:.3g}")
    pairs = [(rungs[0], r) for r in rungs[1:]]
    zero = [r for r in rungs if r["rung"] != "ddp"]
    pairs += [(zero[0], r) for r in zero[1:] if rungs[0]["rung"] == "ddp"]
    if pairs:
        text.append("losses: " + "; ".join(f"{_agreement(a, b)} (vs {a['name']})"
                                           for a, b in pairs) +
                    ". fp32 round-off, amplified by training where the AdamW arithmetic "
                    "differs (see [Note: what the demo's losses show] in "
                    "zkernels/demo/report.py)")
    if "step_time_ratio_paired" in rungs[0]:
        text.append(f"x{_short(rungs[0])}: step time as the median of per-step ratios to "
                    f"{rungs[0]['name']} (the rungs take their steps in turn, so a change in "
                    f"the machine's load lands on all of them)")
    return "\n".join(text), summary


LABELS = dict(params="params", grads="grads", master="fp32 master",
              optimizer_states="AdamW states", buffers="reduce buffers")


def plot(results: dict, path: str) -> None:
    """Three panels: the loss of every rung over the steps (the curves lie on top of each
    other) with, under it, each rung's distance from the first rung's loss; the step time of
    each rung (median and quartiles of the timed steps, ratio to the first rung); and the bytes
    each rank holds by kind, stacked, measured beside ``estimate_memory``'s estimate."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rungs, meta = results["rungs"], results["meta"]
    names = [r["name"] for r in rungs]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig = plt.figure(figsize=(16, 5.2))
    grid = fig.add_gridspec(2, 3, width_ratios=[1.4, 0.8, 1.3], height_ratios=[3, 1.2])
    ax_loss = fig.add_subplot(grid[0, 0])
    ax_diff = fig.add_subplot(grid[1, 0], sharex=ax_loss)
    ax_time = fig.add_subplot(grid[:, 1])
    ax_mem = fig.add_subplot(grid[:, 2])

    styles = [dict(lw=3.0, alpha=0.45), dict(lw=1.6, ls="--"), dict(lw=1.2, ls=":")]
    ref = rungs[0]["losses"]
    steps = list(range(1, len(ref) + 1))
    for i, r in enumerate(rungs):
        ax_loss.plot(steps, r["losses"], label=r["name"], color=colors[i % len(colors)],
                     **styles[i % len(styles)])
        if i:
            diff = [abs(a - b) for a, b in zip(r["losses"], ref)]
            ax_diff.plot(steps, [d if d > 0 else float("nan") for d in diff],
                         color=colors[i % len(colors)], **styles[i % len(styles)])
    ax_loss.set_ylabel("loss (mean over ranks)")
    ax_loss.set_title("loss per step (the curves overlap)")
    ax_loss.legend(loc="upper right")
    ax_loss.tick_params(labelbottom=False)
    ax_diff.set_yscale("log")
    ax_diff.set_ylabel(f"|loss - {names[0]}|", fontsize=8)
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
        ax_time.annotate(f"{med:.1f} ms\n{ratio:.2f}x", (i, med + quartiles[i][1]),
                         xytext=(0, 3), textcoords="offset points", ha="center", va="bottom",
                         fontsize=8)
    ax_time.set_xticks(list(xs))
    ax_time.set_xticklabels(names)
    ax_time.set_ylim(0, 1.25 * max(m + q[1] for m, q in zip(medians, quartiles)))
    ax_time.set_ylabel("ms per step (median, bars: quartiles)")
    ax_time.set_title(f"step time (ratio to {names[0]})")

    width = 0.38
    kinds = [k for k in KINDS if any(r["memory_bytes"].get(k, 0) or r["estimate"].get(k, 0)
                                     for r in rungs)]    # fp32 has no master: no empty key
    for i, r in enumerate(rungs):
        for offset, source, hatch in ((-width / 2, r["memory_bytes"], None),
                                      (width / 2, r["estimate"], "//")):
            bottom = 0.0
            for kind in kinds:
                kib = source.get(kind, 0) / 1024
                ax_mem.bar(i + offset, kib, width, bottom=bottom,
                           color=colors[KINDS.index(kind)],
                           hatch=hatch, edgecolor="white", linewidth=0.5,
                           label=LABELS[kind] if i == 0 and hatch is None else None)
                bottom += kib
    ax_mem.set_xticks(range(len(names)))
    ax_mem.set_xticklabels([f"{n}\nmeasured | est." for n in names])
    ax_mem.set_ylabel("KiB per rank")
    ax_mem.set_title("memory per rank by kind (hatched: estimate_memory)")
    top = max(max(r["memory_bytes"]["total"], r["estimate"]["total"]) for r in rungs) / 1024
    ax_mem.set_ylim(0, 1.3 * top)     # room for the legend
    ax_mem.legend(loc="upper right", fontsize=8, ncol=2)

    fig.suptitle(f"zkernels demo: {rungs[0]['num_params']:,} params, {meta['world_size']} "
                 f"ranks on {meta['device']}, fp32, {len(ref)} steps per rung")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
