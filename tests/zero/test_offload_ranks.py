"""CPU and NVMe offload at world sizes 1 (no process group) and 2 (gloo): where the bytes live,
budgets, bytes on disk, close and reopen. Offload's parity, ``offload_params`` bit for bit and
state round trips across placements are the battery's rows (test_battery.py).

One spawn per world size runs the selected checks of ``_offload_checks.CHECKS``.
"""
import pytest

from tests.zero._harness import rank_check_tests
from tests.zero._offload_checks import CHECKS

WORLD_SIZES = (pytest.param(1, marks=pytest.mark.slow), 2)  # 1 rank: the full suite

ranks, test_check = rank_check_tests(CHECKS, WORLD_SIZES, timeout=400.0)
