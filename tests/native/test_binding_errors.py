"""Bad input through the binding raises a Python exception naming the argument, never a
crash. The binding is called directly (zkernels._C), bypassing zkernels.ops' own checks."""
import pytest
import torch

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, step=1)


def _bufs(n=64):
    return [torch.zeros(n) for _ in range(4)]


def _call(C, p, g, m, v, **kw):
    args = dict(HYPER)
    args.update(kw)
    return C.cpu_adamw_step(p, g, m, v, **args)


def test_ok_baseline(native_C):
    assert _call(native_C, *_bufs()) in ("scalar", "avx2", "avx512")


@pytest.mark.parametrize("which,name", [(0, "param"), (2, "exp_avg"), (3, "exp_avg_sq")])
def test_wrong_state_dtype(native_C, which, name):
    bufs = _bufs()
    bufs[which] = bufs[which].double()
    with pytest.raises(TypeError, match=f"{name} must be float32, got float64"):
        _call(native_C, *bufs)


def test_wrong_grad_dtype(native_C):
    p, g, m, v = _bufs()
    with pytest.raises(TypeError, match="grad must be float32, bfloat16 or float16, got int32"):
        _call(native_C, p, g.int(), m, v)


def test_not_a_tensor(native_C):
    p, g, m, v = _bufs()
    with pytest.raises(TypeError, match="grad must be a torch.Tensor, got list"):
        _call(native_C, p, [0.0] * 64, m, v)


def test_non_contiguous(native_C):
    p, g, m, v = _bufs()
    with pytest.raises(ValueError, match="exp_avg must be contiguous"):
        _call(native_C, p, g, torch.zeros(128)[::2], v)


def test_size_mismatch(native_C):
    p, g, m, v = _bufs()
    with pytest.raises(ValueError, match="exp_avg_sq must have 64 elements"):
        _call(native_C, p, g, m, torch.zeros(63))
    with pytest.raises(ValueError, match="out must have 64 elements"):
        _call(native_C, p, g, m, v, out=torch.zeros(65, dtype=torch.bfloat16))


def test_device_check_without_cuda(native_C):
    # a meta tensor stands in for any non-CPU device on a machine without a GPU
    p, g, m, v = _bufs()
    with pytest.raises(ValueError, match="grad must be a CPU tensor, got device meta"):
        _call(native_C, p, torch.empty(64, device="meta"), m, v)


def test_found_inf_checks(native_C):
    p, g, m, v = _bufs()
    with pytest.raises(ValueError, match="found_inf must have 1 elements"):
        _call(native_C, p, g, m, v, found_inf=torch.zeros(2))
    with pytest.raises(TypeError, match="found_inf must be float32"):
        _call(native_C, p, g, m, v, found_inf=torch.zeros(1, dtype=torch.bool))


@pytest.mark.parametrize("kw,match", [
    (dict(step=0), "step must be >= 1"),
    (dict(beta1=1.0), r"beta1 must be in \[0, 1\)"),
    (dict(grad_scale=0.0), "grad_scale must be finite and > 0"),
    (dict(isa="sse9"), "isa must be one of"),
    (dict(num_threads=-1), "num_threads must be >= 0"),
])
def test_bad_scalars(native_C, kw, match):
    with pytest.raises(ValueError, match=match):
        _call(native_C, *_bufs(), **kw)


def test_forced_path_through_env_is_checked(native_C, monkeypatch):
    from zkernels import _cpu
    monkeypatch.setenv("ZKERNELS_CPU_ISA", "neon")
    p, g, m, v = _bufs()
    with pytest.raises(ValueError, match="isa must be one of"):
        _cpu.adamw_step(p, g, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, step=1)
