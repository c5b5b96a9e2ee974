"""Frozen parameters under ZeroOptimizer (rank side; module-level so spawned ranks import it).

Stage 3 shards frozen parameters with their unit (see [Note: frozen parameters at stage 3] in
``zkernels/zero/parameters/units.py``); stages 1-2 keep them whole and untouched. Parity over
frozen layers (with activation checkpointing) is the battery's rows (``_battery.py``); here
LoRA through peft (parity with a same-order reference, bytes per rank) and checkpoints across
stages and world sizes.
"""
from __future__ import annotations

import torch

import zkernels as zk
from tests.conftest import tol
from tests.zero._harness import (EPS, LR, MICRO_BATCH, chunk, clone_model, freeze_layers,
                                 make_batches, make_model, world_mean)

BETAS = (0.9, 0.95)
WD = 0.1
KIB = 1024


def _frozen(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


# -- LoRA through peft over a transformers Llama --------------------------------------------------

LORA_VOCAB = 1000
LORA_SEQ = 16


def make_lora(seed: int = 0):
    """peft LoRA (r=8 on q_proj/v_proj, no dropout) over a randomly initialized ~1M-parameter
    Llama (nothing downloaded); lora_B starts non-zero so every LoRA weight moves from step 1."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=LORA_VOCAB, hidden_size=128, intermediate_size=344,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, tie_word_embeddings=False,
                      bos_token_id=None, eos_token_id=None, pad_token_id=0)
    base = LlamaForCausalLM(cfg).train()
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                            target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.02)
    return model


def _lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def lora_batches(steps: int, rows: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, LORA_VOCAB, (rows, LORA_SEQ), generator=g) for _ in range(steps)]


def _same_order_grads(ref, ids, ws):
    """[Note: same-order reference] for the HF model: each rank's micro-batch gradient with
    the ranks' shapes, summed in fp64, averaged and rounded once. Returns the mean loss."""
    params = [p for p in ref.parameters() if p.requires_grad]
    total = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    losses = []
    for r in range(ws):
        loss = _lm_loss(ref, ids[r * MICRO_BATCH:(r + 1) * MICRO_BATCH])
        loss.backward()
        losses.append(loss.item())
        for acc, p in zip(total, params):
            acc += p.grad
        ref.zero_grad(set_to_none=True)
    for acc, p in zip(total, params):
        p.grad = (acc / ws).to(p.dtype)
    return sum(losses) / ws


def lora_bytes(opt, model):
    """Bytes this rank holds between steps: the optimizer's measured storages
    (``stats()["memory_bytes"]["total"]``: parameter shards trainable and frozen, gradient
    shards, moments, reduce buffers) plus every model parameter or buffer storage it does not
    count (the rotary ``inv_freq`` buffers; parameters hold none at stage 3 between steps, which
    is asserted). Returns ``(total, optimizer_part, outside_part)``."""
    stats = opt.stats()["memory_bytes"]
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters()), \
        "a stage-3 parameter holds storage between steps"
    seen, outside = set(), 0
    for t in model.buffers():
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            outside += t.untyped_storage().nbytes()
    return stats["total"] + outside, stats["total"], outside


def lora_parity(rank, ws, *, steps=4):
    """peft LoRA over a Llama at stage 3 on ``ws`` ranks: the world-mean loss each step equals
    single-process torch.optim.AdamW on the same peft model and data (same-order reference)
    within tol(float32), the LoRA weights too, the frozen base stays bit-identical; and the
    bytes a rank holds between steps are at most 4 * frozen / N + 20 B per trainable parameter
    + 256 KiB. Returns the measured figures."""
    model = make_lora()
    ref = clone_model(model)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    before = _frozen(model)
    opt = zk.ZeroOptimizer(model, stage=3, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    ropt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR,
                             betas=BETAS, eps=EPS, weight_decay=WD)
    assert len(opt.schedule.units) == 5, [u.name for u in opt.schedule.units]
    bound = 4 * frozen // ws + 20 * trainable + 256 * KIB
    measured = []
    for step, ids in enumerate(lora_batches(steps, ws * MICRO_BATCH)):
        loss = _lm_loss(model, ids[rank * MICRO_BATCH:(rank + 1) * MICRO_BATCH])
        loss.backward()
        assert opt.schedule.live_bytes() == 0
        opt.step()
        opt.zero_grad()
        rloss = _same_order_grads(ref, ids, ws)
        ropt.step()
        ropt.zero_grad()
        torch.testing.assert_close(world_mean(loss.item(), ws), rloss, **tol(torch.float32))
        with opt.gathered():
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                if n in before:
                    assert torch.equal(p, before[n]), f"frozen {n} changed"
                else:
                    torch.testing.assert_close(p, q, **tol(torch.float32),
                                               msg=lambda m, n=n: f"step {step}, {n}: {m}")
        total, in_opt, outside = lora_bytes(opt, model)
        measured.append(total)
        assert total <= bound, (f"step {step}: {total} B held per rank > bound {bound} B "
                                f"(frozen {frozen}, trainable {trainable}, N {ws})")
    return {"frozen": frozen, "trainable": trainable, "bytes": max(measured), "bound": bound,
            "optimizer_bytes": in_opt, "outside_bytes": outside,
            "frozen_whole_bytes": 4 * frozen, "stats": opt.stats()["memory_bytes"]}


# -- checkpoints --------------------------------------------------------------------------------

def _ckpt_model(stage, ws, rank, seed=0):
    model = freeze_layers(make_model(seed))
    opt = zk.ZeroOptimizer(model, stage=stage, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    return model, opt


def _train(model, opt, rank, ws, steps, seed=1):
    for batch in make_batches(steps, ws * MICRO_BATCH, seed=seed):
        model(*chunk(batch, rank)).backward()
        opt.step()
        opt.zero_grad()


def full_state(opt, model):
    """``model.state_dict()`` inside ``opt.gathered()`` (frozen parameters included), cloned."""
    with opt.gathered():
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def ckpt_save(rank, ws, folder, *, stage):
    """Train 2 steps at ``stage`` on ``ws`` ranks, save to ``folder``; return the gathered
    state (every key, frozen parameters included)."""
    model, opt = _ckpt_model(stage, ws, rank)
    _train(model, opt, rank, ws, 2)
    zk.checkpoint.save(opt, folder)
    return full_state(opt, model)


def ckpt_load(rank, ws, folder, *, stage, expected):
    """Load ``folder`` at ``stage`` on ``ws`` ranks into a differently initialized model: the
    gathered state equals ``expected`` bit for bit (frozen parameters included: read into the
    shards at stage 3); a step after it trains and leaves the frozen parameters as loaded."""
    model, opt = _ckpt_model(stage, ws, rank, seed=3)
    zk.checkpoint.load(opt, folder)
    got = full_state(opt, model)
    assert set(got) == set(expected), (sorted(got), sorted(expected))
    for k, v in expected.items():
        assert torch.equal(got[k], v), f"{k} differs after load"
    if stage == 3:
        assert all(p.numel() == 0 for p in model.parameters())
    _train(model, opt, rank, ws, 1, seed=5)
    frozen = _frozen(model) if stage != 3 else None
    with opt.gathered():
        frozen = frozen or _frozen(model)
    for k, v in frozen.items():
        assert torch.equal(v, expected[k]), f"frozen {k} changed by a step after load"
    return "ok"
