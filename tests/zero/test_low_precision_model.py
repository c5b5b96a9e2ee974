"""A bf16 / fp16 model (as ``from_pretrained(..., torch_dtype=torch.bfloat16)`` gives) goes into
ZeroOptimizer as it is: ``param_dtype=None`` means the model's dtype and each unit's fp32 master
is its widened values ([Note: low-precision models] in ``zkernels/zero/parameters/groups.py``).

Widening bf16 to fp32 is exact, so the bf16 model must train bit for bit as the same weights
loaded as fp32 (``model.float()``) with ``param_dtype=torch.bfloat16``: same losses, same
parameters, same fp32 masters, same memory, step for step."""
import contextlib

import pytest
import torch
import torch.nn as nn

from tests._dist import run_ranks
from tests.zero._harness import CFG, make_model
from zkernels import ZeroOptimizer, estimate_memory

STEPS = 3
ROWS = [(1, None), (2, None), (3, None), (2, "cpu")]
# estimate against stats() (see [Note: estimate tolerance] in tests/test_estimate_vs_stats.py)
REL = 0.02


def _gathered(opt):
    return opt.gathered() if opt.stage == 3 else contextlib.nullcontext()


def _snapshot(model, opt):
    with _gathered(opt):
        return [p.detach().clone() for p in model.parameters()]


def _masters(opt):
    return [s.master.detach().clone() for s in opt.shard_update.states]


def _pair(stage, offload, dtype):
    """The low-precision model with param_dtype=None, and its fp32 copy with param_dtype."""
    low = make_model().to(dtype)
    wide = make_model().to(dtype).float()
    kw = dict(stage=stage, offload=offload, lr=1e-2)
    return (low, ZeroOptimizer(low, **kw)), (wide, ZeroOptimizer(wide, param_dtype=dtype, **kw))


def _compare(rank, world_size, stage, offload, dtype=torch.bfloat16):
    """Everything that must be bit-identical between the two runs, as a list of
    ``(what, equal)``, plus the low model's stats and parameter count."""
    (low, lo_opt), (wide, wi_opt) = _pair(stage, offload, dtype)
    out = [("param_dtype", lo_opt.param_dtype == dtype == wi_opt.param_dtype),
           ("initial masters", all(torch.equal(a, b) for a, b in
                                   zip(_masters(lo_opt), _masters(wi_opt))))]
    gen = torch.Generator().manual_seed(1 + rank)
    for step in range(STEPS):
        x = torch.randint(CFG.vocab_size, (2, CFG.block_size), generator=gen)
        losses = []
        for model, opt in ((low, lo_opt), (wide, wi_opt)):
            loss = model(x, x)
            opt.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach().float())
        out.append((f"step {step} loss", torch.equal(*losses)))
        a, b = _snapshot(low, lo_opt), _snapshot(wide, wi_opt)
        out.append((f"step {step} params dtype", all(p.dtype == dtype for p in a + b)))
        out.append((f"step {step} params", all(torch.equal(p, q) for p, q in zip(a, b))))
        out.append((f"step {step} masters", all(torch.equal(p, q) for p, q in
                                                zip(_masters(lo_opt), _masters(wi_opt)))))
    s_lo, s_wi = lo_opt.stats(), wi_opt.stats()
    out.append(("memory", s_lo["memory_bytes"] == s_wi["memory_bytes"]))
    out.append(("loss scale", s_lo["loss_scale"] == s_wi["loss_scale"]))
    n = sum(p.numel() for p in make_model().parameters())   # stage 3 frees low's parameters
    for opt in (lo_opt, wi_opt):
        opt.close()
    return out, s_lo, n


def _check(results, stage, offload, world_size, dtype=torch.bfloat16):
    out, stats, n = results
    failed = [what for what, ok in out if not ok]
    assert not failed, f"stage {stage}, offload {offload}, N={world_size}: differ in {failed}"
    # fp32 masters, 4 B/param sharded over the ranks (padding aside)
    master = stats["memory_bytes"]["master"]
    assert abs(master - 4 * n / world_size) <= REL * 4 * n / world_size, (master, n)
    assert stats["loss_scale"] is None if dtype == torch.bfloat16 else \
        stats["loss_scale"] is not None
    est = estimate_memory(make_model().to(dtype), world_size, stage, offload=offload)
    assert est == estimate_memory(make_model(), world_size, stage, offload=offload,
                                  param_dtype=dtype)
    assert abs(est.master_bytes - master) <= REL * est.master_bytes, (est.master_bytes, master)
    for kind in ("params", "master", "optimizer_states"):
        measured = stats["memory_bytes"][kind]
        expected = getattr(est, f"{kind}_bytes")
        assert abs(measured - expected) <= REL * expected, (kind, measured, expected)


@pytest.mark.parametrize("stage,offload", ROWS)
def test_bf16_model_matches_fp32_with_param_dtype_one_rank(stage, offload):
    _check(_compare(0, 1, stage, offload), stage, offload, 1)


def _ranks(rank, world_size):
    return [_compare(rank, world_size, s, o) for s, o in ROWS]


def test_bf16_model_matches_fp32_with_param_dtype_two_ranks():
    for rank_results in run_ranks(_ranks, 2):
        for (stage, offload), results in zip(ROWS, rank_results):
            _check(results, stage, offload, 2)


def test_fp16_model_uses_the_loss_scaler():
    """fp16 goes with dynamic loss scaling, as param_dtype=torch.float16 does."""
    _check(_compare(0, 1, 2, None, torch.float16), 2, None, 1, torch.float16)


def test_mixed_dtypes_are_refused_by_name():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[1].bias.data = model[1].bias.data.bfloat16()
    with pytest.raises(ValueError, match=r"several dtypes: '0\.weight' is torch\.float32 but "
                                         r"'1\.bias' is torch\.bfloat16"):
        ZeroOptimizer(model)
    opt = ZeroOptimizer(model, param_dtype=torch.bfloat16)  # an explicit dtype settles it
    assert opt.param_dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_explicit_param_dtype_is_honoured_on_a_bf16_model():
    model = make_model().bfloat16()
    opt = ZeroOptimizer(model, param_dtype=torch.float32)
    assert opt.param_dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert opt.stats()["memory_bytes"]["master"] == 0   # pure fp32: the parameter is the master


def test_frozen_bf16_base_keeps_its_dtype_at_stage3():
    model = make_model().bfloat16()
    for n, p in model.named_parameters():
        p.requires_grad_("blocks.1" in n)
    opt = ZeroOptimizer(model, stage=3)
    assert opt.param_dtype == torch.bfloat16
    assert opt.frozen_units and all(u.compute_dtype == torch.bfloat16 for u in opt.frozen_units)
    x = torch.randint(CFG.vocab_size, (2, CFG.block_size))
    opt.backward(model(x, x))
    opt.step()


def test_llama_bf16_trains_one_step_at_stage3():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=80,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32,
                                   bos_token_id=None, eos_token_id=None, pad_token_id=0)
    model = transformers.LlamaForCausalLM._from_config(cfg, torch_dtype=torch.bfloat16).train()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    with torch.no_grad():
        before = [p.detach().clone() for p in model.parameters()]
    n = sum(p.numel() for p in before)
    opt = ZeroOptimizer(model, stage=3, lr=1e-2)
    ids = torch.randint(1, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss)   # (Llama upcasts its logits to fp32 for the loss)
    opt.backward(loss)
    opt.step()
    assert opt.stats()["memory_bytes"]["master"] >= 4 * n
    with opt.gathered():
        after = list(model.parameters())
        assert all(p.dtype == torch.bfloat16 for p in after)
        assert any(not torch.equal(a, b) for a, b in zip(after, before))
