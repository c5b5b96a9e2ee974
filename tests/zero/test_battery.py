"""The ZeRO battery (``_battery.ROWS``: rung x dtype x reshard mode x options, each row's checks
against one oracle, ``_battery.Reference``) at the world sizes each row lists: world size 1 in
this process (no process group), above it one spawn of gloo ranks per world size for the rows
selected (``-k <row>`` runs that row's ranks only). Each rank runs a row's body below and
returns what it measured; the test asserts on that here. Each check of a row is its own test,
``test_<check>[<world size>-<row>-<check>]``. The rows that need 4 ranks in 2 groups (hybrid
sharding, ``reshard_after_forward=2``) run in test_hybrid.py's spawn (``parity`` there too).

The checks:

- ``parity``: every step's loss and parameters against the one oracle, single-process
  ``torch.optim.AdamW`` on the same data (see ``_battery.Reference``): each comparison is the
  worst error over its tolerance (``_harness.ratio``, ``<= 1`` passes). Beside it, what the
  rung promises on the way: overlap of the reduction with backward, no communication under
  ``no_sync``, full gradients freed (stages 2-3), nothing left gathered (stage 3), the reduce
  buffers' bound, frozen parameters unchanged, clipping active, the offload transfers (bytes,
  and copy/IO times bounded by the step's measured wall time).
- ``catches_<fault>``: ``parity`` with a broken ZeRO side must fail (the oracle can fail).
- ``same_bits``: ``offload_params`` only moves the parameter shards to host RAM, so the row
  is bit-identical to the same row without it (data movement is compared bit for bit).
- ``round_trip``: ``state_dict()`` after 3 steps (the row's ``steps`` aside) loads into a fresh
  optimizer over another initialization (at the other placement for an offload row, and
  back) and the run continues bit for bit; a state of another world size is refused by name.
- ``traffic_memory`` (a rung on the device): bytes sent per step and held per rank against
  the ring formula and docs/design.md#the-ladder (``_traffic.py``, asserted on the ranks);
  hybrid rows check theirs in ``parity`` (``_traffic.hybrid_traffic_memory``).
- ``overflow`` (fp16): an inf gradient on one rank makes every rank skip the step bit for bit,
  the scale halves, clean steps grow it again.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import time
from functools import partial
from typing import Optional

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from tests.zero import _battery
from tests.zero._battery import (HYBRID, LR, Row, Reference, _params, _train, build,
                                 check_transfer_times, row_model, row_optimizer, temp_folder)
from tests.zero._harness import MICRO_BATCH, chunk, make_batches, rank_fixture
from tests.zero._traffic import hybrid_traffic_memory, traffic_memory


# -- parity -------------------------------------------------------------------------------------

@contextlib.contextmanager
def _newton_schulz_in_fp32(row: Row):
    """fp32 Muon rows: torch's Newton-Schulz in fp32 on both sides for the run (restored
    after); the bf16 row runs torch's own.

    [Note: Muon's parity in fp32]
    torch.optim.Muon orthogonalizes in bf16: an fp32 round-off of the gradient (the N ranks'
    reduce-scatter sums in another order than one backward; clipping's coefficient from
    a sum of squares in another order) flips bf16 roundings, and the step moves by bf16's
    epsilon times lr. At 4 ranks with clip=0.05 that put blocks.0.fc.weight 184x over
    tol(float32) at step 3 with and without offload="cpu" (0.03x with this patch): the
    oracle's sensitivity, not the owners' arithmetic. As test_matrix_optim.py's hybrid test,
    the fp32 rows compare the update itself, in fp32, to tol(float32) ([Note: Muon's
    tolerance] in _battery.py has the measured ratios). The bf16 row (bf16 compute) keeps
    torch's bf16 iteration, the one users run, at the bf16 rows' ordinary bounds (its gradient
    sums are exact: the same Note says why)."""
    if not row.optim.startswith("muon") or row.dtype != "fp32":
        yield
        return
    import torch.optim._muon as _muon
    from tests.zero import _matrix_checks
    inner = _muon._zeropower_via_newtonschulz
    _matrix_checks.fp32_newton_schulz()
    try:
        yield
    finally:
        _muon._zeropower_via_newtonschulz = inner


def parity(rank, ws, *, row: Row, fault: Optional[str] = None) -> dict:
    """The row against the oracle every step, and what the rung promises on the way: what
    this rank measured (``check_parity`` asserts on it). ``fault`` breaks the ZeRO side on
    purpose (``catches``): "wrong_mean" averages over N + 1 instead of N, "skip_micro" drops
    the last micro-batch of the last rank from step 1 on, "one_element" gives one gradient
    element its neighbour's value on every rank; a faulty run returns after its steps."""
    assert row.dtype in ("fp32", "bf16"), "fp16 rows run the overflow check"
    with temp_folder() as folder, _newton_schulz_in_fp32(row), _battery.master_fault(fault):
        model = row_model(row)
        ref = Reference(row, model, ws)   # before stage 3 shards the parameters
        frozen = {n: p.detach().clone() for n, p in model.named_parameters()
                  if not p.requires_grad}
        opt = row_optimizer(row, model, folder)
        try:
            return _parity(rank, ws, row, model, opt, ref, frozen, fault)
        finally:
            opt.close()


def _parity(rank, ws, row, model, opt, ref, frozen_before, fault) -> dict:
    stage, micro = row.stage, row.micro
    out = {"tied": model.head.weight is model.wte.weight, "compare": [], "no_sync": [],
           "gathered_after_backward": [], "grads_left": [], "grads_missing": [],
           "overlap": [], "lr": []}
    if fault == "one_element":
        def neighbour(g):  # an off-by-one in one offset: element [5, 7] gets [5, 8]'s value
            g = g.clone()
            g[5, 7] = g[5, 8]
            return g

        model.blocks[0].fc.weight.register_hook(neighbour)
    if fault == _battery.MAPPING_FAULT:
        for rec in opt.shard_update.states:   # every piece reads its neighbour's gradient
            if rec.rule is None:   # (a fused AdamW group beside a matrix class's)
                continue
            step = rec.rule.step
            rec.rule.step = lambda g, group, scale, live=None, step=step: \
                step(g.roll(1), group, scale, live)
        mx = opt.shard_update.matrix   # the owners' whole matrices read them off by one too
        if mx is not None:
            mstep = mx.step
            mx.step = lambda comm, meter, shards, *a: mstep(comm, meter,
                                                           [g.roll(1) for g in shards], *a)
    if fault in _battery.HPARAM_FAULTS:
        for g in opt.param_groups:
            g.update(_battery.HPARAM_FAULTS[fault](g))
    if fault == _battery.SCALE_FAULT:
        opt.shard_update.place.step_ops = _battery.BrokenScale(opt.shard_update.place.step_ops)
    grad_factor = ws / (ws + 1) if fault == "wrong_mean" else 1.0
    buffers_before = opt.stats()["memory_bytes"]["buffers"]
    # Bytes the reduce-scatters had sent when backward reached the embeddings' output, i.e.
    # while the embedding gradients were still to be computed (the reduction overlaps).
    mid_backward = []
    meter = opt.meter   # not opt: a hook left on the last graph must not hold the groups

    def watch(module, inputs, out):
        out.register_hook(lambda g: mid_backward.append(meter.current_step()["reduce_scatter"]))

    hook = model.wte.register_forward_hook(watch)
    scheds = []
    if row.sched:
        lam = lambda s: 1.0 / (1.0 + s)  # noqa: E731
        scheds = [LambdaLR(opt, lam), LambdaLR(ref.opt, lam)]
    step_ends = [time.perf_counter()]
    for step, batch in enumerate(make_batches(row.steps, ws * micro * MICRO_BATCH)):
        local = 0.0
        for m in range(micro):
            last = m == micro - 1
            with (contextlib.nullcontext() if last else opt.no_sync()):
                loss = model(*chunk(batch, rank * micro + m)) / micro
                if not (fault == "skip_micro" and last and rank == ws - 1 and step >= 1):
                    (loss * grad_factor).backward()
            local += loss.item()
            if not last:
                # Stage 3 gathers its units in forward and backward even inside no_sync; no
                # stage reduces gradients there.
                sent = opt.meter.current_step()
                out["no_sync"].append({
                    "step": step, "sent": sent["reduce_scatter"] if stage == 3 else sent["total"],
                    "across_groups": opt.meter.current_step_scopes()["across_groups"]})
        if stage == 3:   # once per step: stats() measures every storage
            out["gathered_after_backward"].append(opt.stats()["gather"]["gathered_bytes"])
        if fault != "skip_micro":  # else the last rank ran no synced backward: nothing overlapped
            if stage >= 2:
                out["grads_left"] += [(step, n) for n, p in model.named_parameters()
                                      if p.grad is not None]
            else:
                out["grads_missing"] += [(step, n) for n, p in model.named_parameters()
                                         if p.requires_grad and p.grad is None]
            out["overlap"].append((step, mid_backward[-1] if mid_backward else None,
                                   opt.meter.current_step()["reduce_scatter"]))
        opt.step()
        step_ends.append(time.perf_counter())
        opt.zero_grad()
        losses = ref.step(batch)
        for s in scheds:
            s.step()
        if row.sched:
            out["lr"].append((step, opt.param_groups[0]["lr"], ref.opt.param_groups[0]["lr"]))
        out["compare"].append(ref.compare(model, opt, step, rank, local, losses))
    hook.remove()
    if fault is not None:
        return out
    st = opt.stats()
    if stage == 3:  # reduce buffers only while gradients are in flight, never more than the rule
        rule = opt.policy.num_reduce_buffers(len(opt.units), len(opt.param_groups))
        out["buffers"] = {
            "held": st["memory_bytes_by_location"]["device"]["buffers"],   # offload: staging
            "peak": st["step_peak_bytes"]["buffers"],
            "limit": rule * max(u.layout.padded_numel for u in opt.units) * 4}
        out["gather"] = st["gather"]
    else:
        out["buffers"] = {"before": buffers_before, "after": st["memory_bytes"]["buffers"]}
    out["clipped"] = ref.clipped
    out["frozen_with_grad"] = [n for n, p in model.named_parameters()
                               if n in frozen_before and p.grad is not None]
    with opt.gathered():
        out["frozen_changed"] = [n for n, p in model.named_parameters()
                                 if n in frozen_before and not torch.equal(p, frozen_before[n])]
    out["steps"] = st["step"]
    if row.offload:
        out["offload"] = st["offload"]
        out["wall_s"] = step_ends[-1] - step_ends[-2]
        out["shard_bytes"] = sum(u.layout.shard_numel * u.compute_shard.element_size()
                                 for u in opt.units)
        out["grad_bytes"] = sum(u.layout.shard_numel * 4 for u in opt.units)
        if row.offload == "nvme" and row.offload_params:
            out["file_bytes"] = sum(u.shard.file.data_bytes for u in opt.units)
    if row.shard_size:
        # The gathered() above is counted in the next step: measure a step after a clean one.
        for batch in make_batches(2, ws * MICRO_BATCH, seed=3):
            _train(model, opt, rank, batch)
        hybrid_traffic_memory(opt, ws, stage, row.offload, K=row.shard_size,
                              state=row.state, row=row)
    return out


def beyond(c: dict) -> bool:
    """A step's comparison (``Reference.compare``) out of tolerance (NaN counts as out)."""
    return not all(v <= 1 for v in (c["loss"], c["params"], c["master"] or 0.0,
                                    c.get("moments") or 0.0))


def check_parity(res: dict, row: Row, ws: int) -> None:
    """Assert on what ``parity`` measured on one rank."""
    assert res["tied"], "tied weights must stay one parameter"
    assert [c for c in res["compare"] if beyond(c)] == []
    assert len(res["compare"]) == row.steps
    # no_sync must not communicate (stage 3 gathers there, but must not reduce)
    assert [s for s in res["no_sync"] if s["sent"] or s["across_groups"]] == []
    assert len(res["no_sync"]) == row.steps * (row.micro - 1)
    assert [b for b in res["gathered_after_backward"] if b] == [], "backward must free every unit"
    assert res["grads_left"] == [], "stages 2-3 free full grads"
    assert res["grads_missing"] == [], "stage 1 keeps them"
    if ws > 1 and row.shard_size != 1:   # the reduction ran during backward
        assert [(s, mid, sent) for s, mid, sent in res["overlap"]
                if not (mid is not None and 0 < mid < sent)] == []
    if row.sched:
        assert [(s, a, b) for s, a, b in res["lr"] if not (a == b != LR or s == 0)] == []
    buf = res["buffers"]
    if row.stage == 3:  # reduce buffers only while gradients are in flight, within the rule
        assert buf["held"] == 0 and 0 < buf["peak"] <= buf["limit"], buf
        g = res["gather"]
        assert g["gathered_bytes"] == 0, g
        if row.reshard is True:   # resharded after forward: the prefetch bound holds (the
            # recompute of checkpointed blocks gathers again, frozen flats included)
            assert 0 < g["peak_gathered_bytes"] <= g["limit_bytes"], g
    else:
        assert buf["after"] == buf["before"], "the reduce pool must not grow"
    if row.clip is not None:
        assert res["clipped"] == row.steps, "clipping must be active on every step"
    assert res["frozen_with_grad"] == []
    assert res["frozen_changed"] == []
    assert res["steps"] == row.steps
    if row.offload:
        check_offload_stats(res, row)


def check_offload_stats(res: dict, row: Row) -> None:
    """The last step's transfers: bytes both ways (disk read = written with NVMe), time spent
    where bytes moved, every time figure within the step's wall time."""
    st, shard_bytes, grad_bytes = res["offload"], res["shard_bytes"], res["grad_bytes"]
    assert st["kind"] == row.offload and st["device_to_host_bytes"] > 0, st
    check_transfer_times(st, res["wall_s"])
    assert st["device_to_host_s"] > 0, st
    if row.offload_params:
        # The update writes the host shards (or files): nothing goes up in step(); every
        # gather brought its shard in instead: per micro-step forward and backward (once with
        # reshard_after_forward=False), plus the previous step's opt.gathered().
        gathers = (2 if row.reshard is True else 1) * row.micro + 1
        assert st["host_to_device_bytes"] == 0, st
        assert st["param_host_to_device_s"] > 0, st
        assert st["param_host_to_device_bytes"] == gathers * shard_bytes, (st, shard_bytes)
        if row.offload == "nvme":   # each gather read its file, the update wrote it once
            file_bytes = res["file_bytes"]
            assert st["param_disk_read_bytes"] == gathers * file_bytes, (st, file_bytes)
            assert st["param_disk_write_bytes"] == file_bytes, (st, file_bytes)
    else:   # the updated compute shards come up once
        assert st["host_to_device_bytes"] == shard_bytes, (st, shard_bytes)
    # the fp32 gradient shards go down once per step (exact: the counters are per step)
    assert st["device_to_host_bytes"] == grad_bytes, (st, grad_bytes)
    if row.offload == "nvme":
        assert st["disk_read_bytes"] == st["disk_write_bytes"] > 0, st
        assert st["disk_io_s"] > 0, st


def catches(rank, ws, *, row: Row, fault: str) -> dict:
    """``parity`` with ``fault``: its comparisons (every rank compares the same gathered
    parameters with the same reference, so every rank sees the fault at the same step and
    none is left waiting in a collective), or, at stage 3, the path check's stop."""
    try:
        return {"compare": parity(rank, ws, row=row, fault=fault)["compare"], "stopped": None}
    except RuntimeError as exc:
        # Stage 3: a rank that skips its backward takes another path than its peers, which
        # the path check stops before any mismatched collective ([Note: divergent paths]).
        if not (row.stage == 3 and fault == "skip_micro" and ws > 1
                and "ranks disagree on what comes next" in str(exc)):
            raise
        return {"compare": None, "stopped": str(exc)}


# -- offload_params: the same bits ------------------------------------------------------------

def same_bits(rank, ws, *, row: Row, steps: int = 4) -> dict:
    """The row with and without ``offload_params``, side by side: each step's losses, whether
    every parameter was equal, and at the end whether every state element was."""
    assert row.offload_params
    out = {"losses": [], "params_equal": []}
    with temp_folder() as folder:
        runs = [build(row, folder, offload_params=op) for op in (False, True)]
        for batch in make_batches(steps, ws * row.micro * MICRO_BATCH):
            losses = []
            for model, opt in runs:
                total = 0.0
                for k in range(row.micro):
                    ctx = opt.no_sync() if k < row.micro - 1 else contextlib.nullcontext()
                    with ctx:
                        loss = model(*chunk(batch, rank * row.micro + k)) / row.micro
                        opt.backward(loss)
                    total += loss.item()
                opt.step()
                opt.zero_grad()
                losses.append(total)
            out["losses"].append(tuple(losses))
            a, b = (_params(m, o) for m, o in runs)
            out["params_equal"].append(all(torch.equal(x, y) for x, y in zip(a, b)))
        sd0, sd1 = (o.state_dict()["state"] for _, o in runs)
        out["state_differs"] = [(i, k) for i, s in sd0.items()
                                for k in ("master", "exp_avg", "exp_avg_sq", "step")
                                if not torch.equal(torch.as_tensor(s[k]),
                                                   torch.as_tensor(sd1[i][k]))]
        for _, o in runs:
            o.close()
    return out


# -- state round trip -------------------------------------------------------------------------

def round_trip(rank, ws, *, row: Row) -> list:
    """Save after 3 steps, load into a fresh optimizer over a differently initialized model
    (an offload row: the same rung on the device, and the other way round), continue: per
    pair, whether each step equals the uninterrupted run, the step count, and what loading a
    state of another world size raised."""
    batches = make_batches(6, ws * MICRO_BATCH)
    device = dataclasses.replace(row, offload=None, offload_params=False)
    pairs = [(row, row)] if not row.offload else [(row, device), (device, row)]
    out = []
    with temp_folder() as folder:
        for src, dst in pairs:
            m1, o1 = build(src, folder)
            for b in batches[:3]:
                _train(m1, o1, rank, b)
            buf = io.BytesIO()
            torch.save(o1.state_dict(), buf)
            trace = []
            for b in batches[3:]:
                _train(m1, o1, rank, b)
                trace.append(_params(m1, o1))
            m2, o2 = build(dst, folder, seed=7)
            buf.seek(0)
            sd = torch.load(buf, weights_only=False)
            o2.load_state_dict(sd)
            equal = []
            for b, expected in zip(batches[3:], trace):
                _train(m2, o2, rank, b)
                equal.append(all(torch.equal(a, p) for a, p in zip(expected, _params(m2, o2))))
            res = {"pair": (src.id, dst.id), "equal": equal, "step": o2.stats()["step"]}
            sd["zero"]["world_size"] = ws + 1
            try:
                o2.load_state_dict(sd)
                res["other_world_size"] = None
            except ValueError as exc:
                res["other_world_size"] = str(exc)
            out.append(res)
            o1.close()
            o2.close()
    return out


# -- fp16 ---------------------------------------------------------------------------------------

OVERFLOW_SCALES = [2.0 ** 10, 2.0 ** 9, 2.0 ** 9, 2.0 ** 10, 2.0 ** 10]


def overflow(rank, ws, *, row: Row) -> list:
    """fp16: an inf gradient on the last rank only at step 1 (after the reduce-scatter only the
    owner of that element sees it, every other rank relies on the all-reduce). Per step: the
    loss scale, the skips counted, whether parameters and masters stayed bit for bit, the
    state's step counts, whether every parameter is finite."""
    out = []
    with temp_folder() as folder:
        model, opt = build(row, folder)
        before = _params(model, opt)
        masters = [s["master"] for s in opt.state_dict()["state"].values()]
        for step, batch in enumerate(make_batches(len(OVERFLOW_SCALES), ws * MICRO_BATCH)):
            loss = model(*chunk(batch, rank))
            if step == 1:  # gathered() is collective: every rank enters, the last adds inf
                with opt.gathered(model.ln_f):
                    loss = loss + model.ln_f.bias[0] * (float("inf") if rank == ws - 1 else 0.0)
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            after = _params(model, opt)
            state = list(opt.state_dict()["state"].values())
            st = opt.stats()
            out.append({
                "step": step, "loss_scale": st["loss_scale"], "overflow_skips":
                st["overflow_skips"], "steps": st["step"],
                "unchanged": all(torch.equal(a, p) for a, p in zip(before, after)) and all(
                    torch.equal(a, s["master"]) for a, s in zip(masters, state)),
                "state_steps": sorted({int(s["step"]) for s in state}),
                "finite": all(bool(torch.isfinite(p).all()) for p in after)})
            before, masters = after, [s["master"] for s in state]
        opt.close()
    return out


# -- the rows -----------------------------------------------------------------------------------

def _body(row: Row, check: str):
    if check.startswith("catches_"):
        return partial(catches, row=row, fault=check[len("catches_"):])
    return partial({"parity": parity, "same_bits": same_bits, "round_trip": round_trip,
                    "overflow": overflow, "traffic_memory": traffic_memory}[check], row=row)


BODIES = {key: _body(row, check) for key, (row, check) in _battery.TABLE.items()
          if _battery.WORLD_SIZES[key] is not HYBRID}

ranks = rank_fixture(BODIES, timeout=600.0)


def _cases(kind: str):
    """``(world_size, row)`` for every non-hybrid row whose check is ``kind`` (a prefix for
    ``catches_``), id ``<world size>-<row>-<check>``; slow where the table says so
    ([Note: the quick suite and the full suite]: 1 and 4 ranks on the device and 1 rank with
    offload are the full suite's, _battery.FULL, _battery.OFFLOAD)."""
    out = []
    for key in BODIES:
        if not _battery.TABLE[key][1].startswith(kind):
            continue
        for ws, slow in sorted(_battery.WORLD_SIZES[key].items()):
            marks = (pytest.mark.slow,) if slow else ()
            out.append(pytest.param(ws, key, marks=marks, id=f"{ws}-{key}"))
    return out


def _row(key: str) -> Row:
    return _battery.TABLE[key][0]


@pytest.mark.parametrize("world_size, row", _cases("parity"))
def test_parity(ranks, world_size, row):
    for res in ranks(row, world_size):
        check_parity(res, _row(row), world_size)


@pytest.mark.parametrize("world_size, row", _cases("catches_"))
def test_catches(ranks, world_size, row):
    """Every rank's parity fails its comparison at some step (or stage 3's path check stops
    the divergent rank first)."""
    for res in ranks(row, world_size):
        assert res["stopped"] or any(beyond(c) for c in res["compare"]), \
            f"the parity check did not notice the fault: {res['compare']}"


@pytest.mark.parametrize("world_size, row", _cases("same_bits"))
def test_same_bits(ranks, world_size, row):
    for res in ranks(row, world_size):
        assert [a == b for a, b in res["losses"]] == [True] * len(res["losses"]), res["losses"]
        assert all(res["params_equal"]), "offload_params changed a bit"
        assert res["state_differs"] == []


@pytest.mark.parametrize("world_size, row", _cases("round_trip"))
def test_round_trip(ranks, world_size, row):
    for pairs in ranks(row, world_size):
        for res in pairs:
            assert res["equal"] == [True, True, True], res["pair"]
            assert res["step"] == 6
            assert res["other_world_size"] is not None, \
                "loading a state of another world size must fail"
            assert "world size" in res["other_world_size"]


@pytest.mark.parametrize("world_size, row", _cases("overflow"))
def test_overflow(ranks, world_size, row):
    """Every rank skips step 1 bit for bit, the scale halves and grows again, stats counts
    the skip."""
    for steps in ranks(row, world_size):
        assert [s["loss_scale"] for s in steps] == OVERFLOW_SCALES
        assert [s["overflow_skips"] for s in steps] == [0, 1, 1, 1, 1]
        assert [s["steps"] for s in steps] == [1, 2, 3, 4, 5]
        assert [s["unchanged"] for s in steps] == [False, True, False, False, False]
        assert steps[1]["state_steps"] == [1]
        assert [s["finite"] for i, s in enumerate(steps) if i != 1] == [True] * 4


@pytest.mark.parametrize("world_size, row", _cases("traffic_memory"))
def test_traffic_memory(ranks, world_size, row):
    ranks(row, world_size)   # asserted on the ranks (_traffic.py); a failure is re-raised


def test_every_row_is_run_somewhere():
    """Each check of the table runs at one world size at least, in this file or in
    test_hybrid.py's spawn, and its id names its row uniquely."""
    from tests.zero import test_hybrid
    assert set(BODIES) | set(test_hybrid.BODIES) >= set(_battery.TABLE)
    assert len({row.id for row, _, _ in _battery.ROWS}) == len(_battery.ROWS)
