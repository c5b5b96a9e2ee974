"""Turn the ranks' raw step records into JSON rows and the terminal table.

Per row: step time = max over ranks of each timed step (each includes the closing barrier,
so the ranks agree to a few µs), then median and min/max over steps; bytes sent per rank per
step by kind (median over timed steps, then the mean over ranks; every rank's own figure is
kept); memory per rank by kind (the rank holding the most, every rank's figure kept); final
loss = mean over ranks of the last step's loss. Ratios are to DDP in the same run: of the medians (the issue's bar), and the median of
per-step ratios (paired, steadier on a loaded machine).
"""
from __future__ import annotations

import statistics
from typing import Dict, List, Optional

from _comm_meter import KINDS, SCOPES
from _zero_step_trees import BEFORE

TIME_BAR = 1.05          # the bar: step time at most 1.05x DDP's (paired ratio)
TRAFFIC_TOLERANCE = 1e-3  # "equal to DDP" up to rank-alignment padding (0.1%)
LOSS_TOLERANCE = 1e-4     # fp32 round-off after a few dozen AdamW steps, far below any bug
MEMORY_KINDS = ("params", "grads", "master", "optimizer_states", "buffers", "total")
ZK_COMM_KINDS = ("reduce_scatter", "all_gather", "all_reduce", "total")


def _over_ranks(steps_by_rank: List[List[dict]], keys) -> tuple:
    """Per key, each rank's median over its timed steps (``by_rank``), and their mean."""
    by_rank = [{k: int(statistics.median(d.get(k, 0) for d in steps)) for k in keys}
               for steps in steps_by_rank]
    return {k: statistics.fmean(d[k] for d in by_rank) for k in keys}, by_rank


def summarize(name: str, per_rank: List[dict], world_size: int) -> dict:
    """One JSON row from every rank's record of method ``name``."""
    errors = [r["error"] for r in per_rank if "error" in r]
    if errors:
        return {"method": name, "error": errors[0]}
    times = [max(r["times_s"][i] for r in per_rank) for i in range(len(per_rank[0]["times_s"]))]
    row: dict = {
        "method": name,
        "step_time_s": {"median": statistics.median(times), "min": min(times),
                        "max": max(times), "num_steps": len(times)},
        "step_times_s": times,
        "final_loss": statistics.fmean(r["losses"][-1] for r in per_rank),
        "notes": [],
    }
    comm_keys = KINDS + ("total",)
    row["comm_bytes_per_rank"], row["comm_bytes_by_rank"] = _over_ranks(
        [[s["bytes"] for s in r["meter"]] for r in per_rank], comm_keys)
    row["comm_calls_per_step_rank0"] = per_rank[0]["meter"][-1]["calls"]
    if any(s.get("scopes", {}).get("across_groups") for r in per_rank for s in r["meter"]) \
            or "hybrid" in name or "hsdp" in name:
        # --shard-size: the bytes within the shard group and across groups (_comm_meter.py)
        row["comm_scopes_per_rank"] = _over_ranks(
            [[s["scopes"] for s in r["meter"]] for r in per_rank], SCOPES)[0]
    if any(len({s["bytes"]["total"] for s in r["meter"]}) > 1 for r in per_rank):
        row["notes"].append("traffic varied between timed steps (median reported)")
    if row["comm_bytes_per_rank"]["total"] == 0 and world_size > 1:
        row["comm_intercepted"] = False
        row["notes"].append("no collective seen by the Python meter: traffic NOT measured")
    else:
        row["comm_intercepted"] = True
    mems = [r["memory"] for r in per_rank]
    row["memory_bytes_by_rank"] = mems
    row["memory_bytes_per_rank"] = {k: max(m.get(k, 0) for m in mems) for k in MEMORY_KINDS}
    if all("device" in m for m in mems):  # offload rows: where the bytes are
        row["memory_location_bytes_per_rank"] = {
            k: max(m[k] for m in mems) for k in ("device", "host", "disk")}
    hook = [statistics.median(r["hook_bucket_bytes"]) for r in per_rank]
    if any(hook):
        # DDP's buckets as its comm hook saw them, in the meter's convention: a cross-check
        # that the meter caught every bucket all-reduce.
        expect = statistics.fmean(hook) * 2 * (world_size - 1) / world_size
        row["ddp_hook_all_reduce_bytes_per_rank"] = expect
        if abs(expect - row["comm_bytes_per_rank"]["all_reduce"]) > 0.5:
            row["notes"].append("DDP hook bucket bytes disagree with the meter's all-reduce")
    zk = [r["zk_stats"] for r in per_rank]
    if zk[0][0] is not None:
        row["zk_stats_comm_bytes_per_rank"] = _over_ranks(
            [[s["comm_bytes"] for s in steps] for steps in zk], ZK_COMM_KINDS)[0]
        row["zk_stats_last"] = zk[0][-1]
        meter_total = row["comm_bytes_per_rank"]["total"]
        if abs(row["zk_stats_comm_bytes_per_rank"]["total"] - meter_total) > 0.5:
            row["notes"].append("zkernels stats() traffic differs from the meter's")
    return row


def add_ratios(rows: List[dict], loss_tolerance: float = LOSS_TOLERANCE,
               lossy=lambda method: False) -> None:
    """Step-time and traffic ratios to the DDP row, and the issue's pass/fail flags
    (``loss_tolerance``: how far a final loss may be from DDP's; bf16 rows need more;
    ``lossy(method)``: True for rows whose loss may differ by design, the quantized ones)."""
    ddp = next((r for r in rows if r["method"] == "ddp" and "error" not in r), None)
    for r in rows:
        if "error" in r or ddp is None:
            continue
        r["step_time_ratio_to_ddp"] = r["step_time_s"]["median"] / ddp["step_time_s"]["median"]
        # Step i of every method ran back to back (round-robin), so the median of per-step
        # ratios cancels most of the background-load drift of a shared machine.
        r["step_time_ratio_to_ddp_paired"] = statistics.median(
            t / d for t, d in zip(r["step_times_s"], ddp["step_times_s"]))
        ddp_bytes = ddp["comm_bytes_per_rank"]["total"]
        r["traffic_ratio_to_ddp"] = (r["comm_bytes_per_rank"]["total"] / ddp_bytes
                                     if ddp_bytes else None)
        r["within_5pct_of_ddp"] = r["step_time_ratio_to_ddp_paired"] <= TIME_BAR
        # Same data, same initial weights, fp32 AdamW: every method should land on DDP's loss.
        r["final_loss_diff_to_ddp"] = r["final_loss"] - ddp["final_loss"]
        if abs(r["final_loss_diff_to_ddp"]) > loss_tolerance and not lossy(r["method"]):
            r["notes"].append(f"final loss differs from DDP's by {r['final_loss_diff_to_ddp']:.2e}"
                              f" (> {loss_tolerance:g}): not training the same model")
        tr = r["traffic_ratio_to_ddp"]
        r["traffic_equal_to_ddp"] = tr is not None and abs(tr - 1.0) <= TRAFFIC_TOLERANCE


def check_memory(rows: List[dict], num_params: int, world_size: int, dtype: str) -> None:
    """Stage 2's memory bar: at most stage 1's, and within 5% of its formula (4Ψ + 12Ψ/N in
    fp32; 2Ψ + 16Ψ/N with bf16 params: fp32 master and gradient shard) plus two buckets (its
    reduce buffers, two of its largest buckets). Adds ``memory_formula_bytes``,
    ``memory_within_formula``, ``memory_at_most_stage1`` and ``memory_verdict`` to the
    zk_stage2 row."""
    by = {r["method"]: r for r in rows if "error" not in r}
    s2 = by.get("zk_stage2")
    if s2 is None:
        return
    psi, n = num_params, world_size
    formula = 4 * psi + 12 * psi / n if dtype == "float32" else 2 * psi + 16 * psi / n
    mem = s2["memory_bytes_per_rank"]
    buckets = mem.get("buffers", 0)
    ok = mem["total"] <= 1.05 * formula + buckets
    s2["memory_formula_bytes"] = formula
    s2["memory_within_formula"] = ok
    text = (f"memory {mem['total'] / 2**20:.2f} MiB vs formula {formula / 2**20:.2f} MiB + "
            f"two buckets {buckets / 2**20:.2f} MiB: {'within 5%' if ok else 'NOT within 5%'}")
    s1 = by.get("zk_stage1")
    if s1 is not None:
        le = mem["total"] <= s1["memory_bytes_per_rank"]["total"]
        s2["memory_at_most_stage1"] = le
        text += (f", <= stage 1's {s1['memory_bytes_per_rank']['total'] / 2**20:.2f} MiB: "
                 f"{'yes' if le else 'NO'}")
    s2["memory_verdict"] = text


def repeat_summary(runs: List[List[dict]]) -> Dict[str, dict]:
    """Per method, the paired ratio to DDP of every run and their median (the issue's
    figure)."""
    out: Dict[str, dict] = {}
    for rows in runs:
        for r in rows:
            if "step_time_ratio_to_ddp_paired" in r:
                out.setdefault(r["method"], {"paired_ratios": []})["paired_ratios"].append(
                    r["step_time_ratio_to_ddp_paired"])
    for v in out.values():
        v["paired_ratio_median"] = statistics.median(v["paired_ratios"])
        v["within_5pct_of_ddp"] = v["paired_ratio_median"] <= TIME_BAR
    return out


def _mb(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _yn(flag) -> str:
    return "-" if flag is None else ("yes" if flag else "no")


def format_table(rows: List[dict]) -> str:
    """Fixed-width table: times in ms, bytes in MiB per rank per step, memory in MiB."""
    head = (f"{'method':<17} {'step ms':>8} {'[min-max]':>15} {'xDDP':>6} {'<=1.05':>6} "
            f"{'sent MiB':>8} {'AR':>6} {'RS':>6} {'AG':>6} {'BC':>6} {'A2A':>6} {'xDDP':>7} {'=DDP':>5} "
            f"{'mem MiB':>7} {'param':>6} {'grad':>6} {'mast':>6} {'optim':>6} {'buf':>6} "
            f"{'loss':>7}")
    lines = [head, "-" * len(head)]
    notes = []
    for r in rows:
        if "error" in r:
            lines.append(f"{r['method']:<17} FAILED: {r['error'].splitlines()[0]}")
            continue
        t, c, m = r["step_time_s"], r["comm_bytes_per_rank"], r["memory_bytes_per_rank"]
        tr = r.get("traffic_ratio_to_ddp")
        sent = _mb(c["total"]) if r["comm_intercepted"] else "n/a"
        spread = f"[{t['min'] * 1e3:.1f}-{t['max'] * 1e3:.1f}]"
        traffic = "-" if tr is None else f"{tr:.4f}"
        lines.append(
            f"{r['method']:<17} {t['median'] * 1e3:8.1f} {spread:>15} "
            f"{r.get('step_time_ratio_to_ddp', float('nan')):6.3f} "
            f"{_yn(r.get('within_5pct_of_ddp')):>6} {sent:>8} "
            + " ".join(f"{_mb(c[k]):>6}" for k in KINDS)  # AR RS AG BC A2A
            + f" {traffic:>7} {_yn(r.get('traffic_equal_to_ddp')):>5} {_mb(m['total']):>7} "
            + " ".join(f"{_mb(m[k]):>6}" for k in MEMORY_KINDS[:-1])  # by kind, as the head
            + f" {r['final_loss']:7.4f}")
        if "zk_stats_comm_bytes_per_rank" in r:
            z = r["zk_stats_comm_bytes_per_rank"]
            notes.append(f"{r['method']}: zkernels stats() sent MiB/rank/step: total "
                         f"{_mb(z['total'])} (RS {_mb(z['reduce_scatter'])}, AG "
                         f"{_mb(z['all_gather'])}, AR {_mb(z['all_reduce'])}); meter: "
                         f"{_mb(c['total'])}")
        if "comm_scopes_per_rank" in r:
            sc = r["comm_scopes_per_rank"]
            notes.append(f"{r['method']}: sent MiB/rank/step within the shard group "
                         f"{_mb(sc['within_group'])}, across groups {_mb(sc['across_groups'])}")
        if "ddp_hook_all_reduce_bytes_per_rank" in r:
            notes.append(f"{r['method']}: DDP comm hook buckets -> all-reduce MiB/rank/step "
                         f"{_mb(r['ddp_hook_all_reduce_bytes_per_rank'])}; meter: "
                         f"{_mb(c['all_reduce'])}")
        if "memory_location_bytes_per_rank" in r:
            w = r["memory_location_bytes_per_rank"]
            notes.append(f"{r['method']}: memory per rank: device {_mb(w['device'])}, host "
                         f"{_mb(w['host'])}, disk {_mb(w['disk'])} MiB")
        off = (r.get("zk_stats_last") or {}).get("offload")
        if off:
            notes.append(
                f"{r['method']}: offloaded update {off['update_s'] * 1e3:.1f} ms; host<->device "
                f"{_mb(off['device_to_host_bytes'])} down / {_mb(off['host_to_device_bytes'])} "
                f"up MiB; disk read/write {_mb(off['disk_read_bytes'])}/"
                f"{_mb(off['disk_write_bytes'])} MiB"
                + (f"; grad copies {off['device_to_host_s'] * 1e3:.2f} ms, "
                   f"{off['device_to_host_hidden_s'] * 1e3:.2f} ms hidden behind backward"
                   if "device_to_host_hidden_s" in off else "")
                + (f"; I/O wait {off['io_exposed_s'] * 1e3:.1f} ms" if "io_exposed_s" in off
                   else "")
                + (f"; param shards up at the gathers {_mb(off['param_host_to_device_bytes'])}"
                   f" MiB, {off['param_host_to_device_s'] * 1e3:.2f} ms copying, "
                   f"{off['param_host_to_device_exposed_s'] * 1e3:.2f} ms waited"
                   if "param_host_to_device_bytes" in off else ""))
        notes.extend(f"{r['method']}: {n}" for n in r["notes"])
    return "\n".join(lines + [""] + notes)


def compare_trees(runs: List[List[dict]], suffix: str = BEFORE) -> Dict[str, dict]:
    """``--baseline-tree``: each zkernels row over its baseline twin (``name + suffix``, the
    same row with zkernels from the other checkout, run in the same rounds).

    Returns:
        ``{method: {...}}``: ``step_time_ratio`` (median over every timed step of every run
        of this tree's step over the twin's step in the same round), ``step_time_ratio_medians``
        (of the two median steps), ``memory_ratio`` and ``traffic_ratio`` (totals, last run),
        ``memory_equal`` (every kind to the byte), the final losses; or ``{"error": ...}``
        where a tree could not run the row.
    """
    out: Dict[str, dict] = {}
    for name in [r["method"][:-len(suffix)] for r in runs[0] if r["method"].endswith(suffix)]:
        pairs = [({r["method"]: r for r in rows}[name], {r["method"]: r for r in rows}[
            name + suffix]) for rows in runs]
        bad = [(tree, r["error"]) for a, b in pairs for tree, r in (("after", a), ("before", b))
               if "error" in r]
        if bad:
            out[name] = {"error": f"{bad[0][0]}: {bad[0][1].splitlines()[0]}"}
            continue
        a, b = pairs[-1]
        ma, mb = a["memory_bytes_per_rank"], b["memory_bytes_per_rank"]
        after = [t for x, _ in pairs for t in x["step_times_s"]]
        before = [t for _, y in pairs for t in y["step_times_s"]]
        out[name] = {
            "step_time_ratio": statistics.median(x / y for x, y in zip(after, before)),
            "step_time_ratio_medians": statistics.median(after) / statistics.median(before),
            "memory_ratio": ma["total"] / mb["total"] if mb["total"] else None,
            "memory_equal": all(ma.get(k) == mb.get(k) for k in MEMORY_KINDS),
            "traffic_ratio": (a["comm_bytes_per_rank"]["total"] / b["comm_bytes_per_rank"]["total"]
                              if b["comm_bytes_per_rank"]["total"] else None),
            "final_loss": {"after": a["final_loss"], "before": b["final_loss"]},
        }
    return out


def format_baseline(cmp: Dict[str, dict], tree: str, runs: int) -> str:
    """The after/before table of :func:`compare_trees`."""
    head = (f"{'method':<21} {'paired':>6} {'medians':>7} {'memory':>7} {'=bytes':>6} "
            f"{'sent':>7} {'loss after':>10} {'before':>10}")
    lines = [f"\nbefore/after: this tree over zkernels from {tree}, both in the same rounds "
             f"({runs} run(s)); ratios after/before of: each step over the baseline's step in "
             f"the same round, median (paired); the median steps (medians); memory and bytes "
             f"sent per rank (=bytes: every memory kind equal)", head, "-" * len(head)]
    for name, c in cmp.items():
        if "error" in c:
            lines.append(f"{name:<21} not compared: {c['error']}")
            continue
        loss = c["final_loss"]
        lines.append(f"{name:<21} {c['step_time_ratio']:6.3f} {c['step_time_ratio_medians']:7.3f} "
                     f"{c['memory_ratio'] or float('nan'):7.4f} {_yn(c['memory_equal']):>6} "
                     f"{c['traffic_ratio'] or float('nan'):7.4f} {loss['after']:10.6f} "
                     f"{loss['before']:10.6f}")
    return "\n".join(lines)
