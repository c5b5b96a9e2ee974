"""sgd_step on every backend: against zkernels.reference (bit for bit), against
torch.optim.SGD (momentum, nesterov, dampening, weight decay) over 10 steps, the out copy bit
for bit, found_inf, grad_scale and the argument checks.

[Note: SGD tolerances]
As [Note: Lion tolerances] in test_lion.py: every backend performs the reference's fp32
operations in its order with no FMA contraction, so each buffer equals the reference bit for
bit (power-of-two grad scales). torch.optim.SGD's ``add(x, alpha=a)`` is one FMA in the
vectorized CPU kernel (two roundings in the scalar tail), so it differs from the reference by
<= 1 ulp per operation per step; with momentum < 1 the buffer is a contraction (each step's
error is scaled by the momentum afterwards), so 10 steps stay within ~10 ulp relative, inside
the fp32 row of the tolerance table (rtol=1e-5, ~84 ulp).
"""
import pytest
import torch

from zkernels import reference
from ..conftest import tol
from ._util import NUMPY_WARNINGS, assert_bits_equal, integer_values

pytestmark = NUMPY_WARNINGS

F32 = tol(torch.float32)

# (name, options): each runs 10 steps against the reference.
CONFIGS = {
    "momentum": dict(momentum=0.9),
    "nesterov_wd": dict(momentum=0.9, nesterov=True, weight_decay=1e-2),
    "dampening_wd_bf16_grad_scaled": dict(momentum=0.8, dampening=0.3, weight_decay=1e-3,
                                          grad_dtype=torch.bfloat16, grad_scale=1024.0),
    "plain_wd_fp16_out": dict(weight_decay=1e-2, out=torch.float16),
    "tensor_step_scale_found_inf_bf16_out": dict(momentum=0.9, step="tensor",
                                                 grad_scale="tensor", found_inf=True,
                                                 grad_dtype=torch.float16, out=torch.bfloat16),
}


def _param(n, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(device)


def _grad(step, n, device, scale=1.0):
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(n, generator=g) * scale).to(device)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_sgd_matches_reference_over_10_steps(impl, device, name):
    cfg = dict(CONFIGS[name])
    n = 10_007
    hyper = dict(lr=1e-2, momentum=cfg.pop("momentum", 0.0),
                 dampening=cfg.pop("dampening", 0.0), weight_decay=cfg.pop("weight_decay", 0.0),
                 nesterov=cfg.pop("nesterov", False))
    grad_dtype, out_dtype = cfg.pop("grad_dtype", torch.float32), cfg.pop("out", None)
    grad_scale, use_found_inf = cfg.pop("grad_scale", None), cfg.pop("found_inf", False)
    step_kind = cfg.pop("step", None)
    assert not cfg
    p = _param(n, device, 0)
    rp = p.clone()
    # garbage in the buffer before step 1: the first step must overwrite it, not read it
    buf = torch.full((n,), 123.0, device=device) if hyper["momentum"] else None
    rbuf = None if buf is None else buf.clone()
    out = None if out_dtype is None else torch.full((n,), 9.0, dtype=out_dtype, device=device)
    scale = 512.0 if grad_scale == "tensor" else grad_scale
    scale_arg = torch.tensor([512.0], device=device) if grad_scale == "tensor" else grad_scale
    for step in range(1, 11):
        grad = _grad(step, n, device, scale or 1.0).to(grad_dtype)
        found_inf = torch.zeros(1, device=device) if use_found_inf else None
        step_arg = torch.tensor([step], device=device) if step_kind == "tensor" else step
        impl("sgd_step")(p, grad, buf, step=step_arg, grad_scale=scale_arg, found_inf=found_inf,
                         out=out, **hyper)
        reference.sgd_step(rp, grad, rbuf, step=step, grad_scale=scale, **hyper)
        assert_bits_equal(p, rp)
        if buf is not None:
            assert_bits_equal(buf, rbuf)
        if out is not None:
            assert_bits_equal(out, p.to(out_dtype))


TORCH_CONFIGS = [dict(momentum=0.9), dict(momentum=0.9, nesterov=True),
                 dict(momentum=0.9, dampening=0.5, weight_decay=1e-2),
                 dict(momentum=0.5, nesterov=True, weight_decay=5e-2), dict(weight_decay=1e-2)]


def _against_torch(fn, device, cfg, steps=10, n=4099):
    """Runs ``fn`` (an sgd_step) and torch.optim.SGD side by side; yields both states."""
    p = _param(n, device, 3)
    ref = torch.nn.Parameter(p.clone())
    opt = torch.optim.SGD([ref], lr=1e-2, foreach=False, **cfg)
    buf = torch.zeros(n, device=device) if cfg.get("momentum", 0.0) else None
    for step in range(1, steps + 1):
        grad = _grad(step, n, device)
        fn(p, grad, buf, lr=1e-2, step=step, **cfg)
        ref.grad = grad.clone()
        opt.step()
        yield p, ref.detach(), buf, opt.state[ref].get("momentum_buffer")


@pytest.mark.parametrize("cfg", TORCH_CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_sgd_matches_torch_optim_over_10_steps(impl, device, cfg):
    for p, ref, buf, ref_buf in _against_torch(impl("sgd_step"), device, cfg):
        torch.testing.assert_close(p, ref, **F32)
        if buf is not None:
            torch.testing.assert_close(buf, ref_buf, **F32)


def test_sgd_torch_comparison_catches_dampening_on_the_first_step(device):
    # A buffer started as (1 - dampening) * g (instead of torch's clone of g) must fail.
    def wrong(p, grad, buf, *, step, **kw):
        return reference.sgd_step(p, grad, buf, step=step + 1, **kw)

    cfg = dict(momentum=0.9, dampening=0.5)
    p, ref, _, _ = next(_against_torch(wrong, device, cfg))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(p, ref, **F32)


@pytest.mark.parametrize("numel", [1, 2048, 2049])
def test_sgd_found_inf_changes_nothing(impl, device, numel):
    p, buf = _param(numel, device, 7), _param(numel, device, 8)
    out = torch.full((numel,), 3.0, dtype=torch.bfloat16, device=device)
    before = [t.clone() for t in (p, buf, out)]
    impl("sgd_step")(p, _grad(2, numel, device) * float("inf"), buf, lr=0.1, momentum=0.9,
                     weight_decay=0.1, step=torch.tensor([2], device=device),
                     found_inf=torch.ones(1, device=device),
                     grad_scale=torch.tensor([4.0], device=device), out=out)
    for a, b in zip((p, buf, out), before):
        assert_bits_equal(a, b)
    impl("sgd_step")(p, _grad(2, numel, device), buf, lr=0.1, momentum=0.9, step=2,
                     found_inf=torch.zeros(1, device=device))
    assert not torch.equal(p, before[0])  # the flag at 0 runs the step


def test_sgd_grad_scale_divides(impl, device):
    n = 3000
    p, q = _param(n, device, 11), _param(n, device, 11)
    b1, b2 = torch.zeros(n, device=device), torch.zeros(n, device=device)
    grad = integer_values(n, device)  # exact after a power-of-two scale
    for step in (1, 2):
        impl("sgd_step")(p, grad * 256, b1, lr=0.1, momentum=0.9, step=step, grad_scale=256.0)
        impl("sgd_step")(q, grad, b2, lr=0.1, momentum=0.9, step=step)
    assert torch.equal(p, q) and torch.equal(b1, b2)


def test_sgd_bad_arguments_name_the_argument(ops):
    p, b, g = torch.zeros(8), torch.zeros(8), torch.zeros(8)
    cases = [
        (dict(param=p.double()), TypeError, "param"),
        (dict(momentum_buffer=torch.zeros(7)), ValueError, "momentum_buffer"),
        (dict(momentum_buffer=b.half()), TypeError, "momentum_buffer"),
        (dict(momentum_buffer=None), ValueError, "momentum_buffer"),
        (dict(momentum=0.0), ValueError, "momentum_buffer"),  # a buffer that is never used
        (dict(momentum=-0.5), ValueError, "momentum"),
        (dict(grad=torch.zeros(9)), ValueError, "grad"),
        (dict(out=torch.zeros(4)), ValueError, "out"),
        (dict(found_inf=torch.zeros(2)), ValueError, "found_inf"),
        (dict(step=0), ValueError, "step"),
        (dict(step=torch.ones(2)), ValueError, "step"),
        (dict(nesterov=True, dampening=0.1), ValueError, "nesterov"),
        (dict(lr=float("nan")), ValueError, "lr"),
        (dict(dampening=float("inf")), ValueError, "dampening"),
    ]
    for change, exc, name in cases:
        kw = dict(param=p, grad=g, momentum_buffer=b, lr=1e-3, momentum=0.9, step=1)
        kw.update(change)
        with pytest.raises(exc, match=name):
            ops.sgd_step(kw.pop("param"), kw.pop("grad"), kw.pop("momentum_buffer"), **kw)


def test_sgd_on_an_opset_matches_the_public_op(backend, device):
    from zkernels import ops
    opset = ops.for_device(device, None if backend == "kernels" else backend)
    p, q = _param(3001, device, 21), _param(3001, device, 21)
    b, c = torch.zeros(3001, device=device), torch.zeros(3001, device=device)
    for step in (1, 2):
        grad = _grad(step, 3001, device)
        opset.sgd_step(p, grad, b, lr=0.1, momentum=0.9, nesterov=True, step=step)
        reference.sgd_step(q, grad, c, lr=0.1, momentum=0.9, nesterov=True, step=step)
    assert_bits_equal(p, q)
    assert_bits_equal(b, c)
    with pytest.raises(ValueError, match="momentum_buffer"):
        opset.sgd_step(p, grad, None, lr=0.1, momentum=0.9, step=3)
