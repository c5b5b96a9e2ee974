"""zkernels/zero/ shows the design ([Note: parameters and state]): planning/ imports nothing
of the other sub-packages; gradients/ reaches into the state side only for its gradient
sink; nothing below the optimizer imports it. The edges left between the sub-packages (stage
3's host-sharded parameters use the state side's copy engine; the update engine reads the
units; the gradient strategies fill the state side's gradient sink) are listed here, so a new
one is a decision, not an accident."""
import ast
from pathlib import Path

ZERO = Path(__file__).resolve().parents[2] / "zkernels" / "zero"
SUBPACKAGES = ("planning", "parameters", "gradients", "state")
ALLOWED = {
    "planning": set(),
    "parameters": {"planning", "state.transfer"},
    # The gradient strategies' default sink is the state side's one GradSink (grad_sink.py).
    "gradients": {"planning", "parameters", "state.grad_sink"},
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


def test_state_side_asks_the_parameter_side_instead_of_testing_its_type():
    """The update engine reads ``unit.gather.shard_on_host`` (the parameter side says where
    its shard lives); none tests ``isinstance`` against a class of parameters/."""
    bad = []
    for f in sorted((ZERO / "state").glob("*.py")):
        tree = ast.parse(f.read_text())
        names = {a.asname or a.name for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.level == 2
                 and (node.module or "").startswith("parameters") for a in node.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                used = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                if used & names:
                    bad.append(f"state/{f.name}:{node.lineno} isinstance(..., {sorted(used)})")
    assert not bad, bad
