"""zkernels/zero/ shows the design ([Note: parameters and state]): planning/ imports nothing
of the other sub-packages; gradients/ never reaches into the state side; nothing below the
optimizer imports it. The edges left between parameters/ and state/ (stage 3's host-sharded
parameters use the state side's copy engine; the update strategies build the gather policies
and read the units) are listed here, so a new one is a decision, not an accident."""
import ast
from pathlib import Path

ZERO = Path(__file__).resolve().parents[2] / "zkernels" / "zero"
SUBPACKAGES = ("planning", "parameters", "gradients", "state")
ALLOWED = {
    "planning": set(),
    "parameters": {"planning", "state.transfer"},
    "gradients": {"planning", "parameters"},
    "state": {"planning", "parameters"},
}


def _imports(path: Path):
    """Sub-package targets ('state', 'state.transfer', ...) of a module's relative imports."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 2 and node.module:
            yield node.module


def test_subpackages_import_only_downward():
    bad = []
    for pkg in SUBPACKAGES:
        files = sorted((ZERO / pkg).glob("*.py"))
        assert files, f"zkernels/zero/{pkg}/ is missing"
        for f in files:
            for target in _imports(f):
                top = target.split(".")[0]
                if top == pkg:
                    continue
                if top in ("optimizer", "stats") or not (
                        top in ALLOWED[pkg] or target in ALLOWED[pkg]):
                    bad.append(f"{pkg}/{f.name} imports ..{target}")
    assert not bad, bad


def test_no_module_left_flat():
    flat = sorted(p.name for p in ZERO.glob("*.py"))
    assert flat == ["__init__.py", "optimizer.py", "stats.py"], flat
