"""benchmarks/README.md stays about what exists: every benchmark it names is in benchmarks/,
every benchmark script there is named in it, and every repository path its prose cites
exists (earlier runs and the code they measured live in docs/benchmark-history.md)."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMED = re.compile(r"(?<![\w/.])benchmarks/(\w+\.(?:py|sh))")
PATH = re.compile(r"(?<![\w/.])((?:zkernels|csrc|tests|benchmarks|python|docs)/[\w./-]*\w)")


def _prose(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def _readme(root=ROOT) -> str:
    with open(os.path.join(root, "benchmarks", "README.md"), encoding="utf-8") as f:
        return f.read()


def missing_benchmarks(text: str, root=ROOT) -> list:
    """Benchmarks named ``benchmarks/NAME`` in ``text`` that are not in benchmarks/."""
    return sorted({n for n in NAMED.findall(text)
                   if not os.path.isfile(os.path.join(root, "benchmarks", n))})


def unnamed_benchmarks(text: str, root=ROOT) -> list:
    """Benchmark scripts in benchmarks/ (``*.py``, ``*.sh``; helpers start with ``_``) that
    ``text`` never names as ``benchmarks/NAME``."""
    named = set(NAMED.findall(text))
    return sorted(f for f in os.listdir(os.path.join(root, "benchmarks"))
                  if f.endswith((".py", ".sh")) and not f.startswith("_") and f not in named)


def missing_paths(text: str, root=ROOT) -> list:
    """Repository paths cited in ``text``'s prose that do not exist."""
    return sorted({p for p in PATH.findall(_prose(text))
                   if not os.path.exists(os.path.join(root, p))})


def test_readme_names_the_benchmarks_there_are():
    text = _readme()
    assert missing_benchmarks(text) == []
    assert unnamed_benchmarks(text) == []
    assert missing_paths(text) == []


def test_the_checks_catch_a_stale_readme(tmp_path):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "zero_step.py").write_text("")
    (tmp_path / "benchmarks" / "new_bench.py").write_text("")
    (tmp_path / "benchmarks" / "_helper.py").write_text("")
    text = ("`python benchmarks/zero_step.py`, `python benchmarks/gone.py`; see\n"
            "`tests/zero/_gone_checks.py` and `benchmarks/zero_step.py::main`.\n"
            "```\ncp zkernels/_C*.so elsewhere/\n```\n")
    assert missing_benchmarks(text, tmp_path) == ["gone.py"]
    assert unnamed_benchmarks(text, tmp_path) == ["new_bench.py"]
    assert missing_paths(text, tmp_path) == ["benchmarks/gone.py", "tests/zero/_gone_checks.py"]
