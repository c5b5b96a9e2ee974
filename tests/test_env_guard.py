"""The suite's guards work: a test that leaves ZKERNELS_* changed in the pytest process fails
(tests/conftest.py's zkernels_env_unchanged), and the slow tests are deselected from the quick
suite but run with --full ([Note: the quick suite and the full suite])."""
import os
import shutil
from pathlib import Path

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).with_name("conftest.py")


def _project(pytester):
    shutil.copy(CONFTEST, pytester.path / "conftest.py")
    pytester.makeini("[pytest]\nmarkers =\n    slow: long\n")


def test_a_leaked_zkernels_variable_fails_that_test(pytester, monkeypatch):
    monkeypatch.delenv("ZKERNELS_BACKEND", raising=False)
    _project(pytester)
    pytester.makepyfile(test_leak="""
        import os
        def test_leaks():
            os.environ["ZKERNELS_BACKEND"] = "reference"
        def test_after():
            assert "ZKERNELS_BACKEND" not in os.environ
        def test_monkeypatched(monkeypatch):
            monkeypatch.setenv("ZKERNELS_BACKEND", "cpp")
    """)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(["*test_leaks*", "*left *ZKERNELS_BACKEND* changed*"])
    assert "ZKERNELS_BACKEND" not in os.environ


def test_slow_tests_run_only_in_the_full_suite(pytester):
    _project(pytester)
    pytester.makepyfile(test_marks="""
        import pytest
        def test_quick():
            pass
        @pytest.mark.slow
        def test_long():
            pass
    """)
    pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=1,
                                                                            deselected=1)
    pytester.runpytest_inprocess("-p", "no:cacheprovider", "--full").assert_outcomes(passed=2)
    pytester.runpytest_inprocess("-p", "no:cacheprovider", "-m", "slow").assert_outcomes(
        passed=1, deselected=1)
