"""The rank fixture itself (``_harness.rank_fixture``): each rank's return value comes back to
the test by rank, and a rank's exception is re-raised in the pytest process with its own
traceback, for that row alone."""
import pytest

from tests.zero._harness import RankError, rank_fixture


def where(rank, world_size):
    return {"rank": rank, "world_size": world_size}


def fails_on_the_last_rank(rank, world_size):
    if rank == world_size - 1:
        raise ValueError(f"boom on rank {rank}")
    return rank


BODIES = {"where": where, "fails_on_the_last_rank": fails_on_the_last_rank}
ranks = rank_fixture(BODIES, timeout=120.0)

SIZES = [1, pytest.param(2, marks=pytest.mark.slow)]   # 2: one spawn (a torch import a rank)


@pytest.mark.parametrize("world_size", SIZES)
@pytest.mark.parametrize("row", ["where"])
def test_each_rank_returns_its_object(ranks, row, world_size):
    assert ranks(row, world_size) == [{"rank": r, "world_size": world_size}
                                      for r in range(world_size)]


@pytest.mark.parametrize("world_size", SIZES)
@pytest.mark.parametrize("row", ["fails_on_the_last_rank"])
def test_a_rank_exception_is_reraised_with_its_traceback(ranks, row, world_size):
    with pytest.raises(RankError) as info:
        ranks(row, world_size)
    text = str(info.value)
    assert f"fails_on_the_last_rank failed on rank {world_size - 1} of {world_size}" in text
    assert "Traceback" in text and "ValueError: boom on rank" in text
    assert "in fails_on_the_last_rank" in text   # the rank's own frame
