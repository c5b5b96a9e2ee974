"""Stage 3 after backward, before ``step()``, at 2 gloo ranks: the reduce buffers are given back
at the end of backward ([Note: reduce buffers end with backward] in grad_reducers.py), so a
rank holds 16Ψ/N (fp32) as FSDP2 does, measured by ``stats()`` and by walking every tensor
alive in the process; the step's peak is what it was before the change (the pool's buffers of
the largest unit during backward, the gathered units beside them); ``estimate_memory`` agrees.
Backwards that leave a bucket pending at their end (an unused block, two backwards before one
step, ``no_sync`` micro-steps) reduce it there and train as stage 2 does (it reduces in
``step()``)."""
import time

import torch

import zkernels as zk
from tests._dist import run_ranks
from tests.zero._harness import EPS, LR, make_batches, make_model, variant
from zkernels.demo.model import GPT, GPTConfig
from zkernels.zero.stats import live_tensor_bytes

# The issue's model: a tiny GPT with an untied head, 1.86M parameters; its root unit (both
# embeddings and the head, 1.07M elements) is the largest unit, so two reduce buffers of it
# (8.1 MiB) held after backward were 57% over the formula (22.30 vs 14.18 MiB per rank).
ISSUE_CFG = GPTConfig(vocab_size=4096, block_size=128, n_layer=4, n_head=4, n_embd=128,
                      tie_weights=False)
REL = 0.02          # the issue's bar: FSDP2's 16Ψ/N + 2%
# Tensors alive beside the optimizer's that the walk cannot tell apart: the path check's
# pair, the loss and norm scalars, the batch (excluded by storage, but its slices are not).
WALK_SLACK = 64 * 1024
# [Note: gloo lets go of a collective's tensors a moment late]
# ``Work.wait()`` returns when gloo's worker thread marks the future complete; the thread drops
# its own reference to the work (and so to the reduce buffer it read) a moment later. Until it
# does, torch keeps the buffer's Python object alive for the C++ reference, and the walk sees
# it: CI's loaded 2 cores once caught rank 1 with one pool of buffers (8.1 MiB) still there at
# step 0. The walk is repeated, for up to WALK_SETTLE_S, until it is within the bar; a buffer
# the optimizer really held would stay and fail it.
WALK_SETTLE_S = 2.0


def _settled_walk(skip, bound):
    """The live-tensor walk, repeated until it is at most ``bound`` or WALK_SETTLE_S passed
    ([Note: gloo lets go of a collective's tensors a moment late])."""
    deadline = time.monotonic() + WALK_SETTLE_S
    walked = live_tensor_bytes(skip=skip)
    while walked > bound and time.monotonic() < deadline:
        time.sleep(0.02)
        walked = live_tensor_bytes(skip=skip)
    return walked


def _issue_model_after_backward(rank, world_size):
    """Three steps of the issue's model: after each backward the bytes held (stats() and the
    walk) and the buffers; after each step the peak."""
    torch.manual_seed(0)
    model = GPT(ISSUE_CFG)
    psi = sum(p.numel() for p in model.parameters())
    opt = zk.ZeroOptimizer(model, stage=3, lr=1e-3)
    gen = torch.Generator().manual_seed(1 + rank)
    out = []
    for step in range(3):
        x = torch.randint(ISSUE_CFG.vocab_size, (4, ISSUE_CFG.block_size), generator=gen)
        opt.backward(model(x, x))
        after = opt.stats()
        walked = _settled_walk((x,), after["memory_bytes"]["total"] + WALK_SLACK)
        held_buffers = len(opt.reducer.held_buffers())
        opt.step()
        st = opt.stats()
        opt.zero_grad()
        out.append(dict(after=after["memory_bytes"], walked=walked, held_buffers=held_buffers,
                        between=st["memory_bytes"], peak=st["step_peak_bytes"],
                        gathered_peak=st["gather"]["peak_gathered_bytes"]))
    rule = opt.policy.num_reduce_buffers(len(opt.units), len(opt.param_groups))
    largest = max(u.layout.padded_numel for u in opt.units)
    return dict(psi=psi, steps=out, rule=rule, largest=largest)


def test_stage3_after_backward_holds_16psi_over_n():
    results = run_ranks(_issue_model_after_backward, 2)
    n = 2
    for rank, r in enumerate(results):
        formula = 16 * r["psi"] / n
        # Before the change: the same peak buffers (the pool's rule, of the largest unit),
        # then held on until step()'s drain.
        old_buffers = r["rule"] * r["largest"] * 4
        assert old_buffers > REL * formula  # the bar could not hold with them
        est = zk.estimate_memory(GPT(ISSUE_CFG), n, 3)
        for step, s in enumerate(r["steps"]):
            where = f"rank {rank} step {step}: {s}, 16Ψ/N {formula}"
            after = s["after"]
            assert after["buffers"] == 0 and s["held_buffers"] == 0, where
            assert after["total"] <= (1 + REL) * formula, where
            assert s["walked"] <= (1 + REL) * formula, where
            assert after["total"] <= s["walked"] <= after["total"] + WALK_SLACK, where
            # After backward the rank holds what it holds between steps, and the estimate.
            assert after == s["between"], where
            assert abs(after["total"] - est.held_device_bytes) <= REL * est.held_device_bytes
            # The peak is no higher than before: the same buffers beside the gathered units.
            peak = s["peak"]
            assert peak["buffers"] == old_buffers, where
            assert peak["total"] == after["total"] + old_buffers + s["gathered_peak"], where
            assert peak["total"] <= (1 + REL) * est.device_bytes, (peak, est)


def _pending_at_end_of_backward(rank, world_size):
    """Each case trains at stage 2 (reduces in step()) and at stage 3 (reduces what backward
    left at its end); returns the largest parameter difference and stage 3's buffers held
    after the last backward of each step."""
    cases = {"unused_block": dict(order=(0,)), "two_backwards": dict(backwards=2),
             "no_sync": dict(micro=2)}
    out = {}
    for name, case in cases.items():
        params, held = {}, []
        for stage in (2, 3):
            model = variant(make_model(), case.get("order", (0, 1)))
            opt = zk.ZeroOptimizer(model, stage=stage, lr=LR, eps=EPS)
            for batch in make_batches(3, 4 * world_size, seed=7):
                x, y = batch[0][4 * rank:4 * rank + 4], batch[1][4 * rank:4 * rank + 4]
                for m in range(case.get("micro", 1)):
                    ctx = opt.no_sync() if m < case.get("micro", 1) - 1 else None
                    for _ in range(case.get("backwards", 1)):
                        if ctx is None:
                            model(x, y).backward()
                        else:
                            with ctx:
                                model(x, y).backward()
                if stage == 3:
                    held.append(opt.stats()["memory_bytes"]["buffers"])
                opt.step()
                opt.zero_grad()
            with opt.gathered():
                params[stage] = [p.detach().clone() for p in model.parameters()]
        diff = max((a - b).abs().max().item() for a, b in zip(params[2], params[3]))
        out[name] = (diff, held)
    return out


def test_backward_that_leaves_buckets_pending_reduces_them_at_its_end():
    for rank, r in enumerate(run_ranks(_pending_at_end_of_backward, 2)):
        for name, (diff, held) in r.items():
            assert held == [0, 0, 0], (rank, name, held)
            assert diff <= 1e-6, (rank, name, diff)
