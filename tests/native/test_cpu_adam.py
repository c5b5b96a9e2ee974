"""The native CPU AdamW (zkernels._C through zkernels._cpu) against the reference and
torch.optim.AdamW, every SIMD path forced in turn; the bf16/fp16 out-copy bit for bit."""
import pytest
import torch

import zkernels
from zkernels import reference
from tests.conftest import tol

N = 40_009  # awkward: not a multiple of any vector width, three OpenMP tiles
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)


def _state(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m = 0.1 * torch.randn(n, generator=gen)
    v = 0.01 * torch.rand(n, generator=gen)
    return p, m, v


def _grads(n, steps, dtype, scale=1.0, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=gen) * scale).to(dtype) for _ in range(steps)]


def _bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("recipe", ["adamw", "l2", "scaled", "small_beta1"])
def test_matches_reference_over_10_steps(isa, grad_dtype, out_dtype, recipe):
    from zkernels import _cpu
    kw = dict(HYPER, weight_decay=0.01)
    scale = None
    if recipe == "l2":
        kw.update(decoupled=False, weight_decay=0.1)
    elif recipe == "scaled":
        scale = torch.tensor(1024.0)  # a GradScaler-style tensor scale
    elif recipe == "small_beta1":
        kw.update(beta1=0.3)  # torch.lerp's other branch (weight >= 0.5)
    p, m, v = _state(N)
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    out = None if out_dtype is None else torch.empty(N, dtype=out_dtype)
    for step, g in enumerate(_grads(N, 10, grad_dtype, 1024.0 if scale is not None else 1.0), 1):
        step_arg = torch.tensor(float(step)) if step % 2 else step  # tensors read on the host
        _cpu.adamw_step(p, g, m, v, step=step_arg, grad_scale=scale, out=out, **kw)
        reference.adamw_step(rp, g, rm, rv, step=step, grad_scale=scale, **kw)
        torch.testing.assert_close(p, rp, **tol(torch.float32))
        if out is not None:  # the fused copy is exactly tensor.to(dtype) of the new params
            assert torch.equal(_bits(out), _bits(p.to(out_dtype)))
    torch.testing.assert_close(m, rm, **tol(torch.float32))
    torch.testing.assert_close(v, rv, **tol(torch.float32))


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_tracks_torch_optim_adamw(isa, grad_dtype):
    from zkernels import _cpu
    p, m, v = _state(278_011, seed=3)  # apex's awkward size
    m.zero_()
    v.zero_()
    ref = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05,
                            foreach=False)
    for step, g in enumerate(_grads(278_011, 10, grad_dtype, seed=4), 1):
        _cpu.adamw_step(p, g, m, v, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                        weight_decay=0.05, step=step)
        ref.grad = g.float()
        opt.step()
        torch.testing.assert_close(p, ref.detach(), **tol(torch.float32))
    st = opt.state[ref]
    torch.testing.assert_close(m, st["exp_avg"], **tol(torch.float32))
    torch.testing.assert_close(v, st["exp_avg_sq"], **tol(torch.float32))


def _special_params():
    bits = [0x7FC00000, -0x00400000, 0x7F800001, 0x7FA00000, -1,  # NaNs, several payloads
            0x7F800000, -0x00800000,                               # +-inf
            0x00000001, -0x7FFFFFFF, 0x00012345, 0x387FFFFF,       # subnormals, fp16 edge
            0x3F808000, 0x3F818000, 0x477FF000, 0x477FEFFF,        # exact ties, fp16 overflow
            0x7F7FFFFF, 0x7F7F8000, 0x33000000, 0x33000001, 0]     # bf16 overflow, fp16 tiny
    special = torch.tensor(bits, dtype=torch.int32).view(torch.float32)
    gen = torch.Generator().manual_seed(5)
    rest = torch.randn(1000, generator=gen) * torch.logspace(-30, 30, 1000)
    return torch.cat([special, rest, special])


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_out_copy_bit_exact_on_special_values(isa, out_dtype):
    """lr=0 and zero grads keep the params as they are (NaN, inf, subnormal, ties), so the
    copy must equal torch's own cast of them bit for bit, NaN payloads included."""
    from zkernels import _cpu
    p = _special_params()
    n = p.numel()
    m, v, g = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=out_dtype)
    _cpu.adamw_step(p, g, m, v, lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, step=1, out=out)
    assert torch.equal(_bits(p[20:-20]), _bits(_special_params()[20:-20]))
    assert torch.equal(_bits(out), _bits(p.to(out_dtype)))


def test_found_inf_skips_everything(native_C):
    from zkernels import _cpu
    p, m, v = _state(1000)
    g = torch.randn(1000)
    out = torch.full((1000,), 7.0, dtype=torch.bfloat16)
    before = [t.clone() for t in (p, m, v, out)]
    _cpu.adamw_step(p, g, m, v, step=1, found_inf=torch.ones(1), out=out, **HYPER)
    for t, b in zip((p, m, v, out), before):
        assert torch.equal(_bits(t), _bits(b))
    _cpu.adamw_step(p, g, m, v, step=1, found_inf=torch.zeros(1), out=out, **HYPER)
    assert not torch.equal(p, before[0])


@pytest.mark.parametrize("n", [0, 1, 15, 17, 33])
def test_tiny_sizes(isa, n):
    from zkernels import _cpu
    p, m, v = _state(n)
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    g = torch.randn(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    _cpu.adamw_step(p, g, m, v, step=2, out=out, **HYPER)
    reference.adamw_step(rp, g, rm, rv, step=2, **HYPER)
    torch.testing.assert_close(p, rp, **tol(torch.float32))
    assert torch.equal(_bits(out), _bits(p.to(torch.bfloat16)))


def test_paths_agree_bit_for_bit_and_threads_do_not_matter(native_C, monkeypatch):
    results = []
    for isa in ("scalar", "avx2", "avx512"):
        if not native_C.cpu_isa_supported(isa):
            continue
        for threads in (1, 2):
            p, m, v = _state(100_003)
            g = torch.randn(100_003, generator=torch.Generator().manual_seed(9))
            native_C.cpu_adamw_step(p, g, m, v, step=3, weight_decay=0.1, isa=isa,
                                    num_threads=threads, **HYPER)
            results.append((isa, threads, p, m, v))
    for isa, threads, *bufs in results[1:]:
        for a, b in zip(bufs, results[0][2:]):
            assert torch.equal(_bits(a), _bits(b)), (isa, threads)


def test_public_op_dispatches_to_cpp(native_C, monkeypatch):
    monkeypatch.delenv("ZKERNELS_BACKEND", raising=False)
    assert zkernels.ops.choose("adamw_step", torch.device("cpu")) == "cpp"
    p, m, v = _state(999)
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    g = torch.randn(999).to(torch.bfloat16)
    out = torch.empty(999, dtype=torch.bfloat16)
    zkernels.ops.adamw_step(p, g, m, v, step=1, out=out, weight_decay=0.01, **HYPER)
    reference.adamw_step(rp, g, rm, rv, step=1, weight_decay=0.01, **HYPER)
    torch.testing.assert_close(p, rp, **tol(torch.float32))
    assert torch.equal(_bits(out), _bits(p.to(torch.bfloat16)))
