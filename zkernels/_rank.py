"""One rank started by :func:`zkernels.launch.run_ranks`: ``python .../_rank.py MODULE:FUNC ARGS``.

Imports MODULE and returns FUNC(ARGS) as the exit status, the import inside the guard, so
that a module missing on a rank is its recorded failure like any other. An exception is not
printed but recorded (:func:`record_failure`) for the launcher, which prints the first
failing rank's once ([Note: one report per failure] in launch.py). Run as a file, not with
``-m``, so that nothing of zkernels (torch included) is imported before the guard; standard
library only at the top.
"""
import contextlib
import os
import sys

ERROR_FILE_ENV = "ZKERNELS_LAUNCH_ERROR_FILE"


def record_failure(exc: BaseException, tb=None) -> bool:
    """Write ``exc`` (its type, message, traceback and the time now, in ns) as JSON to the
    file named by ``$ZKERNELS_LAUNCH_ERROR_FILE``, unless that file exists already (the first
    failure recorded is the one raised first). Returns whether the failure is on record:
    False when the variable is unset (the rank was not started by ``run_ranks``) or the file
    cannot be written, and the caller must print it as usual. ``tb``: the traceback to write
    (default: the exception's)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return False
    if os.path.exists(path):
        return True
    import json
    import time
    import traceback
    record = dict(time_ns=time.time_ns(), type=type(exc).__name__, message=str(exc),
                  traceback="".join(traceback.format_exception(
                      type(exc), exc, exc.__traceback__ if tb is None else tb)))
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)
    except OSError:
        return False
    return True


@contextlib.contextmanager
def failure_recorded():
    """Record an exception leaving the block at once, then let it go on: inside a rank's
    teardown (``destroy_process_group`` in a ``finally``), so that it is stamped before the
    teardown releases the peers, whose errors ("Connection closed by peer") then come after
    it."""
    try:
        yield
    except Exception as exc:
        tb = exc.__traceback__
        record_failure(exc, tb.tb_next or tb)   # from the block down, not this frame
        raise


def main(argv) -> int:
    """Run ``argv[0]`` (``module:function``) on ``argv[1:]``; its int result, 0 for any other,
    1 for an exception (recorded, or printed when it cannot be)."""
    target, args = argv[0], list(argv[1:])
    module_name, _, func_name = target.partition(":")
    sys.argv = [module_name, *args]
    try:
        import importlib
        rc = getattr(importlib.import_module(module_name), func_name)(args)
    except Exception as exc:
        if not record_failure(exc):
            raise
        return 1
    return rc if isinstance(rc, int) and not isinstance(rc, bool) else 0


if __name__ == "__main__":
    # Run as a file, Python put this folder (zkernels/) first on the path: its modules must
    # not shadow top-level ones (a "data" or "plan" package elsewhere).
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]
    import faulthandler
    faulthandler.enable()   # a crash in native code still shows where (on stderr)
    sys.exit(main(sys.argv[1:]))
