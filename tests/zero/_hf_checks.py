"""Hugging Face causal LMs under ZeroOptimizer (rank side; module-level for spawned ranks).

GPT-2 (``GPT2LMHeadModel``: tied input/output embeddings, fused qkv ``Conv1D`` with biases)
and Llama (``LlamaForCausalLM``: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU,
no biases; untied and tied) from tiny configs, random init: nothing is downloaded. The model
code is transformers' own, unchanged: ZeroOptimizer only makes its parameters views of flat
buffers (and, at stage 2/3, adds hooks).
"""
from __future__ import annotations


import torch

import zkernels as zk
from tests.conftest import tol
from tests.zero._harness import EPS, LR, MICRO_BATCH, clone_model, world_mean

BETAS = (0.9, 0.95)
WD = 0.1
VOCAB = 97
SEQ = 13
BUCKET = 2 ** 13  # ~15 buckets over these models
KINDS = ("gpt2", "llama", "llama_tied")


def make_hf(kind: str, seed: int = 0):
    """A tiny, dropout-free causal LM of ``kind`` (one of ``KINDS``)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    if kind == "gpt2":
        cfg = GPT2Config(n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, **common)
        model = GPT2LMHeadModel(cfg)
    elif kind in ("llama", "llama_tied"):
        cfg = LlamaConfig(hidden_size=32, intermediate_size=80, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=32, tie_word_embeddings=kind == "llama_tied",
                          **common)
        model = LlamaForCausalLM(cfg)
    else:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return model.train()


def _tied(model) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def _batches(steps: int, rows: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (rows, SEQ), generator=g) for _ in range(steps)]


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss  # the same token count on every rank


def hf_parity(rank, ws, *, kind, stage, steps=5):
    """ZeroOptimizer over the HF model on ``ws`` ranks (micro-batch each) == AdamW on one
    process over the whole batch: world-mean loss and every parameter each step within
    tol(float32) (see [Note: eps in the parity tests]: GPT-2's key bias has a zero true
    gradient). Tied embeddings stay one parameter. Then greedy ``generate()``: equal tokens
    to the same model rebuilt from the optimizer's parameters (at stage 3 they are gathered
    by forward hooks, and again inside ``opt.gathered()``), and one more training step after
    it still matches the reference."""
    model = make_hf(kind)
    tied = _tied(model)
    assert tied == (kind != "llama")
    ref = clone_model(model)
    opt = zk.ZeroOptimizer(model, stage=stage, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                           bucket_bytes=BUCKET)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    assert _tied(model) == tied, "ZeroOptimizer must keep tied weights one parameter"
    batches = _batches(steps + 1, ws * MICRO_BATCH)

    def train_step(step, ids):
        local = ids[rank * MICRO_BATCH:(rank + 1) * MICRO_BATCH]
        loss = _loss(model, local)
        loss.backward()
        opt.step()
        opt.zero_grad()
        rloss = _loss(ref, ids)
        rloss.backward()
        ropt.step()
        ropt.zero_grad()
        torch.testing.assert_close(world_mean(loss.item(), ws), rloss.item(),
                                   **tol(torch.float32))
        _assert_close(opt, model, ref, step, stage)

    for step, ids in enumerate(batches[:steps]):
        train_step(step, ids)
    assert _tied(model) == tied
    _check_generate(opt, model, stage, batches[0][:2, :4])
    train_step(steps, batches[steps])


def _full_params(opt, model, stage):
    """{name: fp32 copy of the full parameter} (gathered at stage 3)."""
    if stage == 3:
        with opt.gathered():
            return {n: p.detach().clone() for n, p in model.named_parameters()}
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_close(opt, model, ref, step, stage):
    full = _full_params(opt, model, stage)
    for n, q in ref.named_parameters():
        torch.testing.assert_close(full[n], q.detach(), **tol(torch.float32),
                                   msg=lambda m, n=n: f"step {step}, {n}: {m}")


def _check_generate(opt, model, stage, prompt):
    full = _full_params(opt, model, stage)
    kind = "gpt2" if "GPT2" in type(model).__name__ else (
        "llama_tied" if _tied(model) else "llama")
    copy = make_hf(kind, seed=1).eval()
    with torch.no_grad():
        for n, p in copy.named_parameters():
            p.copy_(full[n])
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = copy.generate(prompt, **kw)
    model.eval()
    got = model.generate(prompt, **kw)
    if stage == 3:
        with opt.gathered():
            again = model.generate(prompt, **kw)
        assert torch.equal(again, expected), (again, expected)
    model.train()
    assert got.shape == (prompt.shape[0], prompt.shape[1] + 6)
    assert torch.equal(got, expected), (got, expected)
