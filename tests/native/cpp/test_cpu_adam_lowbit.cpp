// C++ tests of csrc/cpu_adam_lowbit (AdamW over bf16 or blockwise int8 moments): every SIMD
// path the CPU supports, forced in turn, against an independent recipe written here (the
// reference's operations one at a time, zkernels/reference/adamw_lowbit.py: dequantize, AdamW
// with torch's fused lerp/addcmul, requantize per block), bit for bit, over several steps,
// sizes with ragged ends and blocks, both param dtypes, every grad and out dtype, 1 and 2
// threads; found_inf and the argument checks; the SIMD paths' quotient by a constant against
// the IEEE division. Exit status 0 iff every check passed; each path prints "PATH <name> ok"
// when it ran.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include "check.h"
#include "cpu_adam_lowbit/cpu_adam_lowbit.h"
#if defined(__x86_64__)
#include "simd/avx2.h"  // lowbit::quotient on the AVX2 traits (the arithmetic of every path)
#include "cpu_adam_lowbit/tile.h"
#endif

using zk::DType;
using namespace zk::cpu;
using namespace zk_test;

static bool same(float a, float b) {
  return bits(a) == bits(b) || (std::isnan(a) && std::isnan(b));
}

// The state of one shard, in either format, and the param as fp32 or bf16 bits.
struct State {
  std::vector<float> p32;
  std::vector<uint16_t> p16, m16, v16;  // bf16 param; bf16 moments
  std::vector<int8_t> qm;
  std::vector<uint8_t> qv;
  std::vector<float> sm, sv;
};

static float param_at(const State& s, bool bf16_param, int64_t i) {
  return bf16_param ? from_bits(static_cast<uint32_t>(s.p16[i]) << 16) : s.p32[i];
}

// The 8-bit float codes of [Note: low-bit moment formats], written independently of the
// kernel's bit arithmetic: decode from the definition (ldexp), encode by searching the sorted
// decoded values for the nearest one (ties to the even code).
constexpr int kEmin = -14;

static float decode(int c, int mant) {
  if (c < (1 << mant)) return static_cast<float>(std::ldexp(static_cast<double>(c), kEmin - mant));
  const int e = (c >> mant) - 1 + kEmin, f = c & ((1 << mant) - 1);
  return static_cast<float>(std::ldexp(1.0 + std::ldexp(static_cast<double>(f), -mant), e));
}

static int encode(float y, int mant) {
  const int top = 15 << mant;  // the code of 1.0
  int lo = 0, hi = top;        // the first code whose value is >= y
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (decode(mid, mant) < y) lo = mid + 1; else hi = mid;
  }
  if (lo == 0) return 0;
  const double above = decode(lo, mant) - static_cast<double>(y);
  const double below = static_cast<double>(y) - decode(lo - 1, mant);
  if (above < below) return lo;
  if (below < above) return lo - 1;
  return lo % 2 == 0 ? lo : lo - 1;
}

// One block's absmax scale (quant semantics) and float codes of |x| / absmax, signed or not;
// returns the scale (the absmax; NaN / inf / 0 blocks: codes 0).
template <typename Put>
static float requantize(const float* x, int64_t n, int mant, Put put) {
  uint32_t top = 0;
  for (int64_t i = 0; i < n; ++i) top = std::max(top, bits(x[i]) & 0x7FFFFFFFu);
  if (top > 0x7F800000u) {
    for (int64_t i = 0; i < n; ++i) put(i, 0);
    return from_bits(0x7FC00000u);
  }
  if (top == 0x7F800000u || top == 0) {
    for (int64_t i = 0; i < n; ++i) put(i, 0);
    return top == 0 ? 0.0f : INFINITY;
  }
  const float amax = from_bits(top);
  for (int64_t i = 0; i < n; ++i) {
    const int c = encode(std::fabs(x[i]) / amax, mant);
    put(i, x[i] < 0.0f ? -c : c);
  }
  return amax;
}

// The reference step (adamw_lowbit.py over adamw.py's torch ops), one operation at a time.
static void recipe(const AdamWConfig& c, bool int8, int64_t bs, bool bf16_param, State& s,
                   const std::vector<float>& g, std::vector<float>& outp) {
  const int64_t n = static_cast<int64_t>(g.size());
  std::vector<float> p(n), m(n), v(n);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = param_at(s, bf16_param, i);
    if (int8) {
      const float a = decode(std::abs(static_cast<int>(s.qm[i])), 3) * s.sm[i / bs];
      m[i] = s.qm[i] < 0 ? -a : a;
      const float r = decode(s.qv[i], 4) * s.sv[i / bs];
      v[i] = r * r;
    } else {
      m[i] = from_bits(static_cast<uint32_t>(s.m16[i]) << 16);
      v[i] = from_bits(static_cast<uint32_t>(s.v16[i]) << 16);
    }
  }
  const float w = static_cast<float>(1.0 - c.beta1);
  const double bc1 = 1.0 - std::pow(c.beta1, c.step), bc2 = 1.0 - std::pow(c.beta2, c.step);
  std::vector<float> root(n);
  for (int64_t i = 0; i < n; ++i) {
    float gi = g[i];
    if (c.grad_scale != 1.0) gi = gi / static_cast<float>(c.grad_scale);
    if (c.decoupled) {
      p[i] = p[i] * static_cast<float>(1.0 - c.lr * c.weight_decay);
    } else if (c.weight_decay != 0.0) {
      gi = std::fma(static_cast<float>(c.weight_decay), p[i], gi);
    }
    const float d = gi - m[i];
    m[i] = std::fabs(w) < 0.5f ? std::fma(w, d, m[i]) : std::fma(w - 1.0f, d, gi);
    const float vb = v[i] * static_cast<float>(c.beta2);
    v[i] = std::fma(static_cast<float>(1.0 - c.beta2) * gi, gi, vb);
    root[i] = std::sqrt(v[i]);
    const float den = root[i] / static_cast<float>(std::sqrt(bc2)) + static_cast<float>(c.eps);
    const float step = static_cast<float>(-(c.lr / bc1));
    p[i] = p[i] + (step * m[i]) / den;
  }
  for (int64_t i = 0; i < n; ++i) {
    if (bf16_param) s.p16[i] = exact_bf16(p[i]);
    else s.p32[i] = p[i];
    outp[i] = p[i];
    if (!int8) {
      s.m16[i] = exact_bf16(m[i]);
      s.v16[i] = exact_bf16(v[i]);
    }
  }
  if (!int8) return;
  for (int64_t b = 0; b * bs < n; ++b) {
    const int64_t base = b * bs, len = std::min(bs, n - base);
    s.sm[b] = requantize(&m[base], len, 3,
                         [&](int64_t i, int q) { s.qm[base + i] = static_cast<int8_t>(q); });
    s.sv[b] = requantize(&root[base], len, 4,
                         [&](int64_t i, int q) { s.qv[base + i] = static_cast<uint8_t>(q); });
  }
}

static State make_state(int64_t n, int64_t bs, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  State s;
  const int64_t nb = (n + bs - 1) / bs;
  for (int64_t i = 0; i < n; ++i) {
    s.p32.push_back(normal(rng));
    s.p16.push_back(exact_bf16(s.p32.back()));
    s.m16.push_back(exact_bf16(0.1f * normal(rng)));
    s.v16.push_back(exact_bf16(0.01f * std::fabs(normal(rng))));
    s.qm.push_back(static_cast<int8_t>(static_cast<int>(rng() % 241) - 120));  // |c| <= 120
    s.qv.push_back(static_cast<uint8_t>(rng() % 241));                          // c <= 240
  }
  for (int64_t b = 0; b < nb; ++b) {  // scales: the blocks' absmax
    s.sm.push_back(0.1f * (1.0f + 0.01f * static_cast<float>(b % 7)));
    s.sv.push_back(0.1f);
  }
  return s;
}

struct Grads {
  std::vector<float> g32, gref;
  std::vector<uint16_t> g16;
};

static Grads make_grads(int64_t n, DType gdt, float scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Grads g{std::vector<float>(n), std::vector<float>(n), std::vector<uint16_t>(n)};
  for (int64_t i = 0; i < n; ++i) {
    g.g32[i] = normal(rng) * scale;
    g.g16[i] = gdt == DType::kFloat16 ? hw_fp16(g.g32[i]) : exact_bf16(g.g32[i]);
    if (gdt == DType::kFloat32) g.gref[i] = g.g32[i];
    else if (gdt == DType::kBFloat16) g.gref[i] = from_bits(static_cast<uint32_t>(g.g16[i]) << 16);
    else g.gref[i] = hw_from_fp16(g.g16[i]);
  }
  return g;
}

static LowbitBuffers buffers(State& s, bool int8, int64_t bs, bool bf16_param, const Grads& g,
                             DType gdt, std::vector<uint16_t>& out16, DType odt) {
  LowbitBuffers b;
  b.param = bf16_param ? static_cast<void*>(s.p16.data()) : s.p32.data();
  b.param_dtype = bf16_param ? DType::kBFloat16 : DType::kFloat32;
  b.grad = gdt == DType::kFloat32 ? static_cast<const void*>(g.g32.data()) : g.g16.data();
  b.grad_dtype = gdt;
  b.format = int8 ? MomentFormat::kInt8 : MomentFormat::kBf16;
  b.exp_avg = int8 ? static_cast<void*>(s.qm.data()) : s.m16.data();
  b.exp_avg_sq = int8 ? static_cast<void*>(s.qv.data()) : s.v16.data();
  b.exp_avg_scales = s.sm.data();
  b.exp_avg_sq_scales = s.sv.data();
  b.block_size = bs;
  b.numel = static_cast<int64_t>(g.g32.size());
  b.out = out16.data();
  b.out_dtype = odt;
  return b;
}

static void compare(Isa isa, const char* what, const State& a, const State& e,
                    const std::vector<uint16_t>& out16, const std::vector<float>& outp,
                    DType odt) {
  bool ok = a.p16 == e.p16 && a.m16 == e.m16 && a.v16 == e.v16 && a.qm == e.qm && a.qv == e.qv;
  for (size_t i = 0; i < a.p32.size(); ++i) ok &= same(a.p32[i], e.p32[i]);
  for (size_t i = 0; i < a.sm.size(); ++i) ok &= same(a.sm[i], e.sm[i]) && same(a.sv[i], e.sv[i]);
  for (size_t i = 0; i < outp.size(); ++i) {
    const uint16_t want = odt == DType::kBFloat16 ? exact_bf16(outp[i]) : hw_fp16(outp[i]);
    ok &= out16[i] == want;
  }
  CHECK(ok, "%s %s: differs from the recipe", isa_name(isa), what);
}

static void test_case(Isa isa, int64_t n, bool int8, int64_t bs, bool bf16_param, DType gdt,
                      DType odt, const AdamWConfig& base) {
  State s = make_state(n, bs, static_cast<uint32_t>(n * 7 + bs));
  State e = s;
  std::vector<uint16_t> out16(n, 0xABCD);
  std::vector<float> outp(n);
  char what[160];
  std::snprintf(what, sizeof what, "n=%lld %s bs=%lld param=%s grad=%s out=%s decoupled=%d",
                static_cast<long long>(n), int8 ? "int8" : "bf16", static_cast<long long>(bs),
                bf16_param ? "bf16" : "fp32", zk::dtype_name(gdt), zk::dtype_name(odt),
                base.decoupled ? 1 : 0);
  for (int t = 1; t <= 3; ++t) {
    AdamWConfig c = base;
    c.step = t;
    const Grads g = make_grads(n, gdt, static_cast<float>(c.grad_scale), 100u + t);
    const Isa ran = adamw_step_lowbit(buffers(s, int8, bs, bf16_param, g, gdt, out16, odt), c,
                                      isa, n > 16384 ? 2 : 1);
    CHECK(ran == isa, "ran %s, forced %s", isa_name(ran), isa_name(isa));
    recipe(c, int8, bs, bf16_param, e, g.gref, outp);
  }
  compare(isa, what, s, e, out16, outp, odt);
}

static void test_found_inf(Isa isa) {
  State s = make_state(37, 8, 5);
  const State before = s;
  const Grads g = make_grads(37, DType::kFloat32, 1.0f, 9);
  std::vector<uint16_t> out(37, 0x1234);
  const float flag = 1.0f;
  for (bool int8 : {false, true}) {
    LowbitBuffers b = buffers(s, int8, 8, false, g, DType::kFloat32, out, DType::kBFloat16);
    b.found_inf = &flag;
    adamw_step_lowbit(b, AdamWConfig{}, isa, 1);
  }
  bool unchanged = s.p32 == before.p32 && s.m16 == before.m16 && s.qm == before.qm &&
                   s.qv == before.qv && s.sm == before.sm && s.sv == before.sv;
  for (uint16_t o : out) unchanged &= o == 0x1234;
  CHECK(unchanged, "%s: found_inf != 0 must leave every buffer untouched", isa_name(isa));
}

static void test_paths(Isa isa) {
  AdamWConfig adamw;
  adamw.lr = 1e-2; adamw.weight_decay = 0.01;
  AdamWConfig l2 = adamw;
  l2.decoupled = false; l2.grad_scale = 1024.0; l2.beta1 = 0.3; l2.beta2 = 0.5;
  AdamWConfig odd = adamw;
  odd.grad_scale = 1000.0;  // not a power of two: an IEEE division, as the reference's
  for (int64_t n : {1, 7, 17, 33, 1000, 2 * 16384 + 5}) {
    for (int64_t bs : {2, 64, 256, 8192}) {
      for (bool int8 : {false, true}) {
        if (!int8 && bs != 256) continue;  // the bf16 format has no blocks
        for (bool bf16_param : {false, true}) {
          for (DType g : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
            if (!have_f16c() && g == DType::kFloat16) continue;
            const DType o = g == DType::kFloat16 ? DType::kFloat16 : DType::kBFloat16;
            test_case(isa, n, int8, bs, bf16_param, g, o, adamw);
            test_case(isa, n, int8, bs, bf16_param, g, o, g == DType::kBFloat16 ? l2 : odd);
          }
        }
      }
    }
  }
  test_found_inf(isa);
}

template <typename F>
static void expect_invalid(F f, const char* what, const char* needle) {
  try {
    f();
    CHECK(false, "%s: no exception", what);
  } catch (const std::invalid_argument& e) {
    CHECK(std::strstr(e.what(), needle) != nullptr, "%s: message '%s' lacks '%s'", what,
          e.what(), needle);
  }
}

static void test_errors() {
  State s = make_state(4, 2, 1);
  const Grads g = make_grads(4, DType::kFloat32, 1.0f, 2);
  std::vector<uint16_t> out(4);
  const LowbitBuffers b = buffers(s, true, 2, false, g, DType::kFloat32, out, DType::kBFloat16);
  const AdamWConfig c;
  expect_invalid([&] { LowbitBuffers x = b; x.block_size = 48; adamw_step_lowbit(x, c); },
                 "block", "block_size");
  expect_invalid([&] { LowbitBuffers x = b; x.exp_avg_sq_scales = nullptr;
                       adamw_step_lowbit(x, c); }, "scales", "exp_avg_sq_scales");
  expect_invalid([&] { LowbitBuffers x = b; x.param_dtype = DType::kFloat16;
                       adamw_step_lowbit(x, c); }, "param dtype", "param");
  expect_invalid([&] { AdamWConfig y; y.beta2 = 1.0; adamw_step_lowbit(b, y); }, "beta2", "beta2");
  expect_invalid([&] { AdamWConfig y; y.step = 0; adamw_step_lowbit(b, y); }, "step", "step");
  expect_invalid([&] { AdamWConfig y; y.grad_scale = 0; adamw_step_lowbit(b, y); }, "scale",
                 "grad_scale");
  expect_invalid([&] { adamw_step_lowbit(b, c, Isa::kAuto, -1); }, "threads", "num_threads");
  std::printf("errors ok\n");
}

#if defined(__x86_64__)
// The mismatches of lowbit::quotient(x, b, RN(1 / b)) against x / b over every significand of
// x in [lo, 2 lo) (8 lanes at a time).
ZK_SIMD static int64_t quotient_mismatches(float b, float lo) {
  using V = zk::simd::Avx2;
  const V::F vb = V::set1(b), inv = V::set1(1.0f / b);
  int64_t bad = 0;
  for (uint32_t u = bits(lo), end = bits(lo) + (1u << 23); u < end; u += V::kWidth) {
    const V::I lanes = _mm256_add_epi32(V::set1i(u), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const V::F x = V::from_bits(lanes);
    const V::I fast = V::bits(lowbit::quotient<V>(x, vb, inv)), ieee = V::bits(V::div(x, vb));
    bad += __builtin_popcount(static_cast<unsigned>(
        _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(fast, ieee))) ^ 0xFF));
  }
  return bad;
}
#endif

// [Note: dividing by a constant without the divider] (tile.h): the product-and-two-FMAs
// quotient equals the IEEE division for x over two whole octaves around b (exponents shift
// both exactly, so these stand for every x / b within the note's ranges), for the divisors
// the note names and 200 random significands, at exponents from 2^-60 to 2^125.
static void test_quotient() {
#if defined(__x86_64__)
  if (!isa_supported(Isa::kAvx2)) {
    std::printf("quotient: no AVX2, not run\n");
    return;
  }
  std::vector<float> divisors = {1.0f, 3.0f, 0.1f, from_bits(0x3F7FFFFFu),
                                 from_bits(0x3F800001u), from_bits(0x3FFFFFFFu)};
  std::mt19937 rng(11);
  for (int i = 0; i < 200; ++i) {
    const uint32_t exp = 127 - 60 + static_cast<uint32_t>(rng() % 186);  // 2^-60 .. 2^125
    divisors.push_back(from_bits((exp << 23) | (rng() & 0x7FFFFFu)));
  }
  for (float b : divisors) {
    const float lo = from_bits(bits(b) & 0x7F800000u);  // 2^floor(log2 b)
    const int64_t bad = quotient_mismatches(b, lo) + quotient_mismatches(b, lo * 0.5f);
    CHECK(bad == 0, "quotient: %lld of 2^24 quotients by %a differ from the division",
          static_cast<long long>(bad), b);
  }
  std::printf("quotient ok (%zu divisors)\n", divisors.size());
#endif
}

int main() {
  test_errors();
  test_quotient();
  return run_paths(test_paths);
}
