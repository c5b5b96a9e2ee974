"""The demo's corpus and tokenizer: the package's tiny-shakespeare slice, one token per byte.

Batches are a pure function of ``(seed, step, rank)``, so every rung of the ladder trains on
exactly the same tokens, and N ranks with batch b see exactly the global batch N·b.
"""
from __future__ import annotations

from importlib import resources
from typing import List, Tuple

import torch

VOCAB_SIZE = 256    # every byte is a token: no vocabulary file, nothing downloaded


def encode(text: str) -> List[int]:
    """UTF-8 bytes of ``text`` as token ids in [0, 256)."""
    return list(text.encode("utf-8"))


def decode(ids) -> str:
    """Token ids back to text (bytes that do not form UTF-8 become U+FFFD)."""
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def load_corpus() -> torch.Tensor:
    """The shipped corpus (zkernels/data/tinyshakespeare.txt) as int64 token ids [num_bytes]."""
    raw = resources.files("zkernels").joinpath("data", "tinyshakespeare.txt").read_bytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)


def get_batch(tokens: torch.Tensor, *, seed: int, step: int, rank: int, world_size: int,
              batch_size: int, block_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of step ``step``'s global batch.

    Args:
        tokens: int64 [num_tokens] corpus.
        seed, step: pick the global batch (same on every rank and every rung).
        rank, world_size: this rank takes rows [rank·b, (rank+1)·b) of the N·b global rows.
        batch_size: b, rows per rank. block_size: T, tokens per row.

    Returns:
        ``(x, y)``: int64 [b, T] inputs and the next-token targets.
    """
    if tokens.numel() <= block_size + 1:
        raise ValueError(f"corpus of {tokens.numel()} tokens is too short for block_size "
                         f"{block_size}")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(tokens.numel() - block_size - 1, (world_size * batch_size,),
                           generator=gen)[rank * batch_size:(rank + 1) * batch_size]
    idx = starts[:, None] + torch.arange(block_size + 1)
    rows = tokens[idx]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
