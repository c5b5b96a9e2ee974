"""The multi-rank harness itself (tests/_dist.py): a store port taken between its choice and
rank 0's listen starts the ranks again ([Note: a port taken between choice and listen])."""
import socket

import pytest

from tests import _dist


def rank_and_size(rank, world_size):
    return rank, world_size


@pytest.mark.slow  # two spawns of 2 ranks (a torch import each)
def test_a_taken_store_port_starts_the_ranks_again(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    free = _dist._free_port

    def first_taken():
        return ports.pop() if ports else free()

    monkeypatch.setattr(_dist, "_free_port", first_taken)
    try:
        assert _dist.run_ranks(rank_and_size, 2, timeout=120.0) == [(0, 2), (1, 2)]
    finally:
        taken.close()
    assert not ports  # the taken port was tried first


@pytest.mark.slow  # three spawns of 2 ranks
def test_a_port_taken_every_time_fails_naming_the_race(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    monkeypatch.setattr(_dist, "_free_port", lambda: taken.getsockname()[1])
    try:
        with pytest.raises(AssertionError, match="EADDRINUSE"):
            _dist.run_ranks(rank_and_size, 2, timeout=120.0)
    finally:
        taken.close()
