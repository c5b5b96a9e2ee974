"""CPU and NVMe offload at world sizes 1 (no process group) and 2 (gloo): parity with the same
stage on the device, budgets, bytes on disk, state round trips, close and reopen.

One spawn per world size runs every check of ``_offload_checks.CHECKS``.
"""
import pytest
import torch

from tests._dist import run_ranks
from tests.zero._harness import run_checks
from tests.zero._offload_checks import CHECKS, battery

WORLD_SIZES = (1, 2)


@pytest.fixture(scope="module")
def results():
    cache = {}

    def get(world_size):
        if world_size not in cache:
            if world_size == 1:
                threads = torch.get_num_threads()
                torch.set_num_threads(1)
                try:
                    per_rank = [run_checks(CHECKS, 0, 1)]
                finally:
                    torch.set_num_threads(threads)
            else:
                per_rank = run_ranks(battery, world_size, timeout=400.0, pg_timeout_s=60.0)
            cache[world_size] = {name: next((r[name] for r in per_rank if r[name]), None)
                                 for name in CHECKS}
        return cache[world_size]

    return get


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_check(results, world_size, check):
    error = results(world_size)[check]
    assert error is None, f"{check} failed at world size {world_size}:\n{error}"
