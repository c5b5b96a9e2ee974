"""README.md's quick start works on a fresh machine: each of its commands imports nothing that
the command does not install, and CI runs each command as the README writes it.

[Note: what a quick-start command may import]
A command ``pip install A && pip install -e ".[X]" && RUN`` gives RUN a fresh virtual
environment holding exactly the closure of A, the project's dependencies and extra X (each
requirement, then the requirements of what it brings, per importlib.metadata and its markers),
plus what the venv starts with (pip; setuptools before Python 3.12). The developers' venv
holds far more (the test extra), so running RUN there proves nothing: the demo's initial
weights needed safetensors, which only the test extra had, and the demo failed on a fresh
machine while every test passed. So :func:`command_problem` runs a fast form of RUN (the demo
on tiny sizes, every default rung; pytest collecting the quick suite) with every other
distribution hidden: a meta-path finder installed in every process it starts (the launcher and
each rank, through ``sitecustomize`` on PYTHONPATH) refuses any top-level module that only
hidden distributions provide, as the fresh venv would (ModuleNotFoundError). An optional
import that falls back (tqdm's bar, psutil) still falls back; a needed one fails the command.
The standard library and this checkout (PYTHONPATH) are no distribution and stay visible.
"""
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_DEMO = ["--steps", "1", "--n-layer", "1", "--n-embd", "32", "--n-head", "2",
             "--block-size", "16", "--batch-size", "2", "--bucket-bytes", "16384"]
# Each quick-start command's run as the check runs it: the same program, cut to seconds.
FAST_FORMS = {"python -m zkernels demo": TINY_DEMO,    # every default rung, 2 ranks, 1 step
              "python -m pytest -q": ["--collect-only", "-p", "no:cacheprovider"]}


def _extractor():
    """.ci/readme_commands.py, the extractor .ci/run uses, as a module."""
    spec = importlib.util.spec_from_file_location(
        "readme_commands", os.path.join(ROOT, ".ci", "readme_commands.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _read(*parts) -> str:
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def readme_commands():
    return _extractor().quick_start_commands(_read("README.md"))


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")    # Python >= 3.11
    return tomllib.loads(_read("pyproject.toml"))


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_command(command: str):
    """``(requirements, extras, run)`` of a quick-start command: the requirement strings its
    ``pip install`` parts name, the project's extras its ``pip install -e ".[X]"`` installs
    (None: the project is not installed) and the one part that is not an install.

    Raises:
        ValueError: a part that is neither, or not exactly one run part.
    """
    reqs, extras, runs = [], None, []
    for part in (p.strip() for p in command.split("&&")):
        words = shlex.split(part)
        if words[:2] != ["pip", "install"]:
            runs.append(part)
            continue
        words = words[2:]
        while words:
            word = words.pop(0)
            if word == "-e":
                target = words.pop(0)
                match = re.fullmatch(r"\.(?:\[([\w,-]*)\])?", target)
                if not match:
                    raise ValueError(f"{command!r}: -e {target!r} is not this project")
                extras = [e for e in (match.group(1) or "").split(",") if e]
            elif word.startswith("-"):
                raise ValueError(f"{command!r}: pip option {word!r} is not understood")
            else:
                reqs.append(word)
    if len(runs) != 1:
        raise ValueError(f"{command!r}: expected one part that runs something, got {runs}")
    return reqs, extras, runs[0]


def allowed_distributions(reqs, extras, project: dict):
    """The normalized names of the distributions a fresh venv holds after installing ``reqs``
    and, unless ``extras`` is None, this project with ``extras`` (``project``: pyproject's
    [project] table), every requirement followed through importlib.metadata.

    Raises:
        LookupError: a distribution in the closure is not installed here (its requirements
            cannot be read, so the check cannot be made).
    """
    from importlib import metadata

    from packaging.requirements import Requirement
    todo = [(Requirement(r), ("",)) for r in reqs]
    if extras is not None:
        todo += [(Requirement(r), ("",)) for r in project["dependencies"]]
        for extra in extras:
            todo += [(Requirement(r), ("",)) for r in project["optional-dependencies"][extra]]
    allowed = {"pip"} | ({"setuptools"} if sys.version_info < (3, 12) else set())
    if extras is not None:
        allowed.add(_norm(project["name"]))
    seen = set()
    while todo:
        req, env_extras = todo.pop()
        if req.marker is not None and not any(req.marker.evaluate({"extra": e})
                                              for e in env_extras):
            continue
        name = _norm(req.name)
        key = (name, tuple(sorted(req.extras)))
        if key in seen:
            continue
        seen.add(key)
        allowed.add(name)
        try:
            requires = metadata.distribution(req.name).requires or []
        except metadata.PackageNotFoundError:
            raise LookupError(f"{req.name} is not installed here: cannot follow its "
                              "requirements") from None
        todo += [(Requirement(r), ("",) + tuple(sorted(req.extras))) for r in requires]
    return allowed


# Installed in every Python process of the command (see [Note: what a quick-start command may
# import]): ZKERNELS_TEST_ALLOWED_DISTS is the JSON list of visible distributions,
# ZKERNELS_TEST_HIDDEN_LOG a file that gets one line per refused import.
SITECUSTOMIZE = r'''
import importlib.abc, json, os, re, sys
from importlib import metadata

def _norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

class _OnlyInstalled(importlib.abc.MetaPathFinder):
    def __init__(self, allowed, log):
        self.allowed, self.log, self.owners = allowed, log, None

    def find_spec(self, name, path=None, target=None):
        if path is not None or "." in name:
            return None         # a submodule: its top-level package was let through
        if self.owners is None:
            self.owners = metadata.packages_distributions()
        owners = {_norm(d) for d in self.owners.get(name, ())}
        if owners and not owners & self.allowed:
            with open(self.log, "a") as f:
                f.write(f"{name} {' '.join(sorted(owners))}\n")
            raise ModuleNotFoundError(f"No module named {name!r} (hidden: {', '.join(owners)} "
                                      "is not installed by this command)", name=name)
        return None

sys.meta_path.insert(0, _OnlyInstalled(set(json.loads(os.environ["ZKERNELS_TEST_ALLOWED_DISTS"])),
                                       os.environ["ZKERNELS_TEST_HIDDEN_LOG"]))
'''


def run_with_only(allowed, run: str, cwd, tmp_path, timeout=240):
    """Run ``run`` plus its fast form (:data:`FAST_FORMS`) with only ``allowed``
    distributions visible; ``(completed process, hidden imports "module dists" lines)``."""
    if run not in FAST_FORMS:
        raise KeyError(f"no fast form for {run!r}: add one to FAST_FORMS")
    words = shlex.split(run)
    if words[0] != "python":
        raise ValueError(f"{run!r} does not start with python")
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / "hidden.log"
    log.write_text("")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), ROOT]),
               ZKERNELS_TEST_ALLOWED_DISTS=json.dumps(sorted(allowed)),
               ZKERNELS_TEST_HIDDEN_LOG=str(log))
    proc = subprocess.run([sys.executable, *words[1:], *FAST_FORMS[run]], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=timeout)
    return proc, sorted(set(log.read_text().splitlines()))


def command_problem(command: str, project: dict, tmp_path, hide=()):
    """Why ``command`` would fail in a fresh venv (see [Note: what a quick-start command may
    import]), or None; ``hide``: distributions to take out of what it installs."""
    reqs, extras, run = parse_command(command)
    allowed = allowed_distributions(reqs, extras, project) - {_norm(h) for h in hide}
    cwd = tmp_path if run.startswith("python -m zkernels") else ROOT
    proc, hidden = run_with_only(allowed, run, cwd, tmp_path)
    if proc.returncode == 0:
        return None
    return (f"`{command}`: `{run}` exits {proc.returncode} with only what the command "
            f"installs; imports refused (module, distributions): {hidden}\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def test_parse_command_reads_both_readme_commands():
    demo, tests = readme_commands()
    assert parse_command(demo) == (["torch==2.13.0"], ["demo"], "python -m zkernels demo")
    assert parse_command(tests) == (["torch==2.13.0", "triton==3.6.0"], ["test"],
                                    "python -m pytest -q")
    with pytest.raises(ValueError, match="one part that runs"):
        parse_command("pip install torch && python a.py && python b.py")
    with pytest.raises(ValueError, match="not this project"):
        parse_command("pip install -e ../other && python a.py")


def test_allowed_distributions_follow_requirements():
    project = _pyproject()["project"]
    demo = allowed_distributions(["torch==2.13.0"], ["demo"], project)
    # The demo extra and what its packages need (matplotlib needs pillow), torch's own
    # requirements (sympy, filelock), but nothing only the test extra brings.
    assert {"torch", "numpy", "tqdm", "matplotlib", "pillow", "sympy", "filelock",
            "zkernels"} <= demo
    assert not {"triton", "pytest", "transformers", "deepspeed", "psutil"} & demo
    # A marker that is false here is not followed.
    assert "triton" not in allowed_distributions(
        ["torch"], None, project) | allowed_distributions(
        ["triton; platform_system == 'Plan9'"], None, project)


def test_readme_demo_command_imports_only_what_it_installs(tmp_path):
    # The README's first command (see [Note: what a quick-start command may import]).
    command = readme_commands()[0]
    assert command.endswith("python -m zkernels demo")
    problem = command_problem(command, _pyproject()["project"], tmp_path)
    assert problem is None, problem


def test_catches_demo_extra_without_safetensors(tmp_path):
    # The bug of issue 36: the demo extra without safetensors fails on a fresh venv (rank 0
    # writes the initial weights with it); the check must say so.
    command = readme_commands()[0]
    problem = command_problem(command, _pyproject()["project"], tmp_path,
                              hide=["safetensors"])
    assert problem is not None and "safetensors safetensors" in problem, problem
    # And the user sees rank 0's error once with the command again, not rank 1's lost peer
    # nor a launcher's summary ([Note: one report per failure] in zkernels/launch.py).
    assert problem.count("ModuleNotFoundError: No module named 'safetensors'") == 1, problem
    assert "rank 0 of 2 failed first:" in problem and "rank 1: failed after it" in problem
    assert "Connection closed by peer" not in problem and "ChildFailedError" not in problem
    assert "reproduce: cd " in problem and " -m zkernels demo --steps 1 " in problem, problem


def test_readme_test_command_collects_with_only_what_it_installs(tmp_path):
    # The second command: every test module and conftest imports with only the test extra
    # (what the tests import inside their bodies, CI's own venv checks: .ci/run).
    command = readme_commands()[1]
    assert command.endswith("python -m pytest -q")
    problem = command_problem(command, _pyproject()["project"], tmp_path)
    assert problem is None, problem
