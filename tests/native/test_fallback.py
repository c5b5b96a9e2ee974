"""Without the extension the package imports and works, choosing the reference backend."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent("""
    import logging, sys
    sys.modules["zkernels._C"] = None        # import zkernels._C now raises ImportError
    sys.modules["zkernels._C_nccl"] = None
    import torch, zkernels
    from zkernels import reference
    logging.basicConfig(level=logging.DEBUG, format="%(name)s %(message)s")
    assert not zkernels.ops.available("cpp")
    assert zkernels.ops.choose("adamw_step", torch.device("cpu")) == "reference"
    p, m, v, g = torch.randn(100), torch.zeros(100), torch.zeros(100), torch.randn(100)
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, step=1)
    zkernels.ops.adamw_step(p, g, m, v, **hyper)
    reference.adamw_step(rp, g, rm, rv, **hyper)
    assert torch.equal(p, rp)
    from zkernels.comm import nccl
    assert not nccl.AVAILABLE
    try:
        nccl.NcclComm()
    except RuntimeError as exc:
        assert "zkernels._C_nccl" in str(exc), exc
    else:
        raise AssertionError("NcclComm() without _C_nccl did not raise")
    import os
    os.environ["ZKERNELS_BACKEND"] = "cpp"
    try:
        zkernels.ops.adamw_step(p, g, m, v, **hyper)
    except RuntimeError as exc:
        assert "not available" in str(exc), exc
    else:
        raise AssertionError("ZKERNELS_BACKEND=cpp without the extension did not raise")
    print("FALLBACK-OK")
""")


def test_package_works_without_extension():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("ZKERNELS_BACKEND", None)
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FALLBACK-OK" in proc.stdout
    # the dispatcher says once, at debug level, which backend it chose
    assert "zkernels.ops.adamw_step on cpu tensors runs on the reference backend" in proc.stderr
