"""Single-process behaviour (world size 1, no process group): lifecycle and torch
semantics that do not need several ranks."""
import gc

import pytest
import torch

import zkernels as zk
from tests.conftest import tol
from tests.zero._harness import EPS, LR, MICRO_BATCH, chunk, make_batches, make_model


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _run(stage, steps, between=None, **kw):
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=stage, lr=LR, eps=EPS, weight_decay=0.1,
                           bucket_bytes=3000, **kw)
    for batch in make_batches(steps, MICRO_BATCH):
        loss = model(*chunk(batch, 0))
        opt.backward(loss)
        opt.step()
        (between or (lambda m, o: o.zero_grad()))(model, opt)
    return model, opt


def test_stage1_survives_model_zero_grad():
    """model.zero_grad() (set_to_none) breaks the grad views; the next step must copy the new
    gradients in and restore the views: same result as opt.zero_grad()."""
    ref, _ = _run(1, 3)
    model, opt = _run(1, 3, between=lambda m, o: m.zero_grad(set_to_none=True))
    assert all(torch.equal(a, b) for a, b in zip(_params(ref), _params(model)))
    assert all(p.grad is None for p in model.parameters())
    opt.zero_grad()  # views again, zeroed
    for b, g in zip(opt.units, opt.reducer.grads):
        lo, hi = g.data_ptr(), g.data_ptr() + g.numel() * g.element_size()
        assert all(lo <= p.grad.data_ptr() < hi and not p.grad.any() for p in b.params)


def test_two_backwards_accumulate_like_torch():
    """Without zero_grad and without no_sync, gradients add (stage 2 adds reduced shards)."""
    batch = make_batches(1, 2 * MICRO_BATCH)[0]
    results = []
    for stage, twice in ((1, True), (2, True), (2, False)):
        torch.manual_seed(0)
        model = make_model()
        opt = zk.ZeroOptimizer(model, stage=stage, lr=LR, eps=EPS, bucket_bytes=3000)
        if twice:
            model(*chunk(batch, 0)).backward()
            model(*chunk(batch, 1)).backward()
        else:
            (model(*chunk(batch, 0)) + model(*chunk(batch, 1))).backward()
        opt.step()
        results.append(_params(model))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, **tol(torch.float32))


def test_closure_and_zero_grad_semantics():
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=2, lr=LR)
    batch = make_batches(1, MICRO_BATCH)[0]

    def closure():
        opt.zero_grad()
        loss = model(*chunk(batch, 0))
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.ndim == 0 and opt.stats()["step"] == 1
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_stage2_hooks_go_away_with_the_optimizer():
    model = make_model()
    opt = zk.ZeroOptimizer(model, stage=2)
    assert all(len(p._post_accumulate_grad_hooks) == 1 for p in model.parameters())
    del opt
    gc.collect()
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    model(*chunk(make_batches(1, MICRO_BATCH)[0], 0)).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_buckets_follow_backward_order_and_never_mix_groups():
    model = make_model()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    plain = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    opt = zk.ZeroOptimizer(model, stage=2, bucket_bytes=600,
                           param_groups=[{"params": decay}, {"params": plain,
                                                             "weight_decay": 0.0}])
    for b in opt.units:
        assert len({0 if any(p is q for q in decay) else 1 for p in b.params}) == 1
    assert len(opt.reducer.held_buffers()) == 3  # 2 + one open bucket per extra group
    # Weights and biases interleave in backward; buckets are planned in that order, so a
    # backward fills and launches them without ever needing a fourth buffer.
    model(*chunk(make_batches(1, MICRO_BATCH)[0], 0)).backward()
    assert all(p.grad is None for p in model.parameters())
    assert len(opt.reducer.held_buffers()) == 3


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_grad_set_to_none_as_torch_documents(stage):
    """zero_grad(set_to_none=False) zeroes a full gradient still held (a no_sync micro-step)
    instead of dropping it, as torch's does; the default drops it (stages 2-3; stage 1's
    gradients are views of its flat buffers and are zeroed either way). Either way the
    accumulated micro-step is forgotten: the next step equals a run without it."""
    torch.set_num_threads(1)
    first, second = make_batches(2, MICRO_BATCH)

    def run(clear):
        model = make_model()
        opt = zk.ZeroOptimizer(model, stage=stage, lr=LR, eps=EPS)
        if clear is not None:
            with opt.no_sync():
                model(*chunk(first, 0)).backward()
            clear(opt)
            grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        else:
            grads = None
        model(*chunk(second, 0)).backward()
        opt.step()
        with opt.gathered():
            return grads, [p.detach().clone() for p in model.parameters()]

    _, expected = run(None)
    kept, after_zeros = run(lambda o: o.zero_grad(set_to_none=False))
    dropped, after_none = run(lambda o: o.zero_grad())
    assert all(g is not None and not g.any() for g in kept), "set_to_none=False keeps zeros"
    if stage == 1:
        assert all(g is not None and not g.any() for g in dropped)
    else:
        assert all(g is None for g in dropped), "set_to_none=True drops the held gradients"
    for got in (after_zeros, after_none):
        assert all(torch.equal(a, b) for a, b in zip(expected, got))
    with pytest.raises(TypeError, match="set_to_none"):
        zk.ZeroOptimizer(make_model(), stage=stage, lr=LR).zero_grad(set_to_none="no")
