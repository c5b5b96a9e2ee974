"""ZeroOptimizer stages 1 and 2 at world sizes 1 (no process group), 2 and 4 (gloo).

One spawn per world size runs every check of ``_rank_checks.CHECKS`` (each rank pays a torch
import); each check is then reported as its own test.
"""
import pytest
import torch

from tests._dist import run_ranks, rank_threads
from tests.zero._harness import run_checks
from tests.zero._rank_checks import CHECKS, battery

WORLD_SIZES = (1, 2, 4)


@pytest.fixture(scope="module")
def results():
    """{world_size: {check: None or the first failing rank's traceback}}."""
    cache = {}

    def get(world_size):
        if world_size not in cache:
            if world_size == 1:  # no torch.distributed at all: the single-process path
                # One thread (ZKERNELS_TEST_THREADS), like the spawned ranks: OpenMP
                # barriers on a shared 2-core machine make tiny ops ~1000x slower.
                threads = torch.get_num_threads()
                torch.set_num_threads(rank_threads())
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
