"""The native CPU Lion and SGD (zkernels._C through zkernels._cpu) against the reference bit
for bit (see [Note: Lion tolerances] in tests/ops/test_lion.py), every SIMD path forced in
turn; torch.optim.SGD to round-off; the bf16/fp16 out copy bit for bit, special values too."""
import pytest
import torch

from zkernels import reference
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


def test_paths_agree_bit_for_bit_and_threads_do_not_matter(native_C):
    results = []
    for isa in ("scalar", "avx2", "avx512"):
        if not native_C.cpu_isa_supported(isa):
            continue
        for threads in (1, 2):
            p, s = _state(100_003)
            q, b = _state(100_003, seed=2)
            g = torch.randn(100_003, generator=torch.Generator().manual_seed(9))
            assert native_C.cpu_lion_step(p, g, s, lr=1e-3, beta1=0.9, beta2=0.99,
                                          weight_decay=0.1, isa=isa, num_threads=threads) == isa
            native_C.cpu_sgd_step(q, g, b, lr=1e-2, momentum=0.9, nesterov=True, isa=isa,
                                  num_threads=threads)
            results.append((isa, threads, p, s, q, b))
    for isa, threads, *bufs in results[1:]:
        for a, b in zip(bufs, results[0][2:]):
            assert torch.equal(_bits(a), _bits(b)), (isa, threads)


def test_binding_names_bad_arguments(native_C):
    p, s, g = torch.zeros(8), torch.zeros(8), torch.zeros(8)
    with pytest.raises((TypeError, ValueError), match="exp_avg"):
        native_C.cpu_lion_step(p, g, torch.zeros(7), lr=1e-3, beta1=0.9, beta2=0.99)
    with pytest.raises((TypeError, ValueError), match="momentum_buffer"):
        native_C.cpu_sgd_step(p, g, None, lr=1e-3, momentum=0.9)
    with pytest.raises((TypeError, ValueError), match="nesterov"):
        native_C.cpu_sgd_step(p, g, s, lr=1e-3, nesterov=True)
    with pytest.raises((TypeError, ValueError), match="grad_scale"):
        native_C.cpu_lion_step(p, g, s, lr=1e-3, beta1=0.9, beta2=0.99, grad_scale=0.0)


def test_public_ops_dispatch_to_cpp(native_C, monkeypatch):
    import zkernels
    monkeypatch.delenv("ZKERNELS_BACKEND", raising=False)
    for op in ("lion_step", "sgd_step"):
        assert zkernels.ops.choose(op, torch.device("cpu")) == "cpp"
        assert zkernels.ops.for_device("cpu").backends[op] == "cpp"
