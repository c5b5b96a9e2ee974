"""Long runs: 500 steps at every stage on 2 gloo ranks with flat live memory and a constant
hook count, and 50 optimizers built and dropped in one process without leaking memory or
hooks (see [Note: measuring what a rank holds] in _long_checks.py). One spawn runs the
selected rows; each rank's readings come back for the test to print."""
from functools import partial

import pytest

from tests._stages import ALL_STAGES, stage_params
from tests.zero._harness import rank_fixture
from tests.zero._long_checks import build_and_drop, long_run

pytestmark = pytest.mark.slow  # soaks: many steps watching memory

CHECKS = {"long_run": long_run, "build_and_drop": build_and_drop}
ROWS = {f"{name}_stage{s}": partial(fn, stage=s) for s in ALL_STAGES
        for name, fn in CHECKS.items()}
ranks = rank_fixture(ROWS, world_size=2, timeout=500.0)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", stage_params())
@pytest.mark.parametrize("check", list(CHECKS))
def test_no_growth(ranks, check, stage):
    for rank, info in enumerate(ranks(f"{check}_stage{stage}")):
        assert info["rss_growth"] < 8 * 2**20, (rank, info["rss_growth"])
        print(f"{check} stage {stage}, rank {rank}: RSS growth {info['rss_growth']} B")
