"""Hugging Face models train unchanged under ZeroOptimizer: GPT-2 and Llama (untied and
tied embeddings) at every stage on 2 gloo ranks, in parity with single-process AdamW, and
generate() afterwards (see _hf_checks.py). One spawn runs every check."""
import pytest

pytest.importorskip("transformers")

from tests._dist import run_ranks  # noqa: E402
from tests._stages import ALL_STAGES, stage_params  # noqa: E402
from tests.zero._hf_checks import KINDS, battery  # noqa: E402

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def results():
    per_rank = run_ranks(battery, WORLD_SIZE, list(ALL_STAGES), timeout=400.0,
                         pg_timeout_s=60.0)
    return {name: next((r[name] for r in per_rank if r[name]), None) for name in per_rank[0]}


@pytest.mark.timeout(500)
@pytest.mark.parametrize("stage", stage_params())
@pytest.mark.parametrize("kind", KINDS)
def test_hf_causal_lm_parity_with_adamw(results, kind, stage):
    error = results[f"{kind}_stage{stage}"]
    assert error is None, f"{kind} at stage {stage} failed:\n{error}"
