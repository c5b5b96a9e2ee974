"""Dead and stuck ranks: one rank is SIGKILLed (in backward, inside step(), during the stage-3
gather) or raises in forward and lingers; every other rank must raise a CollectiveError that
names the collective (and, at stage 3, the unit) within the timeout, at every stage, never
hang. Each case is one spawn, bounded by run_ranks_outcomes' timeout.
"""
import pytest

from tests._dist_faults import run_ranks_outcomes
from tests._stages import stage_params
from tests.zero._fault_checks import faulty_training

pytestmark = pytest.mark.slow  # fault timing: ranks killed or stuck, bounded by timeouts

PG_TIMEOUT_S = 5.0  # the process group's: what bounds a kill when no own timeout is given
OWN_TIMEOUT_S = 3.0  # ZeroOptimizer(timeout=...) for a stuck rank, under a 60 s group timeout
SLACK_S = 10.0  # the step before the fault, on a loaded 2-core machine; a hang is unbounded

CASES = [  # (fault, world size, victim)
    ("kill_backward", 2, 1),
    ("kill_step", 3, 0),  # the rank holding the rendezvous store dies; two survivors
    ("kill_gather", 2, 1),
    ("raise_forward", 2, 1),
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage, fault, world_size, victim", [
    pytest.param(stage.values[0], *case, id=f"{case[0]}-{stage.id}")
    for case in CASES for stage in stage_params()
    if case[0] != "kill_gather" or stage.values[0] == 3])   # only stage 3 gathers in forward
def test_peer_failure_raises_named_collective_error(stage, fault, world_size, victim):
    stuck = fault == "raise_forward"
    timeout_s = OWN_TIMEOUT_S if stuck else None
    bound_s = (OWN_TIMEOUT_S if stuck else PG_TIMEOUT_S) + SLACK_S
    outcomes = run_ranks_outcomes(
        faulty_training, world_size, stage, fault, victim, timeout_s, OWN_TIMEOUT_S + 3.0,
        pg_timeout_s=60.0 if stuck else PG_TIMEOUT_S, timeout=120.0)
    if stuck:
        assert outcomes[victim] == ("ok", {"injected": True}), outcomes[victim]
    else:
        assert outcomes[victim] == ("died", -9), outcomes[victim]
    for rank, (kind, result) in outcomes.items():
        if rank == victim:
            continue
        assert kind == "ok", f"rank {rank} did not raise a CollectiveError:\n{result}"
        assert "collective" in result, f"rank {rank} trained on past a dead peer: {result}"
        collective, message = result["collective"], result["message"]
        assert collective in ("reduce_scatter", "all_gather", "all_reduce"), result
        assert f"{collective} of " in message and f"on rank {rank} of " in message, message
        assert result["elapsed"] < bound_s, (rank, result)
        if stuck:  # the own timeout freed it (the victim was still alive and silent)
            assert f"within timeout {OWN_TIMEOUT_S:g}s" in message, message
            assert result["elapsed"] >= 0.9 * OWN_TIMEOUT_S, result
        if stage == 3 and fault == "kill_gather":
            assert result["tag"] and "unit" in result["tag"], result
