"""CPU and NVMe offload at world sizes 1 (no process group) and 2 (gloo): where the bytes live,
budgets, bytes on disk, close and reopen. Offload's parity, ``offload_params`` bit for bit and
state round trips across placements are the battery's rows (test_battery.py).

One spawn per world size runs every check of ``_offload_checks.CHECKS``.
"""
import pytest

from tests.zero._harness import battery_results
from tests.zero._offload_checks import CHECKS, battery

WORLD_SIZES = (pytest.param(1, marks=pytest.mark.slow), 2)  # 1 rank: the full suite


@pytest.fixture(scope="module")
def results():
    """{world_size: {check: None or the first failing rank's traceback}}."""
    return battery_results(CHECKS, battery, timeout=400.0)


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_check(results, world_size, check):
    error = results(world_size)[check]
    assert error is None, f"{check} failed at world size {world_size}:\n{error}"
