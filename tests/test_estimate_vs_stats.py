"""``estimate_memory`` against what ``ZeroOptimizer.stats()`` measures on real runs (gloo ranks
at world sizes 1, 2 and 4; stages 1 and 2; fp32, bf16 with fp32 reduction, bf16 throughout,
and two param groups),
and ``stage="auto"`` through the optimizer's constructor."""
import logging

import pytest
import torch

from tests._dist import run_ranks
from zkernels import ZeroOptimizer, estimate_memory
from zkernels.demo.model import GPT, GPTConfig
from zkernels.zero.planning.ladder import NoRungFitsError

# Awkward sizes (odd width, 3 heads) so that shards cut through tensors.
CFG = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=3, n_embd=57)
BUCKET_BYTES = 48 * 1024
KINDS = ("params", "grads", "master", "optimizer_states", "buffers")
RECIPES = [(None, None), (torch.bfloat16, None), (torch.bfloat16, torch.bfloat16)]
# [Note: estimate tolerance]
# The estimate ignores padding (each tensor starts 16-byte aligned, each bucket rounds up to a
# multiple of N·align elements): well under 2% of each kind here. Buffers are two largest
# buckets, which the estimate takes as bucket_bytes each; the greedy bucketing closes a bucket
# when the next tensor does not fit, so a real bucket may fall short by up to one tensor.
REL = 0.02


def _groups(model):
    """The usual two groups: weight decay on matrices, none on biases, norms, embeddings."""
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and "wte" not in n
             and "wpe" not in n]
    ids = {id(p) for p in decay}
    return [{"params": decay, "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if id(p) not in ids],
             "weight_decay": 0.0}]


def _train(stage, param_dtype, reduce_dtype, grouped=False, steps=1, bucket_bytes=BUCKET_BYTES):
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = ZeroOptimizer(model, stage=stage, lr=1e-3, param_dtype=param_dtype,
                        reduce_dtype=reduce_dtype, bucket_bytes=bucket_bytes,
                        param_groups=_groups(model) if grouped else None)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(256, (2, CFG.block_size), generator=gen)
        opt.backward(model(x, x))
        opt.step()
    return model, opt.stats()


def _measure_all(rank, world_size):
    out = []
    for stage in (1, 2):
        for pdt, rdt in RECIPES:
            model, stats = _train(stage, pdt, rdt)
            out.append((stage, pdt, rdt, 1, BUCKET_BYTES, stats))
        _, stats = _train(stage, None, None, grouped=True)
        out.append((stage, None, None, 2, BUCKET_BYTES, stats))
        for pdt, rdt in RECIPES[:2]:    # buckets sized from the model (the default)
            _, stats = _train(stage, pdt, rdt, bucket_bytes=None)
            out.append((stage, pdt, rdt, 1, None, stats))
    return out


@pytest.mark.parametrize("world_size", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_estimate_matches_stats(world_size):
    results = run_ranks(_measure_all, world_size)[0]
    model = GPT(CFG)    # fp32 module: the estimate counts its parameters and largest tensor
    for stage, pdt, rdt, num_groups, bucket_bytes, stats in results:
        est = estimate_memory(model, world_size, stage, param_dtype=pdt, reduce_dtype=rdt,
                              bucket_bytes=bucket_bytes, num_param_groups=num_groups)
        mem = stats["memory_bytes"]
        expected = dict(params=est.params_bytes, grads=est.grads_bytes,
                        master=est.master_bytes, optimizer_states=est.optimizer_states_bytes,
                        buffers=est.buffers_bytes)
        where = f"stage {stage}, {pdt}/{rdt}, {num_groups} groups, buckets {bucket_bytes}, " \
                f"N={world_size}: measured " \
                f"{mem}, estimated {expected}"
        largest = max(p.numel() for p in model.parameters())
        short = 2 * (rdt or torch.float32).itemsize * largest
        assert expected["buffers"] - short <= mem["buffers"] <= (1 + REL) * expected["buffers"]
        for kind in KINDS[:4]:
            if expected[kind] == 0:
                assert mem[kind] == 0, where
            else:
                assert abs(mem[kind] - expected[kind]) <= REL * expected[kind], (kind, where)
        assert abs(mem["total"] - est.held_device_bytes) <= REL * est.held_device_bytes, where
        comm = stats["comm_bytes"]
        moved = comm["reduce_scatter"] + comm["all_gather"]
        assert abs(moved - est.comm_bytes) <= REL * est.comm_bytes, (comm, est.comm_bytes)


# Twelve blocks: at 2 ranks stage 3 saves half the parameters (2Ψ bytes) but gathers the root
# and two blocks and reduces one block at a time (buffers of a block each), so it needs less
# than stage 2 only once the model is many blocks deep (at six blocks it needs more).
DEEP = GPTConfig(vocab_size=256, block_size=16, n_layer=12, n_head=3, n_embd=57)


def _auto_rank(rank, world_size, budgets):
    """The stage auto takes for each budget, or the error it raises (one spawn for all)."""
    out = []
    for budget in budgets:
        torch.manual_seed(0)
        try:
            opt = ZeroOptimizer(GPT(DEEP), stage="auto", memory_budget_bytes=budget,
                                bucket_bytes=BUCKET_BYTES)
        except NoRungFitsError as exc:
            out.append(f"{type(exc).__name__}: {exc}")
        else:
            out.append(opt.stage)
    return out


@pytest.mark.slow  # stage='auto' on ranks; test_auto covers the choice in one process
def test_optimizer_auto_on_ranks():
    model = GPT(DEEP)
    e1, e2, e3 = (estimate_memory(model, 2, s, bucket_bytes=BUCKET_BYTES) for s in (1, 2, 3))
    assert e3.device_bytes < e2.device_bytes < e1.device_bytes
    # Budgets made to fit each rung exactly (a user's budget has no headroom).
    results = run_ranks(_auto_rank, 2, [e1.device_bytes, e2.device_bytes, e3.device_bytes,
                                        1000])
    assert results[0] == results[1]         # every rank takes the same decision
    one, two, three, nothing = results[0]
    assert (one, two, three) == (1, 2, 3)
    assert nothing.startswith("NoRungFitsError") and "no rung of the ladder fits" in nothing


def test_optimizer_auto_logs_and_checks(caplog):
    model = GPT(DEEP)
    budget = estimate_memory(model, 1, 2, bucket_bytes=BUCKET_BYTES).device_bytes
    with caplog.at_level(logging.INFO, logger="zkernels.zero"):
        opt = ZeroOptimizer(model, stage="auto", bucket_bytes=BUCKET_BYTES,
                            memory_budget_bytes=budget)
    assert opt.stage == 2 and "chose stage 2" in caplog.text
    assert "lower rungs need stage 1" in caplog.text
    with pytest.raises(ValueError, match="memory_budget_bytes applies only"):
        ZeroOptimizer(GPT(DEEP), stage=2, memory_budget_bytes=10**9)
