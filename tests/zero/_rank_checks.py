"""The checks each rank runs (module-level so spawned ranks can import them).

``battery(rank, world_size)`` runs every multi-rank check once and reports per check, so one
spawn per world size covers them all (each spawn pays a torch import per rank).
"""
from __future__ import annotations

import contextlib
import io
import logging
from functools import partial

import torch
from torch.optim.lr_scheduler import LambdaLR

import zkernels as zk
from zkernels.zero import LossScaleConfig
from tests.conftest import tol
from tests.zero._harness import (EPS, LR, MICRO_BATCH, assert_params_close, assert_step_close,
                                 chunk, clone_model,
                                 make_batches, make_model, run_checks, reference_grads,
                                 split_groups, world_mean)

BETAS = (0.9, 0.95)
WD = 0.1
SMALL_BUCKET = 3000  # bytes: several buckets, and fc/fc_out/wte larger than one bucket
STAGES = (1, 2, 3)  # the checks parametrized over stages


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


FAULTS = ("wrong_mean", "skip_micro", "one_element")


def fp32_parity(rank, ws, *, stage, steps=10, micro=1, clip=None, groups=False, frozen=False,
                sched=False, fault=None, offload_kw=None):
    """ZeRO on N ranks with micro-batch b (x micro) == torch.optim.AdamW on one process with
    the whole batch, loss and every parameter each step, to fp32 round-off (tol(float32):
    rtol 1e-5, atol 1e-6), the reference's gradient computed micro-batch by micro-batch as the
    ranks do (see [Note: same-order reference] and [Note: eps in the parity tests]).

    ``fault`` breaks the ZeRO side on purpose, to show the comparison catches real errors
    (``catches``): "wrong_mean" averages over N + 1 instead of N, "skip_micro" drops the last
    micro-batch of the last rank from step 1 on, "one_element" makes one gradient element 1%
    too large on every rank."""
    model = make_model()
    if frozen:
        model.wpe.weight.requires_grad_(False)
    ref = clone_model(model)
    frozen_before = model.wpe.weight.detach().clone()
    opt = zk.ZeroOptimizer(model, stage=stage, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                           param_groups=split_groups(model, WD) if groups else None,
                           max_grad_norm=clip, bucket_bytes=SMALL_BUCKET,
                           **(offload_kw or {}))
    ropt = torch.optim.AdamW(split_groups(ref, WD) if groups else _trainable(ref), lr=LR,
                             betas=BETAS, eps=EPS, weight_decay=WD)
    assert model.head.weight is model.wte.weight, "tied weights must stay one parameter"
    if frozen:
        assert all(p is not model.wpe.weight for b in opt.units for p in b.params)
    if groups:
        for b in opt.units:  # buckets never mix groups
            assert all(any(p is q for q in opt.param_groups[b.group_index]["params"])
                       for p in b.params)
    if fault == "one_element":
        def neighbour(g):  # an off-by-one in one offset: element [5, 7] gets [5, 8]'s value
            g = g.clone()
            g[5, 7] = g[5, 8]
            return g

        model.blocks[0].fc.weight.register_hook(neighbour)
    grad_factor = ws / (ws + 1) if fault == "wrong_mean" else 1.0
    num_buffers = len(opt.reducer.held_buffers())
    # Bytes the reduce-scatters had sent when backward reached the embeddings' output, i.e.
    # while the embedding gradients were still to be computed (stage 2 overlaps).
    mid_backward = []

    def watch(module, inputs, out):
        out.register_hook(
            lambda g: mid_backward.append(opt.meter.current_step()["reduce_scatter"]))

    model.wte.register_forward_hook(watch)
    scheds = []
    if sched:
        lam = lambda s: 1.0 / (1.0 + s)  # noqa: E731
        scheds = [LambdaLR(opt, lam), LambdaLR(ropt, lam)]
    clipped = 0
    for step, batch in enumerate(make_batches(steps, ws * micro * MICRO_BATCH)):
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
                assert (sent["reduce_scatter"] if stage == 3 else sent["total"]) == 0, \
                    "no_sync must not communicate (stage 3: must not reduce)"
        if fault != "skip_micro":  # else the last rank ran no synced backward: nothing overlapped
            if stage >= 2:
                assert all(p.grad is None for p in model.parameters()), \
                    "stages 2-3 free full grads"
            else:
                assert all(p.grad is not None for p in _trainable(model)), "stage 1 keeps them"
            sent = opt.meter.current_step()["reduce_scatter"]
            assert ws == 1 or 0 < mid_backward[-1] < sent, \
                f"stage {stage} reduces during backward"
        opt.step()
        opt.zero_grad()
        rlosses = reference_grads(ref, batch, ws, micro)
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(_trainable(ref), clip)
            clipped += int(norm > clip)
        ropt.step()
        ropt.zero_grad()
        for s in scheds:
            s.step()
        if sched:
            assert opt.param_groups[0]["lr"] == ropt.param_groups[0]["lr"] != LR or step == 0
        torch.testing.assert_close(world_mean(local, ws), sum(rlosses) / ws,
                                   **tol(torch.float32), msg=lambda m: f"step {step} loss: {m}")
        with opt.gathered():  # stage 3: full parameters only inside
            assert_step_close(model, ref, step, **tol(torch.float32))
    if stage == 3:  # reduce buffers only while gradients are in flight, never more than the rule
        rule = opt.policy.num_reduce_buffers(len(opt.units), len(opt.param_groups))
        limit = rule * max(u.layout.padded_numel for u in opt.units) * 4
        peak = opt.stats()["step_peak_bytes"]["buffers"]
        assert opt.reducer.held_buffers() == [] and 0 < peak <= limit, (peak, limit)
    else:
        assert len(opt.reducer.held_buffers()) == num_buffers, "the reduce pool must not grow"
    if clip is not None:
        assert clipped == steps, f"clipping was active on {clipped}/{steps} steps"
    if frozen:
        with opt.gathered():
            assert torch.equal(model.wpe.weight, frozen_before)
        assert model.wpe.weight.grad is None
    assert opt.stats()["step"] == steps


def catches(rank, ws, *, fault, stage, steps=2):
    """The parity comparison must fail on a broken ZeRO side (every rank compares the same
    gathered parameters with the same reference, so every rank fails at the same step and
    none is left waiting in a collective)."""
    try:
        fp32_parity(rank, ws, stage=stage, steps=steps, micro=2, fault=fault)
    except RuntimeError as exc:
        # Stage 3: a rank that skips its backward takes another path than its peers, which
        # the path check stops before any mismatched collective ([Note: divergent paths]).
        if not (stage == 3 and fault == "skip_micro" and ws > 1
                and "ranks disagree on what comes next" in str(exc)):
            raise
        return
    except AssertionError as exc:
        assert "step" in str(exc), f"failed for another reason than the comparison: {exc}"
        return
    raise AssertionError(f"the parity check did not notice fault {fault!r}")


def bf16_parity(rank, ws, *, stage, steps=10):
    """param_dtype=bf16 == a single-process reference of the same recipe: per-rank bf16
    gradients, times 1/N in fp32, summed in fp32, AdamW on fp32 masters, masters rounded to
    bf16. Compute params and losses: tol(bfloat16); fp32 master shards: rtol 1e-4, atol 1e-5
    (reduction order differs; a bf16 rounding flip in the forward then moves the next
    gradients by bf16 round-off, which Adam turns into ~1e-5 of lr).

    The optimizer runs the reference ops here, whose AdamW is torch's arithmetic: this checks
    the recipe (sharding, casts, reduction), not a backend. A backend whose fp32 round-off
    differs from torch's (the C++ SIMD AdamW, Triton) flips bf16 roundings of the compute
    params, and Adam's normalized step amplifies that on near-zero gradients (the attention
    key bias has a zero true gradient) into a chaotic drift of a few % of lr within a few
    steps; the backends' own agreement with torch.optim.AdamW is tested in tests/ops and
    tests/native."""
    model = make_model()
    master = clone_model(model)
    compute = clone_model(model).to(torch.bfloat16)
    # The backend is the optimizer's argument, not ZKERNELS_BACKEND: at world size 1 this runs
    # in the pytest process itself, where a variable set here would leak into every later test.
    opt = zk.ZeroOptimizer(model, stage=stage, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                           param_dtype=torch.bfloat16, bucket_bytes=SMALL_BUCKET,
                           ops_backend="reference")
    ropt = torch.optim.AdamW(master.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    for step, batch in enumerate(make_batches(steps, ws * MICRO_BATCH)):
        loss = model(*chunk(batch, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        sums = [torch.zeros_like(q) for q in master.parameters()]
        losses = []
        for r in range(ws):
            rl = compute(*chunk(batch, r))
            rl.backward()
            losses.append(rl.item())
            for acc, c in zip(sums, compute.parameters()):
                acc += c.grad.float() * (1.0 / ws)
            compute.zero_grad(set_to_none=True)
        for q, acc in zip(master.parameters(), sums):
            q.grad = acc
        ropt.step()
        ropt.zero_grad()
        with torch.no_grad():
            for c, q in zip(compute.parameters(), master.parameters()):
                c.copy_(q)
        torch.testing.assert_close(loss.item(), losses[rank], **tol(torch.bfloat16))
        assert_params_close(model, compute, step, **tol(torch.bfloat16))
        flat = {}
        for b, st in zip(opt.units, opt.shard_update.states):
            srcs = [dict((id(p), q) for p, q in zip(model.parameters(),
                                                     master.parameters()))[id(p)]
                    for p in b.params]
            flat = zk.ops.flatten([s.detach() for s in srcs], offsets=b.layout.offsets,
                                  out=torch.zeros(b.layout.padded_numel))
            torch.testing.assert_close(st.master, flat[b.shard_slice], rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"step {step} master: {m}")


def fp16_overflow(rank, ws, *, stage):
    """An inf gradient on the last rank only: every rank skips the step (params and master
    bit-identical), the scale halves, stats counts the skip; clean steps grow it again."""
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=stage, lr=LR, eps=EPS, param_dtype=torch.float16,
                           bucket_bytes=SMALL_BUCKET,
                           loss_scale=LossScaleConfig(init_scale=2.0 ** 10, growth_interval=2))
    scales = [2.0 ** 10, 2.0 ** 9, 2.0 ** 9, 2.0 ** 10, 2.0 ** 10]
    for step, batch in enumerate(make_batches(5, ws * MICRO_BATCH)):
        loss = model(*chunk(batch, rank))
        if step == 1 and rank == ws - 1:
            # inf in ONE gradient element of one rank: after the reduce-scatter only the
            # rank owning that element sees it, so every other rank relies on the all-reduce.
            loss = loss + model.ln_f.bias[0] * float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        masters = [st.master.clone() for st in opt.shard_update.states]
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        same = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        same_master = all(torch.equal(a, st.master)
                          for a, st in zip(masters, opt.shard_update.states))
        st = opt.stats()
        assert st["loss_scale"] == scales[step], (step, st["loss_scale"])
        assert st["overflow_skips"] == (0 if step == 0 else 1) and st["step"] == step + 1
        if step == 1:
            assert same and same_master, "an overflow step must change nothing"
            assert all(st.step == 1 for st in opt.shard_update.states)
        else:
            assert not same and not same_master
            assert all(torch.isfinite(p).all() for p in model.parameters())


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def nonfinite_policy(rank, ws, *, stage, policy, param_dtype):
    """fp32/bf16 (no loss scaling): an inf gradient at step 2 and a NaN at step 3, on the last
    rank only (after the reduce-scatter only the owner of that element sees it).

    "skip": every rank skips both steps bit for bit (params, masters, moments, bucket steps),
    ``overflow_skips`` counts 2, rank 0 logs one WARNING per skip naming the step, and clean
    steps update. "raise": every rank raises NonFiniteGradientError naming the step, exactly
    one rank (the owner) names ln_f.bias, nothing changes, stats() counts the skip, and training
    goes on after zero_grad."""
    from zkernels.zero.gradients.nonfinite import NonFiniteGradientError
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=stage, lr=LR, eps=EPS, param_dtype=param_dtype,
                           bucket_bytes=SMALL_BUCKET, nonfinite=policy)
    records = _Records()
    logging.getLogger("zkernels.zero").addHandler(records)
    try:
        for step, batch in enumerate(make_batches(5, ws * MICRO_BATCH)):
            with opt.gathered():  # stage 3: parameters have storage only inside
                before = [p.detach().clone() for p in model.parameters()]
            states = [t.clone() for b in opt.shard_update.states
                      for t in (b.master, b.exp_avg, b.exp_avg_sq)]
            loss = model(*chunk(batch, rank))
            hook = None
            if step in (1, 2) and rank == ws - 1:
                # ln_f.bias[0]'s gradient becomes inf (step 2) or NaN (step 3). A gradient
                # hook, not a loss term: at stage 3 the root unit (ln_f) is freed after forward.
                bad_value = float("inf" if step == 1 else "nan")
                hook = model.ln_f.bias.register_hook(
                    lambda g: g + torch.zeros_like(g).index_fill_(
                        0, torch.tensor([0], device=g.device), bad_value))
            loss.backward()
            if hook is not None:
                hook.remove()
            error = None
            try:
                opt.step()
            except NonFiniteGradientError as exc:
                error = str(exc)
            opt.zero_grad()
            with opt.gathered():
                same = (all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
                        and all(torch.equal(a, t) for a, t in zip(
                            states, [t for b in opt.shard_update.states
                                     for t in (b.master, b.exp_avg, b.exp_avg_sq)])))
                finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
            bad = step in (1, 2)
            if not bad:
                assert error is None and not same, f"step {step + 1} must update"
                assert finite
                continue
            assert same, f"step {step + 1} (non-finite) changed something"
            if policy == "raise":
                assert error is not None and f"step {step + 1}:" in error, error
                named = world_mean(float("ln_f.bias" in error), ws) * ws
                assert named == 1.0, f"{named} ranks named the parameter: {error}"
        st = opt.stats()
        assert st["step"] == 5
        assert st["overflow_skips"] == 2, st
        warned = [m for m in records.messages if "inf/NaN" in m]
        if policy == "skip" and rank == 0:
            assert len(warned) == 2 and "step 2:" in warned[0] and "step 3:" in warned[1], \
                warned
        else:
            assert warned == [], warned
        assert all(b.step == 3 for b in opt.shard_update.states)
    finally:
        logging.getLogger("zkernels.zero").removeHandler(records)


def traffic_and_memory(rank, ws, *, stage, param_dtype):
    """Bytes sent per step (volume meter) and held per rank (allocated storages) against the
    ring formula and DESIGN.md's table. Exact against the padded layout; within 1% of the
    unpadded formula (padding is at most align*(tensors+N) elements per bucket)."""
    model = make_model()
    psi = sum(p.numel() for p in model.parameters())  # the tied weight once
    opt = zk.ZeroOptimizer(model, stage=stage, lr=LR, param_dtype=param_dtype,
                           bucket_bytes=2 ** 16)
    for batch in make_batches(2, ws * MICRO_BATCH):
        model(*chunk(batch, rank)).backward()
        opt.step()
        opt.zero_grad()
    st = opt.stats()
    pel = 2 if param_dtype is not None else 4
    rel = 4
    padded = sum(b.layout.padded_numel for b in opt.units)
    shard = sum(b.layout.shard_numel for b in opt.units)
    comm = st["comm_bytes"]
    assert comm["reduce_scatter"] == padded * rel * (ws - 1) // ws, comm
    assert comm["all_gather"] == padded * pel * (ws - 1) // ws, comm
    # One 4-byte all-reduce per step: the non-finite check (clip.py's Note), metered apart
    # from the 2 Psi, which counts reduce-scatter and all-gather only.
    flag = 2 * 4 * (ws - 1) // ws
    assert comm["all_reduce"] == flag, comm
    moved = comm["reduce_scatter"] + comm["all_gather"]
    assert comm["total"] == moved + flag
    ideal = psi * (rel + pel) * (ws - 1) / ws  # 2 Psi (N-1)/N in the two dtypes
    assert ws == 1 and moved == 0 or abs(moved - ideal) <= 0.01 * ideal, (comm, ideal)
    mem = st["memory_bytes"]
    biggest = max(b.layout.padded_numel for b in opt.units)
    pooled = stage == 2 or param_dtype is not None  # stage 1 casts through the pool
    expected = {"params": padded * pel,
                "grads": padded * pel if stage == 1 else shard * 4,
                "master": shard * 4 if param_dtype is not None else 0,
                "optimizer_states": shard * 8,
                "buffers": 2 * biggest * rel if pooled else 0}
    expected["total"] = sum(expected.values())
    assert mem == expected, (mem, expected)
    # DESIGN.md: fp32 stage 1 4+4+8/N, stage 2 4+12/N; bf16 stage 1 2+2+12/N, stage 2
    # 2+(4+12)/N (our grad shard is fp32, the reduce dtype), bucket buffers aside.
    if param_dtype is None:
        design = psi * (8 + 8 / ws) if stage == 1 else psi * (4 + 12 / ws)
    else:
        design = psi * (4 + 12 / ws) if stage == 1 else psi * (2 + 16 / ws)
    held = mem["total"] - mem["buffers"]
    assert abs(held - design) <= 0.01 * design, (held, design)
    return {"comm": comm, "memory": mem, "psi": psi}


def state_round_trip(rank, ws, *, stage, param_dtype):
    """Save after 3 steps, load into a fresh optimizer over a differently initialized model,
    continue: bit-identical to the uninterrupted run."""
    batches = make_batches(6, ws * MICRO_BATCH)

    def build(seed):
        m = make_model(seed)
        return m, zk.ZeroOptimizer(m, stage=stage, lr=LR, eps=EPS, weight_decay=WD,
                                   param_dtype=param_dtype, bucket_bytes=SMALL_BUCKET)

    def train(m, o, batch):
        m(*chunk(batch, rank)).backward()
        o.step()
        o.zero_grad()

    m1, o1 = build(0)
    for batch in batches[:3]:
        train(m1, o1, batch)
    buf = io.BytesIO()
    torch.save(o1.state_dict(), buf)
    trace = []
    for batch in batches[3:]:
        train(m1, o1, batch)
        trace.append([p.detach().clone() for p in m1.parameters()])
    m2, o2 = build(7)
    buf.seek(0)
    sd = torch.load(buf, weights_only=False)
    o2.load_state_dict(sd)
    for batch, expected in zip(batches[3:], trace):
        train(m2, o2, batch)
        assert all(torch.equal(a, p) for a, p in zip(expected, m2.parameters()))
    assert o2.stats()["step"] == 6
    sd["zero"]["world_size"] = ws + 1
    try:
        o2.load_state_dict(sd)
    except ValueError as exc:
        assert "world size" in str(exc)
    else:
        raise AssertionError("loading a state of another world size must fail")


CHECKS = {
    "fp32_stage1": partial(fp32_parity, stage=1),
    "fp32_stage2": partial(fp32_parity, stage=2),
    "groups_frozen_sched_stage1": partial(fp32_parity, stage=1, steps=6, groups=True,
                                          frozen=True, sched=True),
    "groups_frozen_sched_stage2": partial(fp32_parity, stage=2, steps=6, groups=True,
                                          frozen=True, sched=True),
    "clip_stage1": partial(fp32_parity, stage=1, steps=6, clip=0.05),
    "clip_stage2": partial(fp32_parity, stage=2, steps=6, clip=0.05),
    "accumulate_stage1": partial(fp32_parity, stage=1, steps=6, micro=2),
    "accumulate_stage2": partial(fp32_parity, stage=2, steps=6, micro=2),
    **{f"catches_{f}_stage{s}": partial(catches, fault=f, stage=s)
       for f in FAULTS for s in STAGES},
    "bf16_stage1": partial(bf16_parity, stage=1),
    "bf16_stage2": partial(bf16_parity, stage=2),
    "fp16_overflow_stage1": partial(fp16_overflow, stage=1),
    "fp16_overflow_stage2": partial(fp16_overflow, stage=2),
    **{f"nonfinite_{policy}_{name}_stage{s}": partial(nonfinite_policy, stage=s,
                                                       policy=policy, param_dtype=dt)
       for policy in ("skip", "raise") for name, dt in (("fp32", None), ("bf16", torch.bfloat16))
       for s in STAGES},
    "traffic_memory_fp32_stage1": partial(traffic_and_memory, stage=1, param_dtype=None),
    "traffic_memory_fp32_stage2": partial(traffic_and_memory, stage=2, param_dtype=None),
    "traffic_memory_bf16_stage1": partial(traffic_and_memory, stage=1,
                                          param_dtype=torch.bfloat16),
    "traffic_memory_bf16_stage2": partial(traffic_and_memory, stage=2,
                                          param_dtype=torch.bfloat16),
    "state_dict_fp32_stage1": partial(state_round_trip, stage=1, param_dtype=None),
    "state_dict_bf16_stage2": partial(state_round_trip, stage=2, param_dtype=torch.bfloat16),
}


def battery(rank, world_size):
    torch.manual_seed(0)
    return run_checks(CHECKS, rank, world_size)
