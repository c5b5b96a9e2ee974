"""The demo's table and plot, from rank 0's results (see :mod:`zkernels.demo.worker`)."""
from __future__ import annotations

from typing import Tuple

KINDS = ("params", "grads", "master", "optimizer_states", "buffers")


def _short(rung: dict) -> str:
    return "DP" if rung["name"] == "data parallel" else rung["name"].replace("stage ", "S")


def _kb(num_bytes: float) -> str:
    return f"{num_bytes / 1024:,.1f}"


def render_table(results: dict) -> Tuple[str, dict]:
    """The comparison table (text) and a summary dict: max loss difference across rungs over
    all steps, max parameter difference from the first rung, measured/estimated ratios."""
    meta, rungs = results["meta"], results["rungs"]
    cols = ["rung", f"loss@{meta['args']['steps']}", "step ms", "x" + _short(rungs[0]),
            "sent/step KB",
            "est KB", "mem/rank KB", "est KB", "meas/est",
            "params", "grads", "master", "optim", "buffers"]
    rows = []
    for r in rungs:
        mem, est = r["memory_bytes"], r["estimate"]
        ratio = mem["total"] / est["total"] if est["total"] else float("nan")
        paired = r.get("step_time_ratio_paired")
        rows.append([r["name"], f"{r['final_loss']:.6f}", f"{1e3 * r['step_time_s']:.1f}",
                     "-" if paired is None else f"{paired:.3f}", _kb(r["comm_bytes"]), _kb(est["comm_bytes"]), _kb(mem["total"]),
                     _kb(est["total"]), f"{ratio:.3f}"] + [_kb(mem.get(k, 0)) for k in KINDS])
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
                f"{max_param_diff:.3g} (fp32: equal up to round-off)")
    if "step_time_ratio_paired" in rungs[0]:
        text.append(f"x{_short(rungs[0])}: step time as the median of per-step ratios to "
                    f"{rungs[0]['name']} (the rungs take their steps in turn, so a change in "
                    f"the machine's load lands on all of them)")
    return "\n".join(text), summary


def plot(results: dict, path: str) -> None:
    """Bars of bytes held and bytes sent per rank, measured beside estimated, per rung."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rungs = results["rungs"]
    names = [r["name"] for r in rungs]
    xs = range(len(rungs))
    fig, (ax_mem, ax_comm) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, meas, est, title in (
            (ax_mem, [r["memory_bytes"]["total"] for r in rungs],
             [r["estimate"]["total"] for r in rungs], "bytes held per rank"),
            (ax_comm, [r["comm_bytes"] for r in rungs],
             [r["estimate"]["comm_bytes"] for r in rungs], "bytes sent per rank per step")):
        ax.bar([x - 0.2 for x in xs], [m / 1024 for m in meas], 0.4, label="measured")
        ax.bar([x + 0.2 for x in xs], [e / 1024 for e in est], 0.4, label="estimate_memory")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names)
        ax.set_ylabel("KiB")
        ax.set_title(title)
        ax.set_ylim(0, 1.35 * max(meas + est + [1]) / 1024)    # room for the legend
        ax.legend(loc="upper right")
    fig.suptitle(f"zkernels demo: {rungs[0]['num_params']:,} params, "
                 f"{results['meta']['world_size']} ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
