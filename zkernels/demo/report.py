"""The demo's table and plot, from rank 0's results (see :mod:`zkernels.demo.worker`)."""
from __future__ import annotations

from typing import Tuple

KINDS = ("params", "grads", "master", "optimizer_states", "buffers")


def _kib(num_bytes: float) -> str:
    return f"{num_bytes / 1024:,.1f}"


def render_table(results: dict) -> Tuple[str, dict]:
    """The comparison table (text) and a summary dict: max loss difference across rungs over
    all steps, max parameter difference from the first rung, measured/estimated ratios."""
    meta, rungs = results["meta"], results["rungs"]
    cols = ["rung", f"loss@{meta['args']['steps']}", "step ms", "sent/step KiB",
            "est KiB", "mem/rank KiB", "est KiB", "meas/est",
            "params", "grads", "master", "optim", "buffers"]
    rows = []
    for r in rungs:
        mem, est = r["memory_bytes"], r["estimate"]
        ratio = mem["total"] / est["total"] if est["total"] else float("nan")
        rows.append([r["name"], f"{r['final_loss']:.6f}", f"{1e3 * r['step_time_s']:.1f}",
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
                   memory_ratio={r["name"]: r["memory_bytes"]["total"] / r["estimate"]["total"]
                                 for r in rungs})
    text = [f"{rungs[0]['num_params']:,} params, {meta['world_size']} ranks on "
            f"{meta['device']}, fp32, {steps} steps per rung; per rank: bytes sent per step "
            f"and bytes held (measured, by kind on the right) beside estimate_memory's "
            f"estimate", line(cols), line(["-" * w for w in widths])]
    text += [line(r) for r in rows]
    text.append(f"max |loss difference| from {rungs[0]['name']} over all {steps} steps: "
                f"{max_loss_diff:.3g}; max |parameter difference| after the last step: "
                f"{max_param_diff:.3g} (fp32: equal up to round-off)")
    return "\n".join(text), summary


LABELS = dict(params="params", grads="grads", master="fp32 master",
              optimizer_states="AdamW states", buffers="reduce buffers")


def plot(results: dict, path: str) -> None:
    """Three panels: the loss of every rung over the steps (the curves lie on top of each
    other), the step time of each rung (median, with the spread of the steps), and the bytes
    each rank holds by kind, stacked, measured beside ``estimate_memory``'s estimate."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rungs, meta = results["rungs"], results["meta"]
    names = [r["name"] for r in rungs]
    fig, (ax_loss, ax_time, ax_mem) = plt.subplots(
        1, 3, figsize=(16, 4.8), gridspec_kw=dict(width_ratios=[1.4, 0.8, 1.3]))

    styles = [dict(lw=3.0, alpha=0.45), dict(lw=1.6, ls="--"), dict(lw=1.2, ls=":")]
    for i, r in enumerate(rungs):
        steps = range(1, len(r["losses"]) + 1)
        ax_loss.plot(steps, r["losses"], label=r["name"], **styles[i % len(styles)])
    ref = rungs[0]["losses"]
    worst = max((abs(a - b) for r in rungs[1:] for a, b in zip(r["losses"], ref)),
                default=0.0)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss (mean over ranks)")
    ax_loss.set_title(f"loss per step: max |difference| {worst:.2g}")
    ax_loss.legend(loc="upper right")

    times = [[1e3 * t for t in r.get("step_times_s", [r["step_time_s"]])] for r in rungs]
    ax_time.boxplot(times, showfliers=False, widths=0.5)
    ax_time.set_xticks(range(1, len(names) + 1))
    ax_time.set_xticklabels(names)
    for i, r in enumerate(rungs, start=1):
        ratio = r["step_time_s"] / rungs[0]["step_time_s"]
        ax_time.annotate(f"{1e3 * r['step_time_s']:.1f} ms\n{ratio:.2f}x", (i, 0),
                         xycoords=("data", "axes fraction"), xytext=(0, 4),
                         textcoords="offset points", ha="center", va="bottom", fontsize=8)
    ax_time.set_ylim(bottom=0)
    ax_time.set_ylabel("ms per step (median; box: quartiles)")
    ax_time.set_title(f"step time ({rungs[0]['name']} = 1.00x)")

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    width = 0.38
    for i, r in enumerate(rungs):
        for offset, source, hatch in ((-width / 2, r["memory_bytes"], None),
                                      (width / 2, r["estimate"], "//")):
            bottom = 0.0
            for j, kind in enumerate(KINDS):
                kib = source.get(kind, 0) / 1024
                ax_mem.bar(i + offset, kib, width, bottom=bottom, color=colors[j],
                           hatch=hatch, edgecolor="white", linewidth=0.5,
                           label=LABELS[kind] if i == 0 and hatch is None else None)
                bottom += kib
    ax_mem.set_xticks(range(len(names)))
    ax_mem.set_xticklabels([f"{n}\nmeasured | est." for n in names])
    ax_mem.set_ylabel("KiB per rank")
    ax_mem.set_title("memory per rank by kind: measured | estimate_memory (hatched)")
    top = max(max(r["memory_bytes"]["total"], r["estimate"]["total"]) for r in rungs) / 1024
    ax_mem.set_ylim(0, 1.3 * top)     # room for the legend
    ax_mem.legend(loc="upper right", fontsize=8, ncol=2)

    fig.suptitle(f"zkernels demo: {rungs[0]['num_params']:,} params, {meta['world_size']} "
                 f"ranks on {meta['device']}, fp32, {len(ref)} steps per rung")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
