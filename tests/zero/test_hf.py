"""Hugging Face models train unchanged under ZeroOptimizer: GPT-2 and Llama (untied and
tied embeddings) at every stage on 2 gloo ranks, in parity with single-process AdamW, and
generate() afterwards (see _hf_checks.py). One spawn runs the selected rows."""
from functools import partial

import pytest

pytest.importorskip("transformers")

from tests._stages import ALL_STAGES, stage_params  # noqa: E402
from tests.zero._harness import rank_fixture  # noqa: E402
from tests.zero._hf_checks import KINDS, hf_parity  # noqa: E402

ROWS = {f"{kind}_stage{stage}": partial(hf_parity, kind=kind, stage=stage)
        for stage in ALL_STAGES for kind in KINDS}
ranks = rank_fixture(ROWS, world_size=2, timeout=400.0)


@pytest.mark.timeout(500)
@pytest.mark.parametrize("stage", stage_params())
@pytest.mark.parametrize("kind", KINDS)
def test_hf_causal_lm_parity_with_adamw(ranks, kind, stage):
    ranks(f"{kind}_stage{stage}")
