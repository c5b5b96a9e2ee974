"""zkernels.launch: when one rank fails, its traceback is reported once with the command that
reproduces it, its peers' ("Connection closed by peer") not at all, and no peer outlives the
grace period ([Note: one report per failure] in zkernels/launch.py)."""
import os
import time

import pytest

from zkernels.launch import RanksFailed, RanksTimedOut, failure_report, lost_peer, run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")


def _run(target, args, nproc=2, **kw):
    with pytest.raises(RanksFailed) as info:
        run_ranks(f"tests._launch_targets:{target}", args, nproc, env=ENV,
                  reproduce="python again.py", timeout_s=kw.pop("timeout_s", 120), **kw)
    return str(info.value)


def test_the_failing_rank_is_reported_once_not_its_peers(capfd):
    # The middle one of 3 ranks (a peer on each side; the demo's test has rank 0 failing);
    # a run that succeeds is every demo test's.
    failing = 1
    report = _run("one_rank_raises", [str(failing)], nproc=3)
    out, err = capfd.readouterr()
    cause = f"ValueError: deliberate failure on rank {failing}"
    assert report.startswith(f"rank {failing} of 3 failed first:\n"), report
    assert report.count(cause) == 1 and report.count("Traceback") == 1, report
    assert "one_rank_raises" in report            # the traceback of the cause, where it was
    assert report.endswith("\nreproduce: python again.py"), report
    others = [r for r in range(3) if r != failing]
    for r in others:
        assert f"rank {r}: failed after it" in report, report
    # The ranks printed no traceback of their own: neither the cause nor the lost peers.
    for text in (out, err):
        assert "Traceback" not in text and "Connection closed by peer" not in text, text
    assert "Connection closed by peer" not in report


def test_a_rank_that_dies_without_exception_and_a_peer_that_would_hang(capfd):
    # Rank 0 exits 3 at once; rank 1 would sleep 300 s: it is stopped after the grace period.
    t0 = time.monotonic()
    report = _run("one_rank_exits", ["300"], grace_s=1.0, kill_after_s=1.0)
    assert time.monotonic() - t0 < 60, "the peer was not stopped"
    assert report.startswith("rank 0 of 2 failed first:\nit exited with exit status 3 "
                             "without a Python exception"), report
    assert "rank 1: stopped after rank 0 failed" in report and "Traceback" not in report


def test_a_module_missing_on_every_rank_is_reported_once():
    # The import is inside the rank's guard: each rank records it, the report shows one.
    with pytest.raises(RanksFailed) as info:
        run_ranks("tests._launch_targets_absent:main", [], 2, env=ENV, reproduce="-",
                  timeout_s=120)
    report = str(info.value)
    assert report.count("ModuleNotFoundError: No module named 'tests._launch_targets_absent'") \
        == 1, report
    assert "failed after it" in report


def test_timeout_stops_every_rank():
    t0 = time.monotonic()
    with pytest.raises(RanksTimedOut, match=r"did not finish within 3s .*\nreproduce: -"):
        run_ranks("tests._launch_targets:every_rank_sleeps", ["300"], 2, env=ENV,
                  reproduce="-", timeout_s=3)
    assert time.monotonic() - t0 < 60


def _record(kind, message, t):
    return dict(type=kind, message=message, time_ns=t, traceback=f"Traceback ...\n{kind}: "
                f"{message}\n")


def test_report_prefers_the_cause_over_an_earlier_lost_peer():
    # A peer's "Connection closed by peer" stamped before the cause (clocks, scheduling) is
    # still not the cause; with only lost peers, the earliest one is.
    peer = _record("RuntimeError", "[pair.cc:553] Connection closed by peer [127.0.0.1]:1", 1)
    cause = _record("ModuleNotFoundError", "No module named 'safetensors'", 2)
    assert lost_peer(peer) and not lost_peer(cause)
    assert not lost_peer(_record("ModuleNotFoundError", "No module named 'pytest_timeout'", 0))
    report = failure_report({0: 1, 1: 1}, {0: 5, 1: 5}, {0: cause, 1: peer}, [], "again")
    assert report.startswith("rank 0 of 2 failed first:") and "rank 1: failed after it" in \
        report and report.count("safetensors") == 1, report
    report = failure_report({0: 1, 1: 1}, {0: 5, 1: 5}, {0: dict(peer, time_ns=3), 1: peer},
                            [], "again")
    assert report.startswith("rank 1 of 2 failed first:"), report
    # Two different causes: the other one gets its one line.
    other = _record("ValueError", "bad shape", 3)
    report = failure_report({0: 1, 1: 1}, {0: 5, 1: 5}, {0: cause, 1: other}, [], "again")
    assert "rank 1: failed too: ValueError: bad shape" in report


def test_catches_a_report_that_takes_the_lost_peer_for_the_cause(monkeypatch):
    # The check above fails when lost peers are not told apart (the earliest failure wins).
    import zkernels.launch as launch
    monkeypatch.setattr(launch, "lost_peer", lambda record: False)
    peer = _record("RuntimeError", "Connection closed by peer", 1)
    cause = _record("ModuleNotFoundError", "No module named 'safetensors'", 2)
    report = launch.failure_report({0: 1, 1: 1}, {0: 5, 1: 5}, {0: cause, 1: peer}, [], "x")
    assert report.startswith("rank 1 of 2 failed first:")


@pytest.mark.parametrize("kw, message", [
    (dict(target="nomodule"), "target must be 'module:function'"),
    (dict(nproc=0), "nproc must be an int >= 1"),
    (dict(timeout_s=0), "timeout_s must be > 0"),
    (dict(grace_s=-1), "grace_s must be > 0")])
def test_bad_arguments(kw, message):
    args = dict(target="tests._launch_targets:every_rank_sleeps", args=[], nproc=1,
                reproduce="-", timeout_s=10)
    args.update(kw)
    with pytest.raises(ValueError, match=message):
        run_ranks(**args)
