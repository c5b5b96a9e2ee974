"""The generic ``optimizer_step(defn, ...)`` ([Note: the generic optimizer step] in
zkernels/reference/optimizer.py): AdEMAMix's reference against an independent numpy fp32
model of Seam 3's op order (bit for bit) and against the authors'-semantics oracle
``zkernels.optimizers.AdEMAMix`` (tolerance, see below), every backend against the reference
bit for bit, the state forms, and the argument checks.

[Note: AdEMAMix tolerances]
The reference performs SEAM35.md's fp32 operations in its order, one rounding each, so an
independent model of that order in numpy fp32 (numpy never contracts a product and a sum; its
fp32 sqrt and division are IEEE) must equal it bit for bit. The oracle runs the authors'
torch ops: ``add_(g, alpha=1-b1)``, ``addcmul_`` and ``add_(p, alpha=wd)`` are one FMA each in
torch's vectorized CPU kernels and ``v.sqrt()`` may be MKL's (1 ulp off), so its moments and
update differ from the reference by a few ulps per step, contracted by the betas; the fp32
row of the tolerance table bounds them over 10 steps (measured, AMD EPYC, torch 2.13: at most
2.4e-7 absolute on the params and 1.2e-7 on the moments, against atol 1e-6; the gaps are a few
ulps whatever the CPU). Swapped betas move the params far beyond it (the ``catches_`` row).
"""
import numpy as np
import pytest
import torch

from zkernels import optimizers, reference
from ..conftest import tol
from ._util import NUMPY_WARNINGS, assert_bits_equal

pytestmark = NUMPY_WARNINGS

ADEMAMIX = optimizers.ADEMAMIX
F32 = tol(torch.float32)
H = dict(lr=1e-2, betas=(0.9, 0.999, 0.9999), alpha=5.0, beta3_warmup=6, alpha_warmup=4,
         eps=1e-8, weight_decay=0.1)


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g)


def _grad(step, n, scale=1.0):
    return _data(n, 1000 + step) * scale


def _numpy_ademamix(p, g, m1, m2, v, c, grad_scale):
    """Seam 3's per-element order in numpy fp32, one rounding per operation."""
    f = np.float32
    b1, omb1, b2, omb2, b3, omb3, alpha, bc1, sbc2, eps, wd, lr = (f(x) for x in c)
    g = g.astype(np.float32)
    if grad_scale is not None:
        g = g / f(grad_scale)
    m1 = m1 * b1 + g * omb1
    m2 = m2 * b3 + g * omb3
    v = v * b2 + (g * g) * omb2
    d = np.sqrt(v) / sbc2 + eps
    u = (m1 / bc1 + m2 * alpha) / d
    u = u + p * wd
    return p - u * lr, m1, m2, v


def _run_numpy(h, steps, n, grad_scale=None, model=_numpy_ademamix):
    p, m1, m2, v = _data(n, 0).numpy(), *(np.zeros(n, np.float32) for _ in range(3))
    for t in range(1, steps + 1):
        g = _grad(t, n, grad_scale or 1.0).numpy()
        p, m1, m2, v = model(p, g, m1, m2, v, ADEMAMIX.coefficients(h, t), grad_scale)
    return [torch.from_numpy(x) for x in (p, m1, m2, v)]


def _run_reference(h, steps, n, grad_scale=None):
    p, states = _data(n, 0), [torch.zeros(n) for _ in range(3)]
    for t in range(1, steps + 1):
        reference.optimizer_step(ADEMAMIX, p, _grad(t, n, grad_scale or 1.0), states,
                                 ADEMAMIX.coefficients(ADEMAMIX.resolve(**h), t),
                                 grad_scale=grad_scale)
    return [p, *states]


@pytest.mark.parametrize("grad_scale", [None, 1024.0, 3.0])
def test_ademamix_reference_is_seam_3_bit_for_bit(grad_scale):
    h = ADEMAMIX.resolve(**H)
    for a, b in zip(_run_reference(H, 10, 4099, grad_scale), _run_numpy(h, 10, 4099, grad_scale)):
        assert_bits_equal(a, b)


def test_ademamix_seam_comparison_catches_a_swapped_order():
    # d = sqrt(v / bc2) + eps instead of sqrt(v) / sqrt(bc2) + eps: within an ulp or two, and
    # the bit-for-bit check must see it.
    def wrong(p, g, m1, m2, v, c, grad_scale):
        out = _numpy_ademamix(p, g, m1, m2, v, c, grad_scale)
        f = np.float32
        b1, _, _, _, _, _, alpha, bc1, sbc2, eps, wd, lr = (f(x) for x in c)
        _, m1, m2, v = out
        u = (m1 / bc1 + m2 * alpha) / (np.sqrt(v / (sbc2 * sbc2)) + eps)
        return p - (u + p * wd) * lr, m1, m2, v

    h = ADEMAMIX.resolve(**H)
    ref = _run_reference(H, 3, 4099)[0]
    with pytest.raises(AssertionError):
        assert_bits_equal(ref, _run_numpy(h, 3, 4099, model=wrong)[0])


def _run_oracle(h, steps, n, wrong_betas=False):
    p = torch.nn.Parameter(_data(n, 0))
    kw = dict(h)
    if wrong_betas:
        b1, b2, b3 = kw["betas"]
        kw["betas"] = (b1, b3, b2)
    opt = optimizers.AdEMAMix([p], **kw)
    for t in range(1, steps + 1):
        p.grad = _grad(t, n)
        opt.step()
    st = opt.state[p]
    return [p.detach(), st["exp_avg_fast"], st["exp_avg_slow"], st["exp_avg_sq"]]


@pytest.mark.parametrize("warmup", [True, False])
def test_ademamix_reference_matches_the_authors_oracle_over_10_steps(warmup):
    h = dict(H) if warmup else dict(H, beta3_warmup=None, alpha_warmup=None)
    for a, b in zip(_run_reference(h, 10, 4099), _run_oracle(h, 10, 4099)):
        torch.testing.assert_close(a, b, **F32)


def test_ademamix_oracle_comparison_catches_swapped_betas():
    ref = _run_reference(H, 10, 4099)[0]
    with pytest.raises(AssertionError):
        torch.testing.assert_close(ref, _run_oracle(H, 10, 4099, wrong_betas=True)[0], **F32)


def test_ademamix_bf16_state_form_rounds_after_the_fp32_math():
    # The bf16 form is the fp32 math on the widened moments, each stored rounded to nearest
    # even: one step from bf16 moments equals the fp32 step from the same (widened) values,
    # rounded.
    n, h = 3001, ADEMAMIX.resolve(**H)
    c = ADEMAMIX.coefficients(h, 7)
    low = [(_data(n, 5 + i).abs() * 1e-2).bfloat16() for i in range(3)]
    wide = [s.float() for s in low]
    p, q = _data(n, 0), _data(n, 0)
    grad = _grad(7, n).bfloat16()
    reference.optimizer_step(ADEMAMIX, p, grad, low, c)
    reference.optimizer_step(ADEMAMIX, q, grad, wide, c)
    assert_bits_equal(p, q)
    for a, b in zip(low, wide):
        assert a.dtype == torch.bfloat16
        assert_bits_equal(a, b.bfloat16())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_param_is_widened_and_rounded(dtype):
    n, c = 2049, ADEMAMIX.coefficients(ADEMAMIX.resolve(**H), 2)
    p = _data(n, 0).to(dtype)
    q = p.float()
    out = torch.empty(n, dtype=torch.float16)
    states, states_q = [[_data(n, 9).abs() for _ in range(3)] for _ in range(2)]
    reference.optimizer_step(ADEMAMIX, p, _grad(2, n), states, c, out=out)
    reference.optimizer_step(ADEMAMIX, q, _grad(2, n), states_q, c)
    assert_bits_equal(p, q.to(dtype))
    assert_bits_equal(out, q.half())


def test_bad_arguments_name_the_argument(ops):
    n = 8
    p, g = torch.zeros(n), torch.zeros(n)
    st = [torch.zeros(n) for _ in range(3)]
    c = ADEMAMIX.coefficients(ADEMAMIX.resolve(), 1)
    cases = [
        (dict(defn="adam"), ValueError, "defn"),
        (dict(param=p.double()), TypeError, "param"),
        (dict(param=torch.zeros(2, 4)), ValueError, "param"),
        (dict(grad=torch.zeros(9)), ValueError, "grad"),
        (dict(states=st[:2]), ValueError, "states"),
        (dict(states=st[0]), TypeError, "states"),
        (dict(states=[st[0], torch.zeros(7), st[2]]), ValueError, r"states\[1\] \(exp_avg_slow\)"),
        (dict(states=[st[0], st[1], st[2].half()]), TypeError, r"states\[2\] \(exp_avg_sq\)"),
        (dict(states=[st[0].bfloat16(), st[1], st[2]]), TypeError, r"states\[1\]"),
        (dict(coeffs=c[:-1]), ValueError, "coeffs"),
        (dict(coeffs=c[:-1] + ("x",)), ValueError, r"coeffs\[11\] \(lr\)"),
        (dict(out=torch.zeros(4)), ValueError, "out"),
        (dict(found_inf=torch.zeros(2)), ValueError, "found_inf"),
        (dict(grad_scale=torch.ones(2)), ValueError, "grad_scale"),
    ]
    for change, exc, name in cases:
        kw = dict(defn="ademamix", param=p, grad=g, states=st, coeffs=c)
        kw.update(change)
        with pytest.raises(exc, match=name):
            ops.optimizer_step(kw.pop("defn"), kw.pop("param"), kw.pop("grad"),
                               kw.pop("states"), kw.pop("coeffs"), **kw)
    # The bf16 form is AdEMAMix's; Lion has none.
    with pytest.raises(TypeError, match=r"states\[0\] \(exp_avg\)"):
        ops.optimizer_step("lion", p, g, [st[0].bfloat16()],
                           optimizers.LION.coefficients(optimizers.LION.resolve()))


def test_a_forced_backend_without_the_definition_is_refused(monkeypatch):
    from zkernels import ops
    monkeypatch.setenv("ZKERNELS_BACKEND", "reference")
    n = 8
    with pytest.raises(RuntimeError, match="adamw"):
        ops.optimizer_step("adamw", torch.zeros(n), torch.zeros(n), [torch.zeros(n)] * 2,
                           optimizers.ADAMW.coefficients(optimizers.ADAMW.resolve(), 1))


# Every backend against the reference, bit for bit: (definition, hyperparameters, states
# present). Lion and SGD have no low-bit form; AdEMAMix runs both.
DEFINITIONS = {
    "ademamix": (ADEMAMIX, H, 3),
    "ademamix_plain": (ADEMAMIX, dict(), 3),
    "lion": (optimizers.LION, dict(lr=1e-3, weight_decay=0.1), 1),
    "sgd_nesterov": (optimizers.SGD, dict(lr=0.1, momentum=0.9, nesterov=True,
                                          weight_decay=1e-2), 1),
    "sgd_plain": (optimizers.SGD, dict(lr=0.1), 0),
}
# (param dtype, state form, grad dtype, grad scale, out dtype)
FORMS = {
    "f32": (torch.float32, torch.float32, torch.float32, None, None),
    "f32_bf16grad_scaled_f16out": (torch.float32, torch.float32, torch.bfloat16, 1024.0,
                                   torch.float16),
    "bf16param_bf16state_tensorscale": (torch.bfloat16, torch.bfloat16, torch.float16,
                                        "tensor", torch.float32),
    "f16param_f32state_bf16out": (torch.float16, torch.float32, torch.bfloat16, None,
                                  torch.bfloat16),
    "f32param_bf16state_found_inf0": (torch.float32, torch.bfloat16, torch.bfloat16, 256.0,
                                      torch.bfloat16),
}
N = 2 * 2048 + 5  # two full blocks and a tail


def _case(defn, h, n_states, form, device, n=N):
    pdt, sdt, _, _, odt = form
    p = _data(n, 0).to(pdt).to(device)
    states = [None] * len(defn.states)
    for i in range(n_states):
        states[i] = (_data(n, 10 + i).abs() * 1e-2).to(sdt).to(device)
    out = None if odt is None else torch.full((n,), 9.0, dtype=odt, device=device)
    return p, states, out


def _supported(defn, form):
    return form[1] == torch.float32 or "bf16" in defn.lowbit


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("name", list(DEFINITIONS))
def test_every_backend_matches_the_reference_over_3_steps(impl, backend, device, name, form):
    defn, hyper, n_states = DEFINITIONS[name]
    form = FORMS[form]
    if not _supported(defn, form):
        pytest.skip(f"{defn.name} has no bf16 state form")
    h = defn.resolve(**hyper)
    p, states, out = _case(defn, h, n_states, form, device)
    rp, rstates = p.clone(), [None if s is None else s.clone() for s in states]
    rout = None if out is None else out.clone()
    gdt, scale = form[2], form[3]
    scale_arg = torch.tensor([512.0], device=device) if scale == "tensor" else scale
    scale = 512.0 if scale == "tensor" else scale
    fp32 = p.dtype == torch.float32 and form[1] == torch.float32
    if backend == "cpp":
        from zkernels.ops import _backend
        if not _backend.has_optimizer("cpp", defn, fp32):
            with pytest.raises(RuntimeError, match=defn.name):
                impl("optimizer_step")(defn, p, _grad(1, N).to(gdt), states,
                                       defn.coefficients(h, 1))
            return
    for t in range(1, 4):
        grad = _grad(t, N, scale or 1.0).to(gdt).to(device)
        c = defn.coefficients(h, t)
        impl("optimizer_step")(defn.name if t == 2 else defn, p, grad, states, c,
                               grad_scale=scale_arg, found_inf=torch.zeros(1, device=device),
                               out=out)
        reference.optimizer_step(defn, rp, grad, rstates, c, grad_scale=scale, out=rout)
        assert_bits_equal(p, rp)
        for s, r in zip(states, rstates):
            if s is not None:
                assert_bits_equal(s, r)
        if out is not None:
            assert_bits_equal(out, rout)


@pytest.mark.parametrize("name", ["ademamix", "lion", "sgd_nesterov"])
def test_found_inf_changes_nothing(impl, backend, device, name):
    defn, hyper, n_states = DEFINITIONS[name]
    h = defn.resolve(**hyper)
    form = FORMS["f32_bf16grad_scaled_f16out"]
    p, states, out = _case(defn, h, n_states, form, device, n=2049)
    from zkernels.ops import _backend
    if backend == "cpp" and not _backend.has_optimizer("cpp", defn, True):
        pytest.skip(f"this build's C++ core has no generic step for {defn.name}")
    before = [t.clone() for t in [p, out, *states]]
    grad = (_grad(1, 2049) * float("inf")).to(device)
    impl("optimizer_step")(defn, p, grad, states, defn.coefficients(h, 1),
                           grad_scale=torch.tensor([4.0], device=device),
                           found_inf=torch.ones(1, device=device), out=out)
    for a, b in zip([p, out, *states], before):
        assert_bits_equal(a, b)


def test_the_triton_comparison_catches_a_wrong_body(monkeypatch, device):
    # AdEMAMix's body with beta1 where beta3 belongs: m2 goes wrong and the bits must differ.
    pytest.importorskip("triton")
    from zkernels import kernels
    from zkernels.kernels import ademamix as body
    from ._wrong_body import WRONG_ADEMAMIX

    monkeypatch.setattr(body, "BODY", WRONG_ADEMAMIX)
    h = ADEMAMIX.resolve(**H)
    p, states, _ = _case(ADEMAMIX, h, 3, FORMS["f32"], device, n=2049)
    rp, rstates = p.clone(), [s.clone() for s in states]
    grad, c = _grad(1, 2049).to(device), ADEMAMIX.coefficients(h, 1)
    kernels.optimizer_step(ADEMAMIX, p, grad, states, c)
    reference.optimizer_step(ADEMAMIX, rp, grad, rstates, c)
    assert_bits_equal(states[0], rstates[0])  # m1 is right
    with pytest.raises(AssertionError):
        assert_bits_equal(states[1], rstates[1])
