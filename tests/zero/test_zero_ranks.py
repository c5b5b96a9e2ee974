"""The non-finite gradient policies (stages 1-3) at world sizes 1 (no process group), 2 and 4
(gloo); parity, round trips, fp16, traffic and memory are the battery's (test_battery.py).

One spawn per world size runs every check of ``_rank_checks.CHECKS`` (each rank pays a torch
import); each check is then reported as its own test.
"""
import pytest

from tests.zero._harness import rank_check_tests
from tests.zero._rank_checks import CHECKS

WORLD_SIZES = (1, 2, pytest.param(4, marks=pytest.mark.slow))  # 4 ranks: the full suite

results, test_check = rank_check_tests(CHECKS, WORLD_SIZES, timeout=400.0)
