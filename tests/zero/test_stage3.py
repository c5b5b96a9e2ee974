"""ZeroOptimizer stage 3 at world sizes 1 (no process group), 2 and 4 (gloo): one spawn per
world size runs every check of ``_stage3_checks.CHECKS`` (loops without gradients), each
reported as its own test; then a rank that takes another path. Stage 3's parity, round trip,
fp16, traffic and memory are the battery's rows (test_battery.py)."""
import pytest

from tests._dist import run_ranks
from tests.zero._harness import rank_check_tests
from tests.zero._stage3_checks import CHECKS, divergent_path

WORLD_SIZES = (1, 2, pytest.param(4, marks=pytest.mark.slow))  # 4 ranks: the full suite

results, test_check = rank_check_tests(CHECKS, WORLD_SIZES, timeout=600.0)


@pytest.mark.parametrize("mode", ["skip", "stop"])
def test_divergent_path_fails_naming_the_unit(mode):
    """Rank 1's forward skips a block (both ranks see that they disagree, and on which units)
    or rank 1 stops (rank 0 fails within the process group's timeout, 10 s here): an error
    naming the unit instead of a hang, a crash or wrong shards."""
    errors = run_ranks(divergent_path, 2, mode, timeout=120.0, pg_timeout_s=10.0)
    if mode == "skip":
        for rank, err in enumerate(errors):
            assert err is not None and "ranks disagree on what comes next" in err, (rank, err)
            assert "'blocks.1'" in err and "'<root>'" in err, err
    else:
        assert errors[1] == "stopped"
        assert errors[0] is not None and "waited to gather unit '<root>'" in errors[0], errors
