"""The non-finite gradient policies (stages 1-3) and stages 1-2's traffic and memory at world
sizes 1 (no process group), 2 and 4 (gloo); parity, round trips and fp16 are the battery's
(test_battery.py).

One spawn per world size runs every check of ``_rank_checks.CHECKS`` (each rank pays a torch
import); each check is then reported as its own test.
"""
import pytest

from tests.zero._harness import battery_results
from tests.zero._rank_checks import CHECKS, battery

WORLD_SIZES = (1, 2, pytest.param(4, marks=pytest.mark.slow))  # 4 ranks: the full suite


@pytest.fixture(scope="module")
def results():
    """{world_size: {check: None or the first failing rank's traceback}}."""
    return battery_results(CHECKS, battery, timeout=400.0)


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_check(results, world_size, check):
    error = results(world_size)[check]
    assert error is None, f"{check} failed at world size {world_size}:\n{error}"
