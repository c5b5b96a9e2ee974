"""The native AdamW over low-bit moments (zkernels._C through zkernels._cpu) against the
reference bit for bit, every SIMD path forced in turn. The reference takes the correctly rounded
sqrt the kernel takes ([Note: correctly rounded sqrt] in zkernels/reference/adamw.py; torch's
own CPU sqrt is 1 ulp off for ~0.7% of inputs on AVX-512 CPUs), so the comparison is direct:
no patched reference; a deliberately 1-ulp-off root fails it."""
import pytest
import torch

from zkernels import reference
from zkernels.reference import adamw as ref_adamw, adamw_lowbit as ref_lowbit
from zkernels.reference.adamw_lowbit import new_lowbit_state

N = 40_009  # awkward: not a multiple of any vector width or block, three OpenMP tiles
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
FORMATS = {"bf16": torch.bfloat16, "int8": "int8"}
CONFIGS = {
    "adamw": dict(weight_decay=0.01),
    "l2_scaled_block64": dict(weight_decay=0.01, decoupled=False, grad_scale=1000.0,
                              block_size=64),
    "big_lerp_weight_block8192": dict(beta1=0.3, beta2=0.5, weight_decay=0.1,
                                      block_size=8192),
}


def _bits(t):
    size = t.element_size()
    return t if size == 1 else t.view(torch.int16 if size == 2 else torch.int32)


def _differing(a, b):
    return (_bits(a) != _bits(b)).sum().item()


def _nudge_sqrt(monkeypatch, every):
    """The reference with every ``every``-th root 1 ulp up (a deliberately wrong root, as
    torch's MKL sqrt gives on AVX-512 CPUs)."""
    exact = ref_adamw.sqrt_rn

    def sqrt(x):
        r = exact(x)
        r[::every] = torch.nextafter(r[::every], torch.tensor(float("inf")))
        return r
    monkeypatch.setattr(ref_adamw, "sqrt_rn", sqrt)
    monkeypatch.setattr(ref_lowbit, "sqrt_rn", sqrt)


@pytest.fixture
def fused_torch():
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("torch's default-capability kernels do not fuse lerp/addcmul: the "
                    "reference's fp32 update then rounds differently ([Note: lowbit "
                    "arithmetic is torch's])")


def _steps(fmt, param_dtype, grad_dtype, out_dtype, cfg, steps=4, n=N):
    """(native state, reference state) after ``steps`` steps from the same start."""
    from zkernels import _cpu
    cfg = dict(cfg)
    bs = cfg.pop("block_size", 256)
    scale = cfg.pop("grad_scale", None)
    runs = []
    for fn in (_cpu.adamw_step_lowbit, reference.adamw_step_lowbit):
        gen = torch.Generator().manual_seed(7)
        st = new_lowbit_state(n, FORMATS[fmt], block_size=bs)
        st["param"] = torch.randn(n, generator=gen).to(param_dtype)
        if out_dtype is not None:
            st["out"] = torch.full((n,), 9.0, dtype=out_dtype)
        for t in range(1, steps + 1):
            g = torch.randn(n, generator=torch.Generator().manual_seed(100 + t)) * (scale or 1)
            step = torch.tensor(float(t)) if t % 2 else t  # tensors are read on the host
            fn(st["param"], g.to(grad_dtype), st["exp_avg"], st["exp_avg_sq"],
               st.get("exp_avg_scales"), st.get("exp_avg_sq_scales"), step=step,
               grad_scale=scale, out=st.get("out"), block_size=bs, **{**HYPER, **cfg})
        runs.append(st)
    return runs


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("param_dtype, grad_dtype, out_dtype", [
    (torch.float32, torch.float32, None),
    (torch.float32, torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float16, torch.float16),
])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_reference_bit_for_bit(isa, fused_torch, fmt, param_dtype, grad_dtype, out_dtype,
                                       name):
    mine, ref = _steps(fmt, param_dtype, grad_dtype, out_dtype, CONFIGS[name])
    assert set(mine) == set(ref)
    for key in ref:
        assert _differing(mine[key], ref[key]) == 0, (key, _differing(mine[key], ref[key]))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_catches_a_one_ulp_root(native_C, fused_torch, monkeypatch, fmt):
    """The exact comparison fails when the reference's root is 1 ulp off for 1% of the
    elements (what torch's MKL sqrt does on AVX-512 CPUs): in the params, and for int8 in the
    codes of sqrt(v) or their scales (the bf16 format's moments do not take the root)."""
    _nudge_sqrt(monkeypatch, every=100)
    mine, ref = _steps(fmt, torch.float32, torch.float32, None, CONFIGS["adamw"], steps=2)
    assert _differing(mine["param"], ref["param"]) > 0
    if fmt == "int8":
        assert _differing(mine["exp_avg_sq"], ref["exp_avg_sq"]) + \
            _differing(mine["exp_avg_sq_scales"], ref["exp_avg_sq_scales"]) > 0


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_special_values(isa, fused_torch, fmt):
    """NaN, inf, huge and zero gradients, not skipped: the int8 blocks they reach get NaN/inf
    scales and zero codes, exactly as the reference's; everything else keeps its bits."""
    n, bs = 1_000, 64
    g = torch.randn(n, generator=torch.Generator().manual_seed(3))
    g[5], g[70], g[200], g[300:364] = float("nan"), float("inf"), 3e38, 0.0
    states = []
    from zkernels import _cpu
    for fn in (_cpu.adamw_step_lowbit, reference.adamw_step_lowbit):
        st = new_lowbit_state(n, FORMATS[fmt], block_size=bs)
        p = torch.randn(n, generator=torch.Generator().manual_seed(4))
        for t in (1, 2):
            fn(p, g, st["exp_avg"], st["exp_avg_sq"], st.get("exp_avg_scales"),
               st.get("exp_avg_sq_scales"), step=t, block_size=bs, **HYPER)
        states.append((p, st))
    (p, st), (rp, rst) = states
    assert torch.equal(torch.isnan(p), torch.isnan(rp))
    assert _differing(p[~torch.isnan(p)], rp[~torch.isnan(rp)]) == 0
    for key in st:
        a, b = st[key], rst[key]
        if a.is_floating_point():
            assert torch.equal(torch.isnan(a), torch.isnan(b)), key
            a, b = a[~torch.isnan(a)], b[~torch.isnan(b)]
        assert _differing(a, b) == 0, key
    if fmt == "int8":
        assert torch.isnan(st["exp_avg_scales"][0]) and st["exp_avg_scales"][2].item() > 0


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_wide_ranges_of_block_scales_and_ratios(native_C, isa):
    """Blocks whose absmax runs from 2^-136 to 2^126 (the top block's m is above 2^126) and
    elements from 2^0 down to 2^-62 of their block's max: the SIMD paths' quotient by the
    block scale and their division fallback both ([Note: dividing by a constant without the
    divider] in csrc/cpu_adam_lowbit/tile.h), bit for bit against the scalar path, which
    divides (itself compared with the reference above)."""
    if not native_C.cpu_isa_supported(isa):
        pytest.skip(f"this CPU cannot run the {isa} path")
    n, bs = 64 * 64, 64
    blocks = torch.arange(n) // bs
    block_exp = torch.linspace(-136, 126, n // bs).round()[blocks]
    within = -(torch.arange(n) * 7 % 63).float()
    runs = []
    for path in (isa, "scalar"):
        st = new_lowbit_state(n, "int8", block_size=bs)
        p = torch.randn(n, generator=torch.Generator().manual_seed(5))
        for t in (1, 2, 3):
            g = torch.randn(n, generator=torch.Generator().manual_seed(10 + t))
            g = (g.abs() + 0.5).clamp(max=1.9).copysign(g) * torch.exp2(block_exp + within)
            native_C.cpu_adamw_step_lowbit(
                p, g, st["exp_avg"], st["exp_avg_sq"], st["exp_avg_scales"],
                st["exp_avg_sq_scales"], step=float(t), block_size=bs, isa=path,
                num_threads=1, **{**HYPER, "beta1": 0.3})
        runs.append(dict(st, p=p))
    mine, ref = runs
    for key in ref:
        a, b = mine[key], ref[key]
        if a.is_floating_point():
            assert torch.equal(torch.isnan(a), torch.isnan(b)), key
            a, b = a[~torch.isnan(a)], b[~torch.isnan(b)]
        assert _differing(a, b) == 0, (key, _differing(a, b))


def test_found_inf_skips_everything(native_C):
    from zkernels import _cpu
    for fmt in FORMATS:
        st = new_lowbit_state(1000, FORMATS[fmt], block_size=128)
        p, g = torch.randn(1000), torch.randn(1000)
        out = torch.full((1000,), 7.0, dtype=torch.bfloat16)
        _cpu.adamw_step_lowbit(p, g, st["exp_avg"], st["exp_avg_sq"], st.get("exp_avg_scales"),
                               st.get("exp_avg_sq_scales"), step=1, block_size=128, **HYPER)
        before = {k: v.clone() for k, v in st.items()}
        before["p"], before["out"] = p.clone(), out.clone()
        _cpu.adamw_step_lowbit(p, g, st["exp_avg"], st["exp_avg_sq"], st.get("exp_avg_scales"),
                               st.get("exp_avg_sq_scales"), step=2, block_size=128,
                               found_inf=torch.ones(1), out=out, **HYPER)
        for k, v in {**st, "p": p, "out": out}.items():
            assert _differing(v, before[k]) == 0, (fmt, k)


def test_paths_agree_bit_for_bit_and_threads_do_not_matter(native_C):
    n, bs = 100_003, 128
    results = []
    for isa in ("scalar", "avx2", "avx512"):
        if not native_C.cpu_isa_supported(isa):
            continue
        for threads in (1, 2):
            got = []
            for fmt in FORMATS:
                st = new_lowbit_state(n, FORMATS[fmt], block_size=bs)
                p = torch.randn(n, generator=torch.Generator().manual_seed(1))
                g = torch.randn(n, generator=torch.Generator().manual_seed(2)).bfloat16()
                for t in (1, 2):
                    assert native_C.cpu_adamw_step_lowbit(
                        p, g, st["exp_avg"], st["exp_avg_sq"], st.get("exp_avg_scales"),
                        st.get("exp_avg_sq_scales"), step=float(t), block_size=bs, isa=isa,
                        num_threads=threads, **HYPER) == isa
                got += [p, *st.values()]
            results.append((isa, threads, got))
    for isa, threads, got in results[1:]:
        for a, b in zip(got, results[0][2]):
            assert _differing(a, b) == 0, (isa, threads)


def test_binding_names_bad_arguments(native_C):
    st = new_lowbit_state(8, "int8", block_size=4)
    p, g = torch.zeros(8), torch.zeros(8)
    args = [p, g, st["exp_avg"], st["exp_avg_sq"], st["exp_avg_scales"],
            st["exp_avg_sq_scales"]]
    kw = dict(step=1.0, block_size=4, **HYPER)
    for i, bad, match in [(0, torch.zeros(8, dtype=torch.float16), "param"),
                          (2, torch.zeros(8), "exp_avg must be"),
                          (3, torch.zeros(8, dtype=torch.int8), "exp_avg_sq must be uint8"),
                          (4, None, "exp_avg_scales is required"),
                          (5, torch.zeros(3), "exp_avg_sq_scales must have 2"),
                          (1, torch.zeros(7), "grad")]:
        a = list(args)
        a[i] = bad
        with pytest.raises((TypeError, ValueError), match=match):
            native_C.cpu_adamw_step_lowbit(*a, **kw)
    with pytest.raises(ValueError, match="block_size"):
        native_C.cpu_adamw_step_lowbit(*args, **{**kw, "block_size": 3})
    with pytest.raises(ValueError, match="must be None for bf16"):
        bf = new_lowbit_state(8, torch.bfloat16)
        native_C.cpu_adamw_step_lowbit(p, g, bf["exp_avg"], bf["exp_avg_sq"], torch.zeros(1),
                                       None, **kw)
    with pytest.raises(ValueError, match="beta2"):
        native_C.cpu_adamw_step_lowbit(*args, **{**kw, "beta2": 1.0})


def test_public_op_dispatches_to_cpp(native_C, monkeypatch):
    import zkernels
    monkeypatch.delenv("ZKERNELS_BACKEND", raising=False)
    assert zkernels.ops.choose("adamw_step_lowbit", torch.device("cpu")) == "cpp"
    assert zkernels.ops.for_device("cpu").backends["adamw_step_lowbit"] == "cpp"


def _shift_roots(exact, ulps, every=1):
    """``exact`` (a sqrt) with every ``every``-th root moved ``ulps`` ulps (signed)."""
    def sqrt(x):
        r = exact(x)
        toward = torch.tensor(float("inf") if ulps > 0 else float("-inf"))
        for _ in range(abs(ulps)):
            r[::every] = torch.nextafter(r[::every], toward)
        return r
    return sqrt


def _check_bench_peer(monkeypatch, fmt, root_ulps):
    """Three steps of the cpu_optim bench's unfused torch composition (torch's foreach AdamW
    over the reference's decoded moments), each against the reference's step from the peer's
    own start: the moments bit for bit (they do not take the root), and each param equal, bit
    for bit, to the reference's with that element's root moved by one of ``root_ulps`` ulps.
    After the root both compute the same ops in the same order (``/ sqrt(1-beta2^t)``,
    ``+ eps``, ``addcdiv`` by ``-lr/(1-beta1^t)``), so a peer root ``k`` ulps from the correctly
    rounded one gives exactly the reference's param with its root moved ``k`` ulps: nothing
    here depends on how many elements the CPU's sqrt rounds differently."""
    from zkernels.bench import cpu_optim
    n = 64 * cpu_optim.LOWBIT_BLOCK
    p, g = cpu_optim._tensors(n)
    st = new_lowbit_state(n, FORMATS[fmt], block_size=cpu_optim.LOWBIT_BLOCK)
    peer = cpu_optim._torch_lowbit_stepper(p, g, st, fmt)
    exact = ref_adamw.sqrt_rn
    for t in (1, 2, 3):
        start, p0 = {k: v.clone() for k, v in st.items()}, p.clone()
        peer()
        matched = torch.zeros(n, dtype=torch.bool)
        for ulps in root_ulps:
            q, ref = p0.clone(), {k: v.clone() for k, v in start.items()}
            with monkeypatch.context() as m:  # the param's root only, not sqrt(v)'s codes
                m.setattr(ref_adamw, "sqrt_rn", _shift_roots(exact, ulps))
                reference.adamw_step_lowbit(q, g, ref["exp_avg"], ref["exp_avg_sq"],
                                            ref.get("exp_avg_scales"),
                                            ref.get("exp_avg_sq_scales"), step=t,
                                            block_size=cpu_optim.LOWBIT_BLOCK,
                                            **cpu_optim.LOWBIT)
            for key in st:
                assert _differing(st[key], ref[key]) == 0, (t, key)
            matched |= _bits(p) == _bits(q)
        assert bool(matched.all()), (f"step {t}: {int((~matched).sum())} of {n} params are "
                                     f"not the reference's with a root {root_ulps} ulps off")


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_bench_peer_is_the_reference_step(native_C, monkeypatch, fmt):
    """The cpu_optim bench's peer of the native rows computes the reference's step, so the
    ratio compares the same work: bit for bit when its sqrt is the correctly rounded one; with
    torch's own sqrt (MKL's, 1 ulp off for ~0.6% of inputs on AVX-512 CPUs, exact on AVX2:
    [Note: correctly rounded sqrt]) each param is the reference's with its root at most 1 ulp
    off, on any CPU; the rows come out."""
    from zkernels.bench import cpu_optim
    _check_bench_peer(monkeypatch, fmt, root_ulps=(-1, 0, 1))
    with monkeypatch.context() as m:
        m.setattr(torch, "_foreach_sqrt", lambda xs: [ref_adamw.sqrt_rn(x) for x in xs])
        _check_bench_peer(monkeypatch, fmt, root_ulps=(0,))
    rows = cpu_optim._lowbit_rows(4 * cpu_optim.LOWBIT_BLOCK, 1, 1, 0)
    assert [r["name"] for r in rows if "speedup" in r] == [cpu_optim._lowbit_native("int8"),
                                                          cpu_optim._lowbit_native("bf16")]


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("ulps, allowed", [(1, (0,)), (2, (-1, 0, 1)), (-2, (-1, 0, 1))])
def test_catches_a_bench_peer_off_by_more(monkeypatch, fmt, ulps, allowed):
    """The peer check fails when the peer's root is off by more than it allows for every 97th
    element: 1 ulp against the bit-exact check, 2 ulps (either way) against the 1-ulp one."""
    wrong = _shift_roots(ref_adamw.sqrt_rn, ulps, every=97)
    monkeypatch.setattr(torch, "_foreach_sqrt", lambda xs: [wrong(x) for x in xs])
    with pytest.raises(AssertionError, match="not the reference's"):
        _check_bench_peer(monkeypatch, fmt, root_ulps=allowed)
