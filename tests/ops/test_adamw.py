"""adamw_step and sum_squares on every backend: against zkernels.reference (tol), against
torch.optim.AdamW / Adam over 10 steps, and bit for bit where the result is a cast."""
import math

import numpy as np
import pytest
import torch

from zkernels import reference
from zkernels.reference import adamw as ref_adamw
from ..conftest import tol
from .conftest import FLOATS
from ._util import NUMPY_WARNINGS, assert_bits_equal, integer_values

pytestmark = NUMPY_WARNINGS

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
F32 = tol(torch.float32)

# (name, options): each runs 10 steps against the reference.
CONFIGS = {
    "adamw": dict(weight_decay=0.01),
    "adam_l2_bf16_grad_scaled": dict(weight_decay=0.01, decoupled=False, grad_dtype=torch.bfloat16,
                                     grad_scale=1024.0),
    "fp16_grad_device_scalars_bf16_out": dict(grad_dtype=torch.float16, grad_scale="tensor",
                                              step="tensor", found_inf=True,
                                              out=torch.bfloat16),
    "wd_step_tensor_fp16_out": dict(weight_decay=0.1, step="tensor", out=torch.float16),
    "l2_no_decay_fp32_out": dict(decoupled=False, out=torch.float32),
    "small_beta1": dict(weight_decay=0.01, beta1=0.3, beta2=0.5),
}


class Run:
    """One optimizer state (param, grad, moments, out) stepped by one implementation."""

    def __init__(self, n, device, seed, grad_dtype=torch.float32, out=None):
        g = torch.Generator().manual_seed(seed)
        self.param = torch.randn(n, generator=g).to(device)
        self.exp_avg = torch.zeros(n, device=device)
        self.exp_avg_sq = torch.zeros(n, device=device)
        self.grad_dtype = grad_dtype
        self.out = None if out is None else torch.full((n,), 9.0, dtype=out, device=device)

    def step(self, fn, step, grad, *, grad_scale=None, step_kind=None, found_inf=None, **hyper):
        device = self.param.device
        if grad_scale == "tensor":
            grad_scale = torch.tensor([512.0], device=device)
        step_arg = torch.tensor([float(step)], device=device) if step_kind == "tensor" else step
        fn(self.param, grad.to(self.grad_dtype), self.exp_avg, self.exp_avg_sq, step=step_arg,
           grad_scale=grad_scale, found_inf=found_inf, out=self.out, **hyper)


def grad_for(step, n, device, scale=1.0):
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(n, generator=g) * scale).to(device)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_adamw_matches_reference_over_10_steps(impl, device, name):
    cfg = dict(CONFIGS[name])
    n = 10_007
    hyper = dict(HYPER)
    hyper.update(beta1=cfg.pop("beta1", hyper["beta1"]), beta2=cfg.pop("beta2", hyper["beta2"]),
                 weight_decay=cfg.pop("weight_decay", 0.0), decoupled=cfg.pop("decoupled", True))
    grad_dtype, out = cfg.pop("grad_dtype", torch.float32), cfg.pop("out", None)
    grad_scale, step_kind = cfg.pop("grad_scale", None), cfg.pop("step", None)
    use_found_inf = cfg.pop("found_inf", False)
    assert not cfg
    mine, ref = Run(n, device, 0, grad_dtype, out), Run(n, device, 0, grad_dtype, out)
    for step in range(1, 11):
        scale = 1.0 if grad_scale is None else (512.0 if grad_scale == "tensor" else grad_scale)
        grad = grad_for(step, n, device, scale)
        for run, fn in ((mine, impl("adamw_step")), (ref, reference.adamw_step)):
            found_inf = torch.zeros(1, device=device) if use_found_inf else None
            run.step(fn, step, grad, grad_scale=grad_scale, step_kind=step_kind,
                     found_inf=found_inf, **hyper)
        for attr in ("param", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(getattr(mine, attr), getattr(ref, attr), **F32,
                                       msg=lambda m: f"{attr} after step {step}: {m}")
        if out is not None:
            assert_bits_equal(mine.out, mine.param.to(out))


def _ieee_sqrt_bits(bits: torch.Tensor) -> torch.Tensor:
    """int32 bits of numpy's fp32 sqrt (the IEEE instruction) of the floats with ``bits``."""
    x = bits.view(torch.float32).numpy()
    with np.errstate(invalid="ignore"):
        return torch.from_numpy(np.sqrt(x)).view(torch.int32)


def test_reference_sqrt_is_correctly_rounded(device, monkeypatch):
    """[Note: correctly rounded sqrt]: ``sqrt_rn`` gives the IEEE root's bits on every float in
    [1, 4) (every other binade pair is these scaled by a power of 4, roots by a power of 2),
    every subnormal, random bit patterns and special values (NaN positions only), also in
    pieces (a small ``SQRT_CHUNK``) and of a 2-D non-contiguous input. The check catches a
    root 1 ulp off (what torch's own fp32 sqrt gives for ~0.7% of inputs with MKL on
    AVX-512)."""
    ranges = [(0x3F800000, 0x40800000), (0, 0x00800000)]  # [1, 4), +0 and the subnormals
    for lo, hi in ranges:
        for start in range(lo, hi, 1 << 22):
            bits = torch.arange(start, min(start + (1 << 22), hi), dtype=torch.int32)
            got = ref_adamw.sqrt_rn(bits.view(torch.float32).to(device)).cpu()
            assert torch.equal(got.view(torch.int32), _ieee_sqrt_bits(bits)), start
    monkeypatch.setattr(ref_adamw, "SQRT_CHUNK", 1000)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (300, 17), generator=torch.Generator()
                         .manual_seed(5), dtype=torch.int32)
    bits[0, :4] = torch.tensor([0x7F800000, -0x80000000, -0x00800000, 0x7FC00000])
    x = bits.view(torch.float32).t()  # non-contiguous, 17 x 300
    got = ref_adamw.sqrt_rn(x.to(device)).cpu()
    want = _ieee_sqrt_bits(bits.t().contiguous()).view(torch.float32)
    assert got.shape == x.shape and got.dtype == torch.float32
    assert torch.equal(got.isnan(), want.isnan())
    assert_bits_equal(got[~got.isnan()], want[~want.isnan()])
    ok = got.isfinite() & (got > 0)
    nudged = got[ok]
    nudged[7] = torch.nextafter(nudged[7], torch.tensor(math.inf))  # one root 1 ulp up
    with pytest.raises(AssertionError):
        assert_bits_equal(nudged, want[ok])


@pytest.mark.parametrize("decoupled", [True, False])
def test_adamw_matches_torch_optim_over_10_steps(impl, device, decoupled):
    n, wd = 4099, 0.05
    mine = Run(n, device, 3)
    torch_param = torch.nn.Parameter(mine.param.clone())
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([torch_param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
              eps=HYPER["eps"], weight_decay=wd)
    for step in range(1, 11):
        grad = grad_for(step, n, device)
        mine.step(impl("adamw_step"), step, grad, weight_decay=wd, decoupled=decoupled, **HYPER)
        torch_param.grad = grad.clone()
        opt.step()
        state = opt.state[torch_param]
        torch.testing.assert_close(mine.param, torch_param.detach(), **F32)
        torch.testing.assert_close(mine.exp_avg, state["exp_avg"], **F32)
        torch.testing.assert_close(mine.exp_avg_sq, state["exp_avg_sq"], **F32)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_adamw_awkward_size_and_out_cast(impl, device, out_dtype):
    n = 278_011
    mine, ref = Run(n, device, 5, out=out_dtype), Run(n, device, 5, out=out_dtype)
    for step in (1, 2):
        grad = grad_for(step, n, device)
        mine.step(impl("adamw_step"), step, grad, weight_decay=0.01, **HYPER)
        ref.step(reference.adamw_step, step, grad, weight_decay=0.01, **HYPER)
    torch.testing.assert_close(mine.param, ref.param, **F32)
    assert_bits_equal(mine.out, mine.param.to(out_dtype))


@pytest.mark.parametrize("numel", [1, 2048, 2049])
def test_adamw_found_inf_changes_nothing(impl, device, numel):
    run = Run(numel, device, 7, out=torch.bfloat16)
    run.step(impl("adamw_step"), 1, grad_for(1, numel, device), **HYPER)
    before = [t.clone() for t in (run.param, run.exp_avg, run.exp_avg_sq, run.out)]
    run.step(impl("adamw_step"), 2, grad_for(2, numel, device) * float("inf"),
             found_inf=torch.ones(1, device=device), grad_scale="tensor", step_kind="tensor",
             weight_decay=0.1, **HYPER)
    for a, b in zip((run.param, run.exp_avg, run.exp_avg_sq, run.out), before):
        assert_bits_equal(a, b)


def test_adamw_grad_scale_divides(impl, device):
    n = 3000
    scaled, plain = Run(n, device, 11), Run(n, device, 11)
    grad = integer_values(n, device)  # exact after a power-of-two scale
    scaled.step(impl("adamw_step"), 1, grad * 256, grad_scale=256.0, **HYPER)
    plain.step(impl("adamw_step"), 1, grad, **HYPER)
    assert torch.equal(scaled.param, plain.param)
    assert torch.equal(scaled.exp_avg_sq, plain.exp_avg_sq)


def test_adamw_step_tensor_matches_int_at_large_step(impl, device):
    # In-kernel bias corrections (fp64 powers) agree with the host's for a late step.
    n = 100
    a, b = Run(n, device, 13), Run(n, device, 13)
    grad = grad_for(1, n, device)
    a.step(impl("adamw_step"), 123_457, grad, step_kind="tensor", **HYPER)
    b.step(impl("adamw_step"), 123_457, grad, **HYPER)
    torch.testing.assert_close(a.param, b.param, **F32)


@pytest.mark.parametrize("dtype", FLOATS)
def test_sum_squares_exact_on_integers(impl, device, dtype):
    sizes = [0, 1, 4095, 4096, 4097, 278_011, 13]
    ts = [integer_values(n, device, dtype, seed=i, high=3) for i, n in enumerate(sizes)]
    got = impl("sum_squares")(ts)
    expected = reference.sum_squares(ts)
    assert got.dtype == torch.float32 and got.dim() == 0 and got.device.type == device.type
    assert torch.equal(got, expected)
    assert torch.equal(impl("sum_squares")(ts), got)  # deterministic


def test_sum_squares_mixed_dtypes(impl, device):
    ts = [integer_values(n, device, dt, seed=n)
          for n, dt in ((5000, torch.float32), (4097, torch.bfloat16), (3, torch.float16),
                        (0, torch.bfloat16), (9000, torch.float32))]
    assert torch.equal(impl("sum_squares")(ts), reference.sum_squares(ts))


def test_sum_squares_random_within_tolerance(impl, device):
    g = torch.Generator().manual_seed(2)
    ts = [torch.randn(n, generator=g).to(device) for n in (100_003, 7, 4096)]
    exact = sum(float(t.double().pow(2).sum()) for t in ts)
    got = float(impl("sum_squares")(ts))
    assert math.isclose(got, exact, rel_tol=F32["rtol"])


def test_sum_squares_empty(impl, device):
    assert float(impl("sum_squares")([torch.empty(0, device=device)])) == 0.0
    assert float(impl("sum_squares")([])) == 0.0


def test_adamw_bad_arguments(ops):
    n = 8
    p, g, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n)
    kw = dict(step=1, **HYPER)
    with pytest.raises(TypeError, match="param"):
        ops.adamw_step(p.bfloat16(), g, m, v, **kw)
    with pytest.raises(ValueError, match="param"):
        ops.adamw_step(p.view(2, 4), g, m, v, **kw)
    with pytest.raises(ValueError, match="grad"):
        ops.adamw_step(p, torch.zeros(n + 1), m, v, **kw)
    with pytest.raises(ValueError, match="grad"):
        ops.adamw_step(p, torch.zeros(n, device="meta"), m, v, **kw)
    with pytest.raises(ValueError, match="exp_avg"):
        ops.adamw_step(p, g, torch.zeros(2, n)[:, 0], v, **kw)
    with pytest.raises(TypeError, match="exp_avg_sq"):
        ops.adamw_step(p, g, m, v.half(), **kw)
    with pytest.raises(ValueError, match="out"):
        ops.adamw_step(p, g, m, v, out=torch.zeros(n - 1), **kw)
    with pytest.raises(TypeError, match="found_inf"):
        ops.adamw_step(p, g, m, v, found_inf=torch.zeros(1, dtype=torch.int32), **kw)
    with pytest.raises(ValueError, match="step"):
        ops.adamw_step(p, g, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, step=0)
    with pytest.raises(ValueError, match="beta1"):
        ops.adamw_step(p, g, m, v, lr=1e-3, beta1=1.0, beta2=0.999, eps=1e-8, step=1)
    with pytest.raises(ValueError, match="grad_scale"):
        ops.adamw_step(p, g, m, v, grad_scale=torch.ones(2), **kw)


def test_sum_squares_bad_arguments(ops):
    with pytest.raises(TypeError, match="tensors"):
        ops.sum_squares(torch.ones(3))
    with pytest.raises(ValueError, match=r"tensors\[1\]"):
        ops.sum_squares([torch.ones(3), torch.ones(3, 2).t()])
    with pytest.raises(TypeError, match=r"tensors\[0\]"):
        ops.sum_squares([torch.ones(3, dtype=torch.int64)])
