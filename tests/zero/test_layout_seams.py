"""zkernels/zero/ shows the design ([Note: parameters and state]): planning/ imports nothing
of the other sub-packages; gradients/ reaches into the state side only for its gradient
sink; parameters/ imports nothing of state/ (stage 3's host and disk shard storages are
state-side objects injected into it); nothing below the optimizer imports it. The edges left
between the sub-packages (the update engine reads the units; the gradient strategies fill
the state side's gradient sink) are listed here, so a new one is a decision, not an
accident."""
import ast
from pathlib import Path

ZERO = Path(__file__).resolve().parents[2] / "zkernels" / "zero"
SUBPACKAGES = ("planning", "parameters", "gradients", "state")
ALLOWED = {
    "planning": set(),
    # Stage 3's offloaded parameter shards are injected storage objects of the state side
    # (state/param_offload.py, state/param_nvme.py: [Note: shard storage]).
    "parameters": {"planning"},
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


def test_state_side_asks_the_parameter_side_instead_of_testing_its_type():
    """The update engine asks ``unit.shard`` where its bytes live ([Note: shard storage]);
    none tests ``isinstance`` against a class of parameters/."""
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


def _declared(protocol) -> set:
    """The members a protocol declares (annotations, methods, properties)."""
    own = set(getattr(protocol, "__annotations__", {}))
    own |= {n for n in vars(protocol) if not n.startswith("_")}
    return own


def _reads_of(path: Path, receivers) -> list:
    """``(line, receiver, attribute)`` for every ``<receiver>.<attribute>`` in ``path``, the
    receiver an ``ast.Name`` in ``receivers`` or ``self.<name>``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        name = v.id if isinstance(v, ast.Name) else (
            v.attr if isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name)
            and v.value.id == "self" else None)
        if name in receivers:
            out.append((node.lineno, name, node.attr))
    return out


def _introspections_of(path: Path, receivers) -> list:
    """``(line, call)`` for every ``getattr`` / ``hasattr`` / ``setattr`` / ``vars`` /
    ``delattr`` whose first argument is a receiver (``opt``, ``self.opt``, ...): duck typing
    around the declared view."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr", "delattr", "vars")
                and node.args):
            continue
        a = node.args[0]
        name = a.id if isinstance(a, ast.Name) else (
            a.attr if isinstance(a, ast.Attribute) and isinstance(a.value, ast.Name)
            and a.value.id == "self" else None)
        if name in receivers:
            out.append((node.lineno, f"{node.func.id}({name}, ...)"))
    return out


def test_checkpoints_read_the_optimizer_through_the_declared_view():
    """[Note: the declared checkpoint view]: the checkpoint package and state_dict.py touch
    the optimizer (``opt``), its units (``u``, ``unit``) and their state (``z``) only through
    what ``CheckpointSource``, ``CheckpointUnit`` and ``CheckpointUnitState`` declare, and the
    optimizer and its units implement them."""
    from zkernels.zero.checkpoint_view import (CheckpointSource, CheckpointUnit,
                                               CheckpointUnitState)
    allowed = {"opt": _declared(CheckpointSource), "u": _declared(CheckpointUnit),
               "unit": _declared(CheckpointUnit), "z": _declared(CheckpointUnitState)}
    # Every module of the checkpoint package (save/load hand ``opt`` to the view only).
    readers = sorted((ZERO.parent / "checkpoint").glob("*.py")) + [
        ZERO / "state" / "state_dict.py"]
    bad = []
    for path in readers:
        for line, call in _introspections_of(path, set(allowed)):
            bad.append(f"{path.name}:{line} {call}")
        for line, who, attr in _reads_of(path, set(allowed)):
            if attr not in allowed[who]:
                bad.append(f"{path.name}:{line} {who}.{attr}")
    assert not bad, f"undeclared members read: {bad}"
    assert {"counters", "checkpoint_comm", "zero_units"} <= allowed["opt"]
    assert {"read_state", "write_state"} <= allowed["z"]


def test_the_optimizer_implements_the_checkpoint_view():
    import torch
    from zkernels import ZeroOptimizer
    from zkernels.zero.checkpoint_view import (CheckpointSource, CheckpointUnit,
                                               CheckpointUnitState)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    for stage in (1, 3):
        opt = ZeroOptimizer(model if stage == 1 else
                            torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)),
                            stage=stage)
        assert isinstance(opt, CheckpointSource)
        assert all(isinstance(u, CheckpointUnit) for u in opt.units)
        assert all(isinstance(z, CheckpointUnitState) for z in opt.zero_units)
        # Stage 3's parameters are empty between uses: the units still know their shapes.
        assert sorted(tuple(s) for u in opt.units for s in u.shapes) == \
            [(2,), (2, 4), (4,), (4, 4)]
        step, tensors = opt.zero_units[0].read_state()
        assert step == 0 and len(tensors) == 3
        assert opt.counters() == {"num_steps": 0, "overflow_skips": 0, "loss_scaler": None}
