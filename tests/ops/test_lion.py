"""lion_step on every backend: against zkernels.reference (bit for bit), the reference
against an independent lion-pytorch-style implementation, the out copy bit for bit, found_inf,
grad_scale and the argument checks.

[Note: Lion tolerances]
Each backend performs the reference's fp32 operations in the reference's order, one rounding
each: the C++ paths are built with -ffp-contract=off, the Triton launches pass
``enable_fp_fusion=False`` (no FMA contraction; tests/ops/test_compile_cuda.py checks the sm_90
PTX) and divide with ``tl.div_rn``, and the interpreter evaluates each operation in numpy fp32.
So every buffer must equal the reference bit for bit (the test grad scales are powers of two,
where the native multiply by 1/scale equals the division). The independent lion-pytorch
implementation uses torch's ``add(x, alpha=a)``, which the vectorized CPU kernel computes as one
FMA: its momentum differs from the reference's two roundings by <= 1 ulp per operation, a
contraction over steps (scaled by beta2 < 1 afterwards), so the fp32 row of the tolerance table
bounds it over 10 steps; the update is +-lr or 0, exact, so the params agree to the same
bound unless the sign of ``b1*m + (1-b1)*g`` flips on a value within one rounding of zero,
which would move a param by 2*lr and fail loudly (the random data here does not hit one).
"""
import pytest
import torch

from zkernels import reference
from ..conftest import tol
from ._util import NUMPY_WARNINGS, assert_bits_equal, integer_values

pytestmark = NUMPY_WARNINGS

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.99)
F32 = tol(torch.float32)

# (name, options): each runs 10 steps against the reference.
CONFIGS = {
    "plain": dict(),
    "wd_bf16_grad_scaled": dict(weight_decay=0.1, grad_dtype=torch.bfloat16, grad_scale=1024.0),
    "fp16_grad_tensor_scale_found_inf_bf16_out": dict(grad_dtype=torch.float16,
                                                      grad_scale="tensor", found_inf=True,
                                                      out=torch.bfloat16),
    "wd_fp16_out": dict(weight_decay=0.5, out=torch.float16),
    "betas_0": dict(beta1=0.0, beta2=0.0, out=torch.float32),
}


def _state(n, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(device), (0.1 * torch.randn(n, generator=g)).to(device)


def _grad(step, n, device, scale=1.0):
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(n, generator=g) * scale).to(device)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_lion_matches_reference_over_10_steps(impl, device, name):
    cfg = dict(CONFIGS[name])
    n = 10_007
    hyper = dict(HYPER, beta1=cfg.pop("beta1", HYPER["beta1"]),
                 beta2=cfg.pop("beta2", HYPER["beta2"]), weight_decay=cfg.pop("weight_decay", 0.0))
    grad_dtype, out_dtype = cfg.pop("grad_dtype", torch.float32), cfg.pop("out", None)
    grad_scale, use_found_inf = cfg.pop("grad_scale", None), cfg.pop("found_inf", False)
    assert not cfg
    p, m = _state(n, device, 0)
    rp, rm = p.clone(), m.clone()
    out = None if out_dtype is None else torch.full((n,), 9.0, dtype=out_dtype, device=device)
    scale = 512.0 if grad_scale == "tensor" else grad_scale
    scale_arg = torch.tensor([512.0], device=device) if grad_scale == "tensor" else grad_scale
    for step in range(1, 11):
        grad = _grad(step, n, device, scale or 1.0).to(grad_dtype)
        found_inf = torch.zeros(1, device=device) if use_found_inf else None
        impl("lion_step")(p, grad, m, grad_scale=scale_arg, found_inf=found_inf, out=out, **hyper)
        reference.lion_step(rp, grad, rm, grad_scale=scale, **hyper)
        assert_bits_equal(p, rp)
        assert_bits_equal(m, rm)
        if out is not None:
            assert_bits_equal(out, p.to(out_dtype))


def _lion_pytorch_step(p, grad, exp_avg, lr, beta1, beta2, weight_decay):
    """lucidrains/lion-pytorch's update_fn, as written there."""
    p.data.mul_(1.0 - lr * weight_decay)
    update = exp_avg.clone().mul_(beta1).add(grad, alpha=1.0 - beta1).sign_()
    p.add_(update, alpha=-lr)
    exp_avg.mul_(beta2).add_(grad, alpha=1.0 - beta2)


def _run_both(reference_betas, steps=10, n=4099):
    p, m = _state(n, torch.device("cpu"), 3)
    m.zero_()  # lion-pytorch starts the momentum at zero
    ip, im = p.clone(), m.clone()
    diffs = []
    for step in range(1, steps + 1):
        grad = _grad(step, n, torch.device("cpu"))
        b1, b2 = reference_betas
        reference.lion_step(p, grad, m, lr=1e-3, beta1=b1, beta2=b2, weight_decay=0.1)
        _lion_pytorch_step(ip, grad, im, 1e-3, 0.9, 0.99, 0.1)
        diffs.append((p.clone(), ip.clone(), m.clone(), im.clone()))
    return diffs


def test_lion_reference_matches_lion_pytorch_over_10_steps():
    for p, ip, m, im in _run_both((0.9, 0.99)):
        torch.testing.assert_close(p, ip, **F32)
        torch.testing.assert_close(m, im, **F32)


def test_lion_comparison_catches_swapped_betas():
    p, ip, m, im = _run_both((0.99, 0.9), steps=3)[-1]
    with pytest.raises(AssertionError):
        torch.testing.assert_close(p, ip, **F32)


@pytest.mark.parametrize("numel", [1, 2048, 2049])
def test_lion_found_inf_changes_nothing(impl, device, numel):
    p, m = _state(numel, device, 7)
    out = torch.full((numel,), 3.0, dtype=torch.bfloat16, device=device)
    before = [t.clone() for t in (p, m, out)]
    impl("lion_step")(p, _grad(1, numel, device) * float("inf"), m,
                      found_inf=torch.ones(1, device=device),
                      grad_scale=torch.tensor([4.0], device=device), out=out, weight_decay=0.1,
                      **HYPER)
    for a, b in zip((p, m, out), before):
        assert_bits_equal(a, b)
    impl("lion_step")(p, _grad(1, numel, device), m, found_inf=torch.zeros(1, device=device),
                      **HYPER)
    assert not torch.equal(m, before[1])  # the flag at 0 runs the step


def test_lion_grad_scale_divides(impl, device):
    n = 3000
    (p, m), (q, k) = _state(n, device, 11), _state(n, device, 11)
    grad = integer_values(n, device)  # exact after a power-of-two scale
    impl("lion_step")(p, grad * 256, m, grad_scale=256.0, **HYPER)
    impl("lion_step")(q, grad, k, **HYPER)
    assert torch.equal(p, q) and torch.equal(m, k)


def test_lion_update_is_sign_times_lr(impl, device):
    # With beta1 = 0 the update is sign(g): every param moves by exactly lr or stays (g = 0).
    n = 5000
    p = torch.zeros(n, device=device)
    m = torch.zeros(n, device=device)
    grad = integer_values(n, device, high=2)
    impl("lion_step")(p, grad, m, lr=0.25, beta1=0.0, beta2=0.5)
    assert torch.equal(p, -0.25 * torch.sign(grad))
    assert torch.equal(m, 0.5 * grad)


def test_lion_bad_arguments_name_the_argument(ops):
    p, m, g = torch.zeros(8), torch.zeros(8), torch.zeros(8)
    cases = [
        (dict(param=p.double()), TypeError, "param"),
        (dict(exp_avg=torch.zeros(7)), ValueError, "exp_avg"),
        (dict(exp_avg=m.half()), TypeError, "exp_avg"),
        (dict(grad=torch.zeros(9)), ValueError, "grad"),
        (dict(grad=torch.zeros(8, dtype=torch.int32)), TypeError, "grad"),
        (dict(out=torch.zeros(4)), ValueError, "out"),
        (dict(found_inf=torch.zeros(2)), ValueError, "found_inf"),
        (dict(grad_scale=torch.ones(2)), ValueError, "grad_scale"),
        (dict(beta1=1.5), ValueError, "beta1"),
        (dict(beta2=-0.1), ValueError, "beta2"),
        (dict(lr=float("nan")), ValueError, "lr"),
        (dict(weight_decay=float("inf")), ValueError, "weight_decay"),
    ]
    for change, exc, name in cases:
        kw = dict(param=p, grad=g, exp_avg=m, lr=1e-3)
        kw.update(change)
        with pytest.raises(exc, match=name):
            ops.lion_step(kw.pop("param"), kw.pop("grad"), kw.pop("exp_avg"), **kw)
    with pytest.raises(ValueError, match="param"):
        ops.lion_step(torch.zeros(2, 4), torch.zeros(8), m, lr=1e-3)


def test_lion_on_an_opset_matches_the_public_op(backend, device):
    from zkernels import ops
    opset = ops.for_device(device, None if backend == "kernels" else backend)
    (p, m), (q, k) = _state(3001, device, 21), _state(3001, device, 21)
    grad = _grad(1, 3001, device)
    opset.lion_step(p, grad, m, weight_decay=0.1, **HYPER)
    reference.lion_step(q, grad, k, weight_decay=0.1, **HYPER)
    assert_bits_equal(p, q)
    assert_bits_equal(m, k)
    with pytest.raises(ValueError, match="exp_avg"):
        opset.lion_step(p, grad, m[:-1], **HYPER)
