"""Shared pieces of the ZeRO tests: the awkward-size GPT, its data, the single-process
references, and a runner that executes many named checks in one spawn.

Every check runs on every rank with the same seeds, so each rank computes the reference
itself (the model is tiny) and compares its own parameters to it.
"""
from __future__ import annotations

import copy
import traceback
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from zkernels.demo.model import GPT, GPTConfig

# Sizes that divide by nothing: 36 = 3 heads x 12, vocab 97 (prime), 13 positions.
CFG = GPTConfig(vocab_size=97, block_size=13, n_layer=2, n_head=3, n_embd=36)
MICRO_BATCH = 2
# [Note: eps in the parity tests]
# The key bias of attention gets a gradient that is exactly zero in exact arithmetic (softmax
# ignores a per-query constant); in fp32 it is round-off (~1e-11) that depends on summation
# order. Adam divides by sqrt(v) + eps, so with torch's eps=1e-8 that noise becomes an update
# of ~1e-3 * lr whatever its sign, which no reduction order can reproduce. eps=1e-6 keeps
# the amplified noise below 1e-8 per step, so the comparison measures our arithmetic, not
# Adam's sensitivity to noise at zero.
EPS = 1e-6
LR = 3e-3


def make_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG)


def make_batches(num_steps: int, num_samples: int, seed: int = 1) -> List[Tuple[torch.Tensor,
                                                                                torch.Tensor]]:
    """``num_steps`` full batches (idx, targets), each int64 [num_samples, block_size]."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_samples, CFG.block_size)
    return [(torch.randint(0, CFG.vocab_size, shape, generator=g),
             torch.randint(0, CFG.vocab_size, shape, generator=g)) for _ in range(num_steps)]


def chunk(batch, index: int, size: int = MICRO_BATCH):
    x, y = batch
    return x[index * size:(index + 1) * size], y[index * size:(index + 1) * size]


def world_mean(value: float, world_size: int) -> float:
    """Mean of a Python float over ranks (outside the optimizer's meter)."""
    if world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / world_size


def no_decay(name: str) -> bool:
    """Biases and LayerNorm parameters get no weight decay."""
    return name.endswith("bias") or ".ln_" in name or name.startswith("ln_")


def split_groups(model, weight_decay: float) -> List[dict]:
    decay, plain = [], []
    for n, p in model.named_parameters():
        if p.requires_grad:
            (plain if no_decay(n) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": plain, "weight_decay": 0.0}]


def assert_params_close(model, ref, step: int, **tol) -> None:
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().float(), q.detach().float(), **tol,
                                   msg=lambda m, n=n: f"step {step}, {n}: {m}")


def run_checks(checks: Dict[str, Callable], rank: int, world_size: int) -> Dict[str, Optional[str]]:
    """Run every check; return name -> None (passed) or the traceback. A check that fails
    on one rank may leave the others waiting in a collective: the process group's timeout
    (tests/_dist.py) bounds that."""
    out = {}
    for name, fn in checks.items():
        try:
            fn(rank, world_size)
            out[name] = None
        except Exception:  # noqa: BLE001 - reported per check by the parent
            out[name] = traceback.format_exc()
    return out


def clone_model(model):
    return copy.deepcopy(model)
