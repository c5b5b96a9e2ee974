"""Rank side of the long-run tests: 500 steps with flat memory and a constant hook count, and
50 models and optimizers built and dropped without leaking (module-level for spawned ranks).

[Note: measuring what a rank holds]
Bytes are counted from live storages: every tensor the garbage collector tracks (every
Python-visible tensor is one of its objects: parameters, gradients, the optimizer's flat
buffers, shards, moments, pooled reduce buffers, whatever a leak would keep), each distinct
storage counted once by its ``untyped_storage().nbytes()``. That is exact and machine-
independent, so "flat" can be asserted as equality, step after step. It is blind to memory
held only by C++ (an autograd graph kept alive through a C++ reference, a backend's
buffers), so the process's RSS (psutil) is checked too, against a tolerance: RSS moves with
the allocator's arenas and page reuse, never by exactly 0, but a leak of one gradient of
this model per step would add ``steps * params * 4`` bytes, far above it. ``stats()`` is not
used for either: it counts what the optimizer believes it holds, not what is alive.
"""
from __future__ import annotations

import gc
import time
import weakref

import psutil
import torch
import torch.nn as nn

import zkernels as zk
from tests.zero._harness import CFG, EPS, LR, MICRO_BATCH, make_model

SMALL_BUCKET = 3000  # several buckets per stage: many hooks and buffers that could leak


def live_storage_bytes() -> int:
    """Bytes of the distinct storages of every gc-tracked tensor (see the Note)."""
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        # type(), not isinstance(): the latter reads __class__, which warns on torch's
        # deprecated module proxies among the gc's objects.
        if not issubclass(type(obj), torch.Tensor) or obj.device.type == "meta":
            continue
        storage = obj.untyped_storage()
        key = (str(obj.device), storage.data_ptr(), storage.nbytes())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def settled_live_bytes(expected: int, tries: int = 20, pause_s: float = 0.05) -> int:
    """:func:`live_storage_bytes`, measured again for up to ``tries * pause_s`` seconds while
    it differs from ``expected``: a finished gloo collective's work object (and the tensors it
    references) is released by gloo's worker thread after ``wait()`` returns, so right after a
    step a few kB can still be alive for a moment (seen once in ~50 rounds on a loaded
    machine). A real leak stays and fails the caller's check."""
    live = live_storage_bytes()
    for _ in range(tries):
        if live == expected:
            break
        time.sleep(pause_s)
        live = live_storage_bytes()
    return live


def least_live_bytes(readings: int = 5, pause_s: float = 0.05) -> int:
    """The least of a few :func:`live_storage_bytes` readings, ``pause_s`` apart: a baseline
    free of the transient that :func:`settled_live_bytes` waits out (a transient only adds)."""
    least = live_storage_bytes()
    for _ in range(readings - 1):
        time.sleep(pause_s)
        least = min(least, live_storage_bytes())
    return least


_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                 "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
                 "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def count_hooks(model: nn.Module) -> int:
    """Hooks registered on the model's modules and parameters, and globally on modules."""
    n = 0
    for m in model.modules():
        n += sum(len(getattr(m, a, None) or {}) for a in _MODULE_HOOKS)
    for p in model.parameters():
        n += len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
        n += len(p._backward_hooks or {})
    mod = torch.nn.modules.module
    for name in dir(mod):
        if name.startswith("_global_") and name.endswith("hooks"):
            n += len(getattr(mod, name))
    return n


def _batch(step: int, rank: int, ws: int):
    g = torch.Generator().manual_seed(1000 + step)
    shape = (ws * MICRO_BATCH, CFG.block_size)
    x = torch.randint(0, CFG.vocab_size, shape, generator=g)
    y = torch.randint(0, CFG.vocab_size, shape, generator=g)
    lo = rank * MICRO_BATCH
    return x[lo:lo + MICRO_BATCH], y[lo:lo + MICRO_BATCH]


def long_run(rank, ws, stage, steps=500, every=50):
    """``steps`` steps; after step 1, every ``every`` steps, the live storage bytes and the
    hook count must equal step 1's, and RSS may not have grown by more than 8 MiB over
    step ``every``'s (warm-up: the allocator's arenas fill during the first steps)."""
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=stage, lr=LR, eps=EPS, weight_decay=0.1,
                           bucket_bytes=SMALL_BUCKET)
    proc = psutil.Process()
    params = sum(p.numel() for p in model.parameters())
    ref = None
    rss0 = None
    trace = []
    for step in range(steps):
        loss = model(*_batch(step, rank, ws))
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.item()
        del loss
        if step == 1 or (step + 1) % every == 0:
            # A reading can include a just-finished collective's tensors (a few bytes, see
            # settled_live_bytes): the reference is the least of a few readings (such
            # transients only add), later readings settle towards it.
            live = least_live_bytes() if ref is None else settled_live_bytes(ref[0])
            now = (live, count_hooks(model), proc.memory_info().rss)
            trace.append((step, *now))
            if ref is None:
                ref = now
            assert now[:2] == ref[:2], (f"stage {stage} step {step}: live bytes/hooks "
                                        f"{now[:2]} != step 1's {ref[:2]}")
            if step + 1 == every:
                rss0 = now[2]
            elif rss0 is not None:
                assert now[2] - rss0 < 8 * 2**20, f"RSS grew {now[2] - rss0} B by step {step}"
    assert value == value and value < 10, value  # finite, trained
    leak_per_step = params * 4 * (steps - every)  # what one leaked fp32 gradient a step adds
    return {"trace": trace, "rss_growth": trace[-1][3] - rss0, "leak_scale": leak_per_step}


def build_and_drop(rank, ws, stage, times=50):
    """Build ``times`` models and optimizers, train one step with each, drop the optimizer,
    then the model. Each drop frees at once (by reference counting: no cycle keeps buffers
    waiting for the garbage collector, no hook keeps the optimizer alive), the model has no
    hooks left once its optimizer is gone, live bytes after the 1st, 10th and last round
    equal those before the first, and RSS grows by less than 8 MiB over the last 40.

    A fresh model each round, not one model wrapped again and again: a stage-3 optimizer
    leaves its model sharded when dropped (the parameters' full storages are freed), so
    such a model is not one to build a second optimizer over."""
    proc = psutil.Process()
    baseline = least_live_bytes()
    rss = None
    for i in range(times):
        model = make_model()
        assert count_hooks(model) == 0
        opt = zk.ZeroOptimizer(model, stage=stage, lr=LR, eps=EPS, bucket_bytes=SMALL_BUCKET)
        assert count_hooks(model) > 0 or stage == 1
        model(*_batch(i, rank, ws)).backward()
        opt.step()
        opt.zero_grad()
        opt_ref, model_ref = weakref.ref(opt), weakref.ref(model)
        del opt
        assert opt_ref() is None, f"stage {stage}: the dropped optimizer is still referenced"
        hooks = count_hooks(model)
        assert hooks == 0, f"stage {stage}: {hooks} hooks left on the model"
        del model
        assert model_ref() is None, f"stage {stage}: the dropped model is still referenced"
        if i in (0, 9, times - 1):
            live = settled_live_bytes(baseline)
            assert live == baseline, (f"stage {stage} round {i}: {live - baseline} B still "
                                      f"live after the drop")
        if i == 9:
            rss = proc.memory_info().rss
    growth = proc.memory_info().rss - rss
    assert growth < 8 * 2**20, f"stage {stage}: RSS grew {growth} B over {times - 10} rounds"
    return {"live_bytes": baseline, "rss_growth": growth}
