"""The ZeRO battery (``_battery.ROWS``: rung x dtype x reshard mode x options, each row's checks
against one oracle) at the world sizes each row lists: world size 1 in this process (no
process group), above it one spawn of gloo ranks per world size and suite. Each check is its
own test, ``<world size>-<row>-<check>``. The rows that need 4 ranks in 2 groups (hybrid
sharding, ``reshard_after_forward=2``) run in test_hybrid.py's spawn.
"""
from functools import partial

import pytest

from tests.zero import _battery
from tests.zero._harness import battery_results


def _cases():
    out = []
    for name, sizes in _battery.WORLD_SIZES.items():
        if sizes is _battery.HYBRID:
            continue
        for ws, slow in sorted(sizes.items()):
            # [Note: the quick suite and the full suite]: 1 and 4 ranks on the device and 1
            # rank with offload are the full suite's (_battery.FULL, _battery.OFFLOAD)
            marks = (pytest.mark.slow,) if slow else ()
            out.append(pytest.param(ws, slow, name, marks=marks, id=f"{ws}-{name}"))
    return out


@pytest.fixture(scope="module")
def results():
    """``get(world_size, slow)`` -> {check: None or the first failing rank's traceback}, one
    run per world size and suite."""
    cache = {}

    def get(ws, slow):
        if (ws, slow) not in cache:
            names = _battery.names_at(ws, slow)
            checks = {n: _battery.CHECKS[n] for n in names}
            cache[(ws, slow)] = battery_results(
                checks, partial(_battery.battery, names=names), timeout=600.0)(ws)
        return cache[(ws, slow)]

    return get


@pytest.mark.parametrize("world_size, slow, check", _cases())
def test_battery(results, world_size, slow, check):
    error = results(world_size, slow)[check]
    assert error is None, f"{check} failed at world size {world_size}:\n{error}"


def test_every_row_is_run_somewhere():
    """Each check of the table runs at one world size at least, in this file or in
    test_hybrid.py's spawn, and its id names its row uniquely."""
    from tests.zero import _hybrid_checks
    here = {name for name, sizes in _battery.WORLD_SIZES.items() if sizes is not _battery.HYBRID}
    assert here | set(_hybrid_checks.CHECKS) >= set(_battery.CHECKS)
    assert len({row.id for row, _, _ in _battery.ROWS}) == len(_battery.ROWS)
