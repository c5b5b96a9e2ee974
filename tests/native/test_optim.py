"""The native element-wise optimizers (csrc/optim through zkernels._C.cpu_optimizer_step and
zkernels._cpu.optimizer_step) against the reference bit for bit, every SIMD path forced in
turn: Lion and SGD against zkernels.reference (see [Note: Lion tolerances] in
tests/ops/test_lion.py), torch.optim.SGD to round-off; AdEMAMix against Seam 3's op order
written here with separate torch ops and sqrt_rn; the bf16/fp16 out copy bit for bit, special
values too; the binding's ValueErrors naming the kind, the states and the coefficients."""
import pytest
import torch

from zkernels import reference
from zkernels.optimizers import ADEMAMIX, LION, SGD
from zkernels.reference.adamw import sqrt_rn
from tests.conftest import tol

N = 40_009  # awkward: not a multiple of any vector width, three OpenMP tiles


def _state(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen), 0.1 * torch.randn(n, generator=gen)


def _grads(n, steps, dtype, scale=1.0, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=gen) * scale).to(dtype) for _ in range(steps)]


def _bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _equal(a, b):
    assert torch.equal(_bits(a), _bits(b))


RECIPES = {
    "lion": dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1),
    "sgd_momentum": dict(lr=1e-2, momentum=0.9, weight_decay=1e-2),
    "sgd_nesterov": dict(lr=1e-2, momentum=0.9, nesterov=True),
    "sgd_dampening": dict(lr=1e-2, momentum=0.8, dampening=0.3),
    "sgd_plain": dict(lr=1e-2, weight_decay=1e-2),
}


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_matches_reference_over_10_steps(isa, grad_dtype, out_dtype, recipe):
    from zkernels import _cpu
    kw = RECIPES[recipe]
    lion = recipe == "lion"
    p, s = _state(N)
    if not lion and not kw.get("momentum"):
        s = None
    rp, rs = p.clone(), None if s is None else s.clone()
    out = None if out_dtype is None else torch.empty(N, dtype=out_dtype)
    scale = torch.tensor(1024.0)  # a GradScaler-style tensor scale (power of two)
    for step, g in enumerate(_grads(N, 10, grad_dtype, 1024.0), 1):
        if lion:
            _cpu.lion_step(p, g, s, grad_scale=scale, out=out, **kw)
            reference.lion_step(rp, g, rs, grad_scale=scale, **kw)
        else:
            step_arg = torch.tensor(step) if step % 2 else step  # tensors read on the host
            _cpu.sgd_step(p, g, s, step=step_arg, grad_scale=scale, out=out, **kw)
            reference.sgd_step(rp, g, rs, step=step, grad_scale=scale, **kw)
        _equal(p, rp)
        if s is not None:
            _equal(s, rs)
        if out is not None:  # the fused copy is exactly tensor.to(dtype) of the new params
            _equal(out, p.to(out_dtype))


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_tracks_torch_optim_sgd(isa, nesterov):
    from zkernels import _cpu
    n = 278_011  # apex's awkward size
    p, _ = _state(n, seed=3)
    buf = torch.zeros(n)
    ref = torch.nn.Parameter(p.clone())
    kw = dict(lr=1e-2, momentum=0.9, weight_decay=1e-2, nesterov=nesterov,
              dampening=0.0 if nesterov else 0.2)
    opt = torch.optim.SGD([ref], foreach=False, **kw)
    for step, g in enumerate(_grads(n, 10, torch.bfloat16, seed=4), 1):
        _cpu.sgd_step(p, g, buf, step=step, **kw)
        ref.grad = g.float()
        opt.step()
        torch.testing.assert_close(p, ref.detach(), **tol(torch.float32))
    torch.testing.assert_close(buf, opt.state[ref]["momentum_buffer"], **tol(torch.float32))


def _special_params():
    bits = [0x7FC00000, -0x00400000, 0x7F800001, 0x7FA00000, -1,  # NaNs, several payloads
            0x7F800000, -0x00800000,                               # +-inf
            0x00000001, -0x7FFFFFFF, 0x00012345, 0x387FFFFF,       # subnormals, fp16 edge
            0x3F808000, 0x3F818000, 0x477FF000, 0x477FEFFF,        # exact ties, fp16 overflow
            0x7F7FFFFF, 0x7F7F8000, 0x33000000, 0x33000001, 0]     # bf16 overflow, fp16 tiny
    special = torch.tensor(bits, dtype=torch.int32).view(torch.float32)
    rest = torch.randn(1000, generator=torch.Generator().manual_seed(5)) * \
        torch.logspace(-30, 30, 1000)
    return torch.cat([special, rest, special])


@pytest.mark.parametrize("rule", ["lion", "sgd"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_out_copy_bit_exact_on_special_values(isa, rule, out_dtype):
    """lr=0 and zero grads keep the params as they are (NaN, inf, subnormal, ties), so the
    copy must equal torch's own cast of them bit for bit, NaN payloads included."""
    from zkernels import _cpu
    p = _special_params()
    n = p.numel()
    s, g = torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=out_dtype)
    if rule == "lion":
        _cpu.lion_step(p, g, s, lr=0.0, out=out)
    else:
        _cpu.sgd_step(p, g, s, lr=0.0, momentum=0.9, step=2, out=out)
    _equal(p[20:-20], _special_params()[20:-20])
    _equal(out, p.to(out_dtype))


def test_found_inf_skips_everything(native_C):
    from zkernels import _cpu
    p, s = _state(1000)
    g = torch.randn(1000)
    out = torch.full((1000,), 7.0, dtype=torch.bfloat16)
    before = [t.clone() for t in (p, s, out)]
    _cpu.lion_step(p, g, s, lr=1e-3, found_inf=torch.ones(1), out=out)
    _cpu.sgd_step(p, g, s, lr=1e-3, momentum=0.9, step=2, found_inf=torch.ones(1), out=out)
    for t, b in zip((p, s, out), before):
        _equal(t, b)
    _cpu.lion_step(p, g, s, lr=1e-3, found_inf=torch.zeros(1), out=out)
    assert not torch.equal(p, before[0])


def _lion_coeffs(**kw):
    return list(LION.coefficients(LION.resolve(**kw)))


def _sgd_coeffs(step=2, **kw):
    return list(SGD.coefficients(SGD.resolve(**kw), step))


ADEMAMIX_H = dict(lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, weight_decay=0.1)


def test_paths_agree_bit_for_bit_and_threads_do_not_matter(native_C):
    results = []
    lion_c = _lion_coeffs(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    sgd_c = _sgd_coeffs(lr=1e-2, momentum=0.9, nesterov=True)
    ade_c = list(ADEMAMIX.coefficients(ADEMAMIX.resolve(**ADEMAMIX_H), 3))
    for isa in ("scalar", "avx2", "avx512"):
        if not native_C.cpu_isa_supported(isa):
            continue
        for threads in (1, 2):
            p, s = _state(100_003)
            q, b = _state(100_003, seed=2)
            a, m1 = _state(100_003, seed=6)
            m2, v = _state(100_003, seed=7)
            v = v.abs()
            g = torch.randn(100_003, generator=torch.Generator().manual_seed(9))
            assert native_C.cpu_optimizer_step("lion", p, g, [s], lion_c, isa=isa,
                                               num_threads=threads) == isa
            native_C.cpu_optimizer_step("sgd", q, g, [b], sgd_c, isa=isa, num_threads=threads)
            native_C.cpu_optimizer_step("ademamix", a, g, [m1, m2, v], ade_c, isa=isa,
                                        num_threads=threads)
            results.append((isa, threads, p, s, q, b, a, m1, m2, v))
    for isa, threads, *bufs in results[1:]:
        for a, b in zip(bufs, results[0][2:]):
            assert torch.equal(_bits(a), _bits(b)), (isa, threads)


def test_binding_names_bad_arguments(native_C):
    p, s, g = torch.zeros(8), torch.zeros(8), torch.zeros(8)
    lion_c = _lion_coeffs(lr=1e-3)
    step = native_C.cpu_optimizer_step
    with pytest.raises((TypeError, ValueError), match="exp_avg"):
        step("lion", p, g, [torch.zeros(7)], lion_c)
    with pytest.raises((TypeError, ValueError), match="momentum_buffer"):
        step("sgd", p, g, [None], _sgd_coeffs(lr=1e-3, momentum=0.9))
    with pytest.raises((TypeError, ValueError), match="nesterov"):
        step("sgd", p, g, [s], [0.0, 0.0, 1.0, -1e-3, 0.0, 1.0])  # nesterov, no momentum
    with pytest.raises((TypeError, ValueError), match="grad_scale"):
        step("lion", p, g, [s], lion_c, grad_scale=0.0)
    with pytest.raises((TypeError, ValueError), match="beta1"):
        step("lion", p, g, [s], [1.5] + lion_c[1:])
    with pytest.raises(ValueError, match="kind must be one of .*ademamix.*'adam'"):
        step("adam", p, g, [s], lion_c)
    with pytest.raises(ValueError, match="states must hold 3 buffers for ademamix "
                                         r"\(exp_avg_fast, exp_avg_slow, exp_avg_sq\), got 2"):
        step("ademamix", p, g, [s, s], [0.5] * 12)
    with pytest.raises(ValueError, match="coeffs must hold 12 coefficients for ademamix, got 6"):
        step("ademamix", p, g, [s, s, s], lion_c)
    with pytest.raises((TypeError, ValueError), match="exp_avg_slow"):
        step("ademamix", p, g, [s, None, s], [0.5] * 12)
    with pytest.raises((TypeError, ValueError), match="num_threads"):
        step("lion", p, g, [s], lion_c, num_threads=-1)


def test_kinds_are_the_definitions(native_C):
    """The C++ registry and zkernels.optimizers agree on every kind's states and coefficient
    count: the binding reads the definitions' tuples by position."""
    from zkernels import _cpu
    from zkernels.optimizers import REGISTRY
    kinds = native_C.cpu_optimizer_kinds()
    assert set(kinds) == _cpu.OPTIMIZER_KINDS == {"lion", "sgd", "ademamix"}
    for name, (states, num_coeffs) in kinds.items():
        assert states == REGISTRY[name].state_names, name
        assert num_coeffs == len(REGISTRY[name].coefficient_names), name


def _seam3_step(p, g, states, coeffs, inv_scale, correct=True):
    """AdEMAMix's per-element math as SEAM 3 writes it: fp32, one torch op per operation (no
    contracting op: no add_(alpha=)/addcmul_/lerp_), sqrt_rn, every divisor a full tensor so
    no kernel swaps an IEEE division for a reciprocal. correct=False is the catches_ row's
    wrong body: (g*g)*(1-b2) reassociated as g*(g*(1-b2)), one rounding moved."""
    b1, omb1, b2, omb2, b3, omb3, alpha, bc1, sbc2, eps, wd, lr = (
        torch.tensor(c, dtype=torch.float32) for c in coeffs)
    m1, m2, v = states
    g = g.float() * inv_scale
    m1.copy_(m1 * b1 + g * omb1)
    m2.copy_(m2 * b3 + g * omb3)
    v.copy_(v * b2 + ((g * g) * omb2 if correct else g * (g * omb2)))
    d = sqrt_rn(v) / sbc2.expand_as(v) + eps
    u = (m1 / bc1.expand_as(m1) + m2 * alpha) / d
    u = u + p * wd
    p.copy_(p - u * lr)


def _ademamix_run(grad_dtype, out_dtype, h, correct=True, steps=10):
    """Ten native steps and ten Seam-3 steps from the same point, found_inf set on step 4
    (nothing may change), then compared bit for bit (AssertionError when they differ)."""
    from zkernels import _cpu
    h = ADEMAMIX.resolve(**h)
    p, m1 = _state(N, seed=11)
    m2, v = _state(N, seed=13)[1], torch.zeros(N)
    rp, rst = p.clone(), [m1.clone(), m2.clone(), v.clone()]
    out = None if out_dtype is None else torch.full((N,), 3.0, dtype=out_dtype)
    scale = torch.tensor(1024.0)
    for t, g in enumerate(_grads(N, steps, grad_dtype, 1024.0, seed=12), 1):
        c = ADEMAMIX.coefficients(h, t)
        skip = torch.tensor([1.0 if t == 4 else 0.0])
        before = [x.clone() for x in (p, m1, m2, v)] + ([out.clone()] if out is not None else [])
        _cpu.optimizer_step(ADEMAMIX, p, g, (m1, m2, v), c, grad_scale=scale,
                            found_inf=skip, out=out)
        if t == 4:
            after = [p, m1, m2, v] + ([out] if out is not None else [])
            for x, y in zip(after, before):
                _equal(x, y)
            continue
        _seam3_step(rp, g, rst, c, torch.tensor(1.0 / 1024.0), correct)
        _equal(p, rp)
        for x, y in zip((m1, m2, v), rst):
            _equal(x, y)
        if out is not None:
            _equal(out, p.to(out_dtype))


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("warmup", [False, True])
def test_ademamix_matches_seam3_over_10_steps(isa, grad_dtype, out_dtype, warmup):
    h = dict(ADEMAMIX_H, beta3_warmup=6, alpha_warmup=8) if warmup else ADEMAMIX_H
    _ademamix_run(grad_dtype, out_dtype, h)


def test_catches_a_moved_rounding_in_the_ademamix_check(native_C):
    """The bit-exact check above fails against a body with one rounding moved (the v update
    reassociated): a comparator loose enough to pass it would pass a wrong C++ body too."""
    with pytest.raises(AssertionError):
        _ademamix_run(torch.float32, None, ADEMAMIX_H, correct=False, steps=2)


def test_ademamix_out_copy_bit_exact_on_special_values(isa):
    """lr=0 and zero grads keep the params (NaN, inf, subnormal, ties), so the copy must be
    torch's own cast of them bit for bit."""
    from zkernels import _cpu
    p = _special_params()
    n = p.numel()
    g, states = torch.zeros(n), [torch.zeros(n) for _ in range(3)]
    for out_dtype in (torch.bfloat16, torch.float16):
        out = torch.empty(n, dtype=out_dtype)
        c = ADEMAMIX.coefficients(ADEMAMIX.resolve(lr=0.0), 1)
        _cpu.optimizer_step("ademamix", p, g, states, c, out=out)
        _equal(p[20:-20], _special_params()[20:-20])
        _equal(out, p.to(out_dtype))


def test_public_ops_dispatch_to_cpp(native_C, monkeypatch):
    import zkernels
    monkeypatch.delenv("ZKERNELS_BACKEND", raising=False)
    for op in ("lion_step", "sgd_step"):
        assert zkernels.ops.choose(op, torch.device("cpu")) == "cpp"
    for name in ("lion", "sgd", "ademamix"):
        assert zkernels.ops.for_device("cpu").optimizer_backend(name) == "cpp"
