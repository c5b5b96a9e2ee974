"""Stage 3's checks, run on every rank (module-level so spawned ranks can import them).

``battery(rank, world_size)`` runs every check once and reports per check (one spawn per
world size). Parameters are read inside ``opt.gathered()``: between uses a stage-3 parameter
has no storage.
"""
from __future__ import annotations

import contextlib
import io
from functools import partial

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import zkernels as zk
from tests.conftest import tol
from tests.zero._harness import (EPS, LR, MICRO_BATCH, assert_params_close, assert_step_close,
                                 chunk, clone_model,
                                 make_batches, make_model, reference_grads, run_checks,
                                 split_groups, world_mean)
from zkernels.demo.model import GPT

BETAS = (0.9, 0.95)
WD = 0.1


class VariantGPT(GPT):
    """The harness GPT with another block sequence (``order``: a block may run twice) and
    optional activation checkpointing of each block (``ckpt``: None, "reentrant",
    "non_reentrant")."""

    order = (0, 1)
    ckpt = None

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for i in self.order:
            blk = self.blocks[i]
            if self.ckpt is None:
                x = blk(x)
            else:
                x = checkpoint(blk, x, use_reentrant=self.ckpt == "reentrant")
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))


def variant(model, order=(0, 1), ckpt=None):
    model.__class__ = VariantGPT
    model.order, model.ckpt = tuple(order), ckpt
    return model


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def fp32_parity(rank, ws, *, reshard=True, steps=10, micro=1, clip=None, groups=False,
                frozen=False, order=(0, 1), ckpt=None):
    """Stage 3 on N ranks == torch.optim.AdamW on one process with the whole batch: loss and
    every parameter each step to fp32 round-off (tol(float32), [Note: eps in the parity
    tests]), the reference's gradient computed micro-batch by micro-batch as the ranks do (the
    rank battery's oracle, [Note: same-order reference] in _harness.py: a whole-batch
    reference calls BLAS on other shapes, whose round-off differs between AVX2 and AVX-512
    kernels and, amplified by Adam near eps, failed block_called_twice at 4 ranks on an
    AVX2-only CPU); reduce-scatters overlap backward; the gathered units are freed after each
    step."""
    model = variant(make_model(), order, ckpt)
    if frozen:
        model.wpe.weight.requires_grad_(False)
        model.blocks[0].ln_1.requires_grad_(False)
    ref = clone_model(model)
    opt = zk.ZeroOptimizer(model, stage=3, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                           param_groups=split_groups(model, WD) if groups else None,
                           max_grad_norm=clip, reshard_after_forward=reshard)
    ropt = torch.optim.AdamW(split_groups(ref, WD) if groups else _trainable(ref), lr=LR,
                             betas=BETAS, eps=EPS, weight_decay=WD)
    assert model.head.weight is model.wte.weight, "tied weights must stay one parameter"
    names = [u.name for u in opt.schedule.units]
    assert names == ["blocks.0", "blocks.1", "<root>"], names
    if groups:  # one flat unit per (unit, group)
        assert [sum(not f.frozen for f in u.flats) for u in opt.schedule.units] == [2, 2, 2]
    if frozen:
        assert all(p is not model.wpe.weight for u in opt.units for p in u.params)
    mid_backward = []

    def watch(module, inputs, out):
        out.register_hook(
            lambda g: mid_backward.append(opt.meter.current_step()["reduce_scatter"]))

    model.wte.register_forward_hook(watch)
    clipped = 0
    for step, batch in enumerate(make_batches(steps, ws * micro * MICRO_BATCH)):
        local = 0.0
        for m in range(micro):
            last = m == micro - 1
            with (contextlib.nullcontext() if last else opt.no_sync()):
                loss = model(*chunk(batch, rank * micro + m)) / micro
                loss.backward()
            local += loss.item()
            assert opt.schedule.live_bytes() == 0, "backward must free every unit"
            if not last:
                assert opt.meter.current_step()["reduce_scatter"] == 0, \
                    "no_sync must not reduce"
        assert all(p.grad is None for p in _trainable(model)), "stage 3 frees full grads"
        sent = opt.meter.current_step()["reduce_scatter"]
        assert ws == 1 or 0 < mid_backward[-1] < sent, "stage 3 reduces during backward"
        opt.step()
        opt.zero_grad()
        rlosses = reference_grads(ref, batch, ws, micro)
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(_trainable(ref), clip)
            clipped += int(norm > clip)
        ropt.step()
        ropt.zero_grad()
        torch.testing.assert_close(world_mean(local, ws), sum(rlosses) / ws,
                                   **tol(torch.float32), msg=lambda m: f"step {step} loss: {m}")
        with opt.gathered():
            assert_step_close(model, ref, step, **tol(torch.float32))
        assert opt.schedule.live_bytes() == 0
    if clip is not None:
        assert clipped == steps, f"clipping was active on {clipped}/{steps} steps"
    assert opt.stats()["step"] == steps


def bf16_parity(rank, ws, *, reshard=True, steps=10):
    """param_dtype=bf16 == the same-recipe single-process reference (as _rank_checks'
    bf16_parity: bf16 per-rank gradients, times 1/N in fp32, summed in fp32, AdamW on fp32
    masters, masters rounded to bf16); same tolerances."""
    model = make_model()
    master = clone_model(model)
    compute = clone_model(model).to(torch.bfloat16)
    opt = zk.ZeroOptimizer(model, stage=3, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                           param_dtype=torch.bfloat16, ops_backend="reference",
                           reshard_after_forward=reshard)
    ropt = torch.optim.AdamW(master.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    by_id = {id(p): q for p, q in zip(model.parameters(), master.parameters())}
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
        with opt.gathered():
            assert_params_close(model, compute, step, **tol(torch.bfloat16))
        for u, st in zip(opt.units, opt.shard_update.states):
            flat = zk.ops.flatten([by_id[id(p)].detach() for p in u.params],
                                  offsets=u.layout.offsets,
                                  out=torch.zeros(u.layout.padded_numel))
            torch.testing.assert_close(st.master, flat[u.shard_slice], rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"step {step} master: {m}")


def traffic_and_memory(rank, ws, *, reshard, param_dtype=None):
    """Per step: all-gathers 2Ψ(N-1)/N (1Ψ without resharding) + reduce-scatter Ψ(N-1)/N,
    exact against the padded layout and within 1% of the unpadded 3Ψ (2Ψ); one all-gather per
    flat unit per direction; params held between steps = this rank's shards (about Ψ/N,
    nothing gathered); every kind exact against the layout, the total within 2% of DESIGN.md's
    16Ψ/N (fp32) beside the reduce buffers; peak gathered bytes under the prefetch bound."""
    model = make_model()
    psi = sum(p.numel() for p in model.parameters())  # the tied weight once
    opt = zk.ZeroOptimizer(model, stage=3, lr=LR, param_dtype=param_dtype,
                           reshard_after_forward=reshard)
    for batch in make_batches(3, ws * MICRO_BATCH):
        model(*chunk(batch, rank)).backward()
        opt.step()
        opt.zero_grad()
    st = opt.stats()
    pel = 2 if param_dtype is not None else 4
    rel = 4
    padded = sum(u.layout.padded_numel for u in opt.units)
    shard = sum(u.layout.shard_numel for u in opt.units)
    comm = st["comm_bytes"]
    gathers = 2 if reshard else 1
    assert comm["reduce_scatter"] == padded * rel * (ws - 1) // ws, comm
    assert comm["all_gather"] == gathers * padded * pel * (ws - 1) // ws, comm
    # [Note: divergent paths]: one check per gather, and one as step() begins
    checks = (gathers * len(opt.units) + 1) if ws > 1 else 0
    # The path checks (16 bytes each) plus the 4-byte gradient-norm all-reduce every step
    # (clip.py's Note: it carries the non-finite flag), ring-metered as 2(N-1)/N.
    assert comm["all_reduce"] == (checks * 16 + 4) * 2 * (ws - 1) // ws, comm
    ideal = psi * (rel + gathers * pel) * (ws - 1) / ws
    assert ws == 1 and comm["total"] == 0 or abs(comm["total"] - ideal) <= 0.01 * ideal, \
        (comm, ideal)
    g = st["gather"]
    assert g["all_gathers"] == gathers * len(opt.units), g
    assert g["gathered_bytes"] == 0, g
    biggest = max(u.nbytes for u in opt.schedule.units[:-1])
    assert g["limit_bytes"] == opt.schedule.root.nbytes + 2 * biggest
    if reshard:
        assert 0 < g["peak_gathered_bytes"] <= g["limit_bytes"], g
    else:
        assert g["peak_gathered_bytes"] == padded * pel, g
    mem = st["memory_bytes"]
    # Between steps: the shards and nothing else (the reduce buffers live only while
    # gradients are in flight: [Note: transient reduce buffers]).
    expected = {"params": shard * pel, "grads": shard * 4,
                "master": shard * 4 if param_dtype is not None else 0,
                "optimizer_states": shard * 8, "buffers": 0}
    expected["total"] = sum(expected.values())
    assert mem == expected, (mem, expected)
    assert opt.reducer.held_buffers() == []
    design = psi * (16 if param_dtype is None else 18) / ws  # bf16: 2 + 4 (grad fp32) + 12
    assert abs(mem["total"] - design) <= 0.02 * design, (mem["total"], design)
    # The step's peak: the two unit-sized reduce buffers and the gathered units beside it.
    peak = st["step_peak_bytes"]
    buffers = 2 * max(u.layout.padded_numel for u in opt.units) * rel
    assert peak == {"buffers": buffers, "gathered_params": g["peak_gathered_bytes"],
                    "total": mem["total"] + buffers + g["peak_gathered_bytes"]}, peak
    return {"comm": comm, "memory": mem, "psi": psi, "gather": g}


def no_grad_loops(rank, ws):
    """100 forwards under torch.no_grad() (eval), a generation loop, then opt.gathered() and
    opt.gathered(one block): bytes held unchanged, nothing left gathered; train()/eval()
    switches; gathered() gathers exactly the units holding the module's parameters and a
    forward inside gathers nothing again."""
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=3, lr=LR, eps=EPS)
    batches = make_batches(2, ws * MICRO_BATCH)
    model(*chunk(batches[0], rank)).backward()
    opt.step()
    opt.zero_grad()
    held = opt.stats()["memory_bytes"]
    model.eval()
    x, y = chunk(batches[1], rank)
    with torch.no_grad():
        losses = [model(x, y).item() for _ in range(100)]
        idx = x[:, :4]
        for _ in range(6):  # greedy generation, one token at a time
            nxt = model(idx)[:, -1].argmax(-1, keepdim=True)
            idx = torch.cat([idx, nxt], dim=1)
    assert len(set(losses)) == 1, "eval forwards must be deterministic"
    assert opt.schedule.live_bytes() == 0 and opt.stats()["memory_bytes"] == held
    with opt.gathered():
        assert all(u.allocated for u in opt.schedule.units if u.flats)
        before = opt.meter.current_step()["all_gather"]
        with torch.no_grad():
            again = model(x, y).item()
        assert opt.meter.current_step()["all_gather"] == before, "gathered: no new gathers"
        assert again == losses[0]
    assert opt.schedule.live_bytes() == 0 and opt.stats()["memory_bytes"] == held
    with opt.gathered(model.blocks[1].attn):
        assert [u.allocated for u in opt.schedule.units] == [False, True, False]
        assert model.blocks[1].attn.weight.untyped_storage().nbytes() > 0
    assert opt.schedule.live_bytes() == 0
    model.train()
    loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    assert opt.schedule.live_bytes() == 0 and opt.stats()["memory_bytes"] == held
    try:
        with opt.gathered(torch.nn.Linear(2, 2)):
            pass
    except ValueError as exc:
        assert "not a submodule" in str(exc)
    else:
        raise AssertionError("gathered() of a foreign module must fail")


def fp16_overflow(rank, ws):
    """fp16 at stage 3: an inf gradient on the last rank only makes every rank skip the step
    (parameters and master shards bit-identical), the scale halves, stats counts the skip."""
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=3, lr=LR, eps=EPS, param_dtype=torch.float16,
                           loss_scale=zk.zero.LossScaleConfig(init_scale=2.0 ** 10,
                                                              growth_interval=2))
    scales = [2.0 ** 10, 2.0 ** 9, 2.0 ** 9, 2.0 ** 10]
    for step, batch in enumerate(make_batches(4, ws * MICRO_BATCH)):
        loss = model(*chunk(batch, rank))
        if step == 1:  # gathered() is collective: every rank enters, only the last adds inf
            with opt.gathered(model.ln_f):
                loss = loss + model.ln_f.bias[0] * (float("inf") if rank == ws - 1 else 0.0)
        with opt.gathered():
            before = [p.detach().clone() for p in model.parameters()]
        masters = [st.master.clone() for st in opt.shard_update.states]
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        with opt.gathered():
            same = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        same_master = all(torch.equal(a, st.master)
                          for a, st in zip(masters, opt.shard_update.states))
        st = opt.stats()
        assert st["loss_scale"] == scales[step], (step, st["loss_scale"])
        assert st["overflow_skips"] == (0 if step == 0 else 1)
        assert (same and same_master) == (step == 1), (step, same, same_master)


def state_round_trip(rank, ws, *, param_dtype=None):
    """Save after 3 steps, load into a fresh stage-3 optimizer over a differently initialized
    model, continue: bit-identical to the uninterrupted run."""
    batches = make_batches(6, ws * MICRO_BATCH)

    def build(seed):
        m = make_model(seed)
        return m, zk.ZeroOptimizer(m, stage=3, lr=LR, eps=EPS, weight_decay=WD,
                                   param_dtype=param_dtype)

    def train(m, o, batch):
        m(*chunk(batch, rank)).backward()
        o.step()
        o.zero_grad()

    def snapshot(m, o):
        with o.gathered():
            return [p.detach().clone() for p in m.parameters()]

    m1, o1 = build(0)
    for batch in batches[:3]:
        train(m1, o1, batch)
    buf = io.BytesIO()
    torch.save(o1.state_dict(), buf)
    trace = []
    for batch in batches[3:]:
        train(m1, o1, batch)
        trace.append(snapshot(m1, o1))
    m2, o2 = build(7)
    buf.seek(0)
    o2.load_state_dict(torch.load(buf, weights_only=False))
    for batch, expected in zip(batches[3:], trace):
        train(m2, o2, batch)
        assert all(torch.equal(a, p) for a, p in zip(expected, snapshot(m2, o2)))


CHECKS = {
    "fp32_reshard": partial(fp32_parity, reshard=True),
    "fp32_keep": partial(fp32_parity, reshard=False),
    "groups_frozen": partial(fp32_parity, steps=5, groups=True, frozen=True),
    "accumulate_clip": partial(fp32_parity, steps=5, micro=2, clip=0.05),
    "block_called_twice": partial(fp32_parity, steps=5, order=(0, 1, 0)),
    "checkpoint_non_reentrant": partial(fp32_parity, steps=5, ckpt="non_reentrant"),
    "checkpoint_reentrant": partial(fp32_parity, steps=5, ckpt="reentrant"),
    "checkpoint_reentrant_keep": partial(fp32_parity, steps=5, ckpt="reentrant",
                                         reshard=False),
    "fp16_overflow": fp16_overflow,
    "bf16_reshard": partial(bf16_parity, reshard=True),
    "bf16_keep": partial(bf16_parity, reshard=False, steps=5),
    "traffic_memory_fp32": partial(traffic_and_memory, reshard=True),
    "traffic_memory_fp32_keep": partial(traffic_and_memory, reshard=False),
    "traffic_memory_bf16": partial(traffic_and_memory, reshard=True,
                                   param_dtype=torch.bfloat16),
    "no_grad_loops_gathered": no_grad_loops,
    "state_dict_bf16": partial(state_round_trip, param_dtype=torch.bfloat16),
}


def battery(rank, world_size):
    torch.manual_seed(0)
    return run_checks(CHECKS, rank, world_size)


def divergent_path(rank, world_size, mode):
    """``mode="skip"``: rank 1 skips block 1; ``"stop"``: rank 1 runs nothing at all. Every
    rank that runs must fail (not hang, not exchange wrong shards) with an error naming a
    unit."""
    model = variant(make_model(), (0, 1) if rank == 0 or mode == "stop" else (0,))
    opt = zk.ZeroOptimizer(model, stage=3, lr=LR)
    if mode == "stop" and rank == 1:
        return "stopped"
    try:
        for batch in make_batches(2, world_size * MICRO_BATCH):
            model(*chunk(batch, rank)).backward()
            opt.step()
    except RuntimeError as exc:
        return str(exc)
    return None
