"""The demo's corpus and tokenizer: the package's tiny-shakespeare slice, one token per byte.

Batches are a pure function of ``(seed, step, rank)``, so every rung of the ladder trains on
exactly the same tokens, and N ranks with batch b see exactly the global batch N·b.

[Note: the demo's evaluation batches]
``--eval-batches N`` scores every rung after its last step on N fixed batches drawn by
:func:`get_batch` with ``stream="eval"``: eval batch i is the draw that follows training step
i's draw from the same generator (seeded ``seed·1,000,003 + i``), so it is a pure function of
``(seed, i, rank)`` like the training batches, never one of their draws, and the training
batches, and every figure measured before, stay as they were. (A seed offset would not do:
torch's CPU generator keeps only the low 32 bits of a seed, so an offset of 2**62 gave the
training batches again, and one below 2**32 meets the training seeds of some larger --seed.)
The evaluation windows come from the same corpus as the training ones (a held-out tail would
move the training batches), and the corpus is small (300k tokens: 300 steps of 2 x 8 rows of
64 read about as many, covering some 64% of its positions): the eval loss is the loss on fixed
batches, denoised by averaging over many and paired across rungs (the same batches for each),
not a held-out generalization loss.
"""
from __future__ import annotations

from importlib import resources
from typing import List, Tuple

import torch

VOCAB_SIZE = 256    # every byte is a token: no vocabulary file, nothing downloaded
STREAMS = ("train", "eval")


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
              batch_size: int, block_size: int,
              stream: str = "train") -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of step ``step``'s global batch.

    Args:
        tokens: int64 [num_tokens] corpus.
        seed, step: pick the global batch (same on every rank and every rung).
        rank, world_size: this rank takes rows [rank·b, (rank+1)·b) of the N·b global rows.
        batch_size: b, rows per rank. block_size: T, tokens per row.
        stream: "train", or "eval" for the evaluation batches (``step`` is then the eval
            batch's index; see [Note: the demo's evaluation batches]).

    Returns:
        ``(x, y)``: int64 [b, T] inputs and the next-token targets.
    """
    if tokens.numel() <= block_size + 1:
        raise ValueError(f"corpus of {tokens.numel()} tokens is too short for block_size "
                         f"{block_size}")
    if stream not in STREAMS:
        raise ValueError(f"stream must be one of {STREAMS}, got {stream!r}")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    for _ in range(1 + (stream == "eval")):     # eval: the draw after the training one
        starts = torch.randint(tokens.numel() - block_size - 1, (world_size * batch_size,),
                               generator=gen)
    starts = starts[rank * batch_size:(rank + 1) * batch_size]
    idx = starts[:, None] + torch.arange(block_size + 1)
    rows = tokens[idx]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
