"""Long runs: 500 steps at every stage on 2 gloo ranks with flat live memory and a constant
hook count, and 50 optimizers built and dropped in one process without leaking memory or
hooks (see [Note: measuring what a rank holds] in _long_checks.py). One spawn runs every
stage; each check is reported as its own test."""
import pytest

from tests._dist import run_ranks
from tests._stages import ALL_STAGES, stage_params
from tests.zero._long_checks import battery

pytestmark = pytest.mark.slow  # soaks: many steps watching memory

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def results():
    per_rank = run_ranks(battery, WORLD_SIZE, list(ALL_STAGES), timeout=500.0, pg_timeout_s=60.0)
    # Every rank's error: the first rank's may only say that its peer left after failing.
    return {name: ("\n".join(f"rank {r}: {res[name][0]}" for r, res in enumerate(per_rank)
                             if res[name][0]) or None, per_rank[0][name][1])
            for name in per_rank[0]}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", stage_params())
@pytest.mark.parametrize("check", ["long_run", "build_and_drop"])
def test_no_growth(results, check, stage):
    error, info = results[f"{check}_stage{stage}"]
    assert error is None, f"{check} at stage {stage} failed:\n{error}"
    print(f"{check} stage {stage}: RSS growth {info['rss_growth']} B")
