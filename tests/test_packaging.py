"""What the README promises about installing: triton is an extra, not a dependency (the demo's
install pulls none), the test extra pins the Triton version the README says is tested, the
package imports and trains without triton, and CI runs exactly the README's test command."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*parts):
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def _project():
    tomllib = pytest.importorskip("tomllib")    # Python >= 3.11
    return tomllib.loads(_read("pyproject.toml"))["project"]


def _name(req: str) -> str:
    return re.split(r"[\s;<>=!~\[]", req, maxsplit=1)[0].lower()


def test_triton_is_an_extra_and_the_test_extra_pins_the_tested_version():
    project = _project()
    extras = project["optional-dependencies"]
    assert "triton" not in {_name(r) for r in project["dependencies"]}
    assert "triton" not in {_name(r) for r in extras["demo"]}
    assert any(_name(r) == "triton" for r in extras["triton"])
    pins = [r for r in extras["test"] if _name(r) == "triton"]
    assert len(pins) == 1 and "==" in pins[0]
    version = pins[0].split("==")[1].split(";")[0].strip()
    readme = _read("README.md")
    assert f"Tested with Triton {version}" in readme
    assert f"triton=={version}" in _test_command(readme)


def _test_command(readme: str) -> str:
    lines = [line.strip() for line in readme.splitlines()
             if line.strip().startswith("pip install") and '".[test]"' in line]
    assert len(lines) == 1, lines
    return lines[0]


def test_ci_runs_the_readme_commands():
    # .ci/run runs each quick-start command through the extractor tests/test_readme.py uses:
    # the demo's in a venv of its own first, then the test command.
    ci = _read(".ci", "run")
    first = ci.index('eval "$(python3 .ci/readme_commands.py 1)"')
    assert ci.rindex("python3 -m venv .venv-ci-demo", 0, first) < first
    second = ci.index('eval "$(python3 .ci/readme_commands.py 2)"')
    assert first < ci.index("python3 -m venv .venv-ci\n") < second
    readme = _read("README.md")
    demo = [line.strip() for line in readme.splitlines()
            if line.strip().startswith("pip install") and '".[demo]"' in line]
    assert len(demo) == 1 and demo[0].endswith("python -m zkernels demo")


BLOCK_TRITON = """
import importlib.abc, sys
class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError("No module named 'triton'", name="triton")
sys.meta_path.insert(0, NoTriton())
for name in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
    del sys.modules[name]
"""

TRAIN = """
import torch
import zkernels as zk
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
opt = zk.ZeroOptimizer(model, stage=2, lr=1e-2)
x = torch.randn(16, 8)
losses = []
for _ in range(5):
    loss = model(x).square().mean()
    opt.backward(loss)
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
flat = zk.ops.flatten([p.detach() for p in model.parameters()], dtype=torch.float32)
assert "triton" not in sys.modules and losses[-1] < losses[0], losses
print("ok", flat.numel())
"""


def test_package_trains_without_triton():
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("TRITON_INTERPRET", None)
    env.pop("ZKERNELS_BACKEND", None)
    proc = subprocess.run([sys.executable, "-c", BLOCK_TRITON + TRAIN], capture_output=True,
                          text=True, env=env, timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.startswith("ok 81"), proc.stderr[-3000:]


@pytest.mark.parametrize("path", ["out.png", "hf_trainer_out/final/config.json",
                                  "gpt.safetensors"])
def test_run_outputs_in_the_root_are_ignored(path):
    # What the README's commands write when run from the repository root (demo --plot
    # out.png, examples/hf_trainer.py's default --output-dir, checkpoint consolidate) never
    # shows up as a file to commit.
    if not os.path.exists(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout")
    res = subprocess.run(["git", "check-ignore", "--no-index", "-q", path], cwd=ROOT)
    assert res.returncode == 0, f"{path} is not ignored by .gitignore"


def test_sources_named_like_run_outputs_are_not_ignored():
    # The patterns are anchored at the root: a tracked file of the same kind deeper down
    # (a test fixture, an example's figure) stays visible.
    if not os.path.exists(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout")
    for path in ("tests/checkpoint/fixture.safetensors", "benchmarks/out.png"):
        res = subprocess.run(["git", "check-ignore", "--no-index", "-q", path], cwd=ROOT)
        assert res.returncode == 1, f"{path} is ignored"
