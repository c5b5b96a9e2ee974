// C++ tests of csrc/cpu_adam: every SIMD path the CPU supports, forced in turn, against an
// independent scalar reference written here (bit for bit: all paths do the same IEEE ops), a
// double-precision AdamW (tolerance), and the conversions against hardware/exact rounding.
// Exit status 0 iff every check passed; each path prints "PATH <name> ok" when it ran.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "check.h"
#include "cpu_adam/cpu_adam.h"

using zk::DType;
using namespace zk::cpu;
using namespace zk_test;

static void test_conversions() {
  std::vector<uint32_t> patterns = {0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x00800000,
                                    0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
                                    0x7F800001, 0x7FA00000, 0xFFFFFFFF, 0x3F808000, 0x3F818000,
                                    0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x38800000,
                                    0x387FFFFF, 0x33000000, 0x33000001, 0x33800000, 0x337FFFFF,
                                    0x3F7FFFFF, 0x3F800000, 0x7F7FFF80, 0x7F7F8000};
  std::mt19937 rng(1234);
  for (int i = 0; i < 2000000; ++i) patterns.push_back(static_cast<uint32_t>(rng()));
  // dense sweep of the fp16 subnormal/normal boundary and the overflow edge
  for (uint32_t u = 0x33000000; u < 0x39000000; u += 0x1F3) patterns.push_back(u);
  for (uint32_t u = 0x477F0000; u < 0x47810000; u += 7) patterns.push_back(u);
  const bool f16c = have_f16c();
  for (uint32_t u : patterns) {
    const float x = from_bits(u);
    CHECK(float_to_bf16(x) == exact_bf16(x), "bf16 of 0x%08x: got 0x%04x want 0x%04x", u,
          float_to_bf16(x), exact_bf16(x));
    if (f16c) {
      CHECK(float_to_fp16(x) == hw_fp16(x), "fp16 of 0x%08x: got 0x%04x want 0x%04x", u,
            float_to_fp16(x), hw_fp16(x));
    }
  }
  for (uint32_t h = 0; h < 65536; ++h) {
    const float b = bf16_to_float(static_cast<uint16_t>(h));
    CHECK(bits(b) == h << 16, "bf16->f32 of 0x%04x", h);
    if (f16c) {
      const float f = fp16_to_float(static_cast<uint16_t>(h));
      const float want = hw_from_fp16(static_cast<uint16_t>(h));
      CHECK(bits(f) == bits(want), "fp16->f32 of 0x%04x: got 0x%08x want 0x%08x", h, bits(f),
            bits(want));
    }
  }
  std::printf("conversions ok (%zu patterns, f16c reference %s)\n", patterns.size(),
              f16c ? "on" : "off");
}

// ---- AdamW -----------------------------------------------------------------------------

struct Case {
  AdamWConfig cfg;
  const char* name;
};

static float grad_value(const std::vector<uint16_t>& g16, const std::vector<float>& g32,
                        DType dt, size_t i) {
  if (dt == DType::kFloat32) return g32[i];
  return dt == DType::kBFloat16 ? bf16_to_float(g16[i]) : fp16_to_float(g16[i]);
}

// The reference recipe (zkernels/reference/adamw.py), one float operation at a time.
static void reference_step(const AdamWConfig& c, std::vector<float>& p, const std::vector<float>& g,
                           std::vector<float>& m, std::vector<float>& v) {
  const float inv_scale = static_cast<float>(1.0 / c.grad_scale);
  const float decay = static_cast<float>(c.decoupled ? 1.0 - c.lr * c.weight_decay : 1.0);
  const float w = static_cast<float>(1.0 - c.beta1);
  const float b2 = static_cast<float>(c.beta2), omb2 = static_cast<float>(1.0 - c.beta2);
  const float ibc2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(c.beta2, c.step)));
  const float nss = static_cast<float>(-c.lr / (1.0 - std::pow(c.beta1, c.step)));
  const float eps = static_cast<float>(c.eps), wd = static_cast<float>(c.weight_decay);
  for (size_t i = 0; i < p.size(); ++i) {
    float gi = g[i] * inv_scale;
    if (!c.decoupled && c.weight_decay != 0.0) gi = gi + wd * p[i];
    p[i] = p[i] * decay;
    const float d = gi - m[i];
    m[i] = std::fabs(w) < 0.5f ? m[i] + w * d : gi - d * (1.0f - w);
    v[i] = v[i] * b2 + (omb2 * gi) * gi;
    p[i] = p[i] + nss * (m[i] / (std::sqrt(v[i]) * ibc2 + eps));
  }
}

// The same step in double: the float recipe must stay within fp32 round-off of it.
static void double_step(const AdamWConfig& c, std::vector<double>& p, const std::vector<float>& g,
                        std::vector<double>& m, std::vector<double>& v) {
  for (size_t i = 0; i < p.size(); ++i) {
    double gi = g[i] / c.grad_scale;
    if (!c.decoupled) gi += c.weight_decay * p[i];
    else p[i] *= 1.0 - c.lr * c.weight_decay;
    m[i] = c.beta1 * m[i] + (1.0 - c.beta1) * gi;
    v[i] = c.beta2 * v[i] + (1.0 - c.beta2) * gi * gi;
    const double denom = std::sqrt(v[i] / (1.0 - std::pow(c.beta2, c.step))) + c.eps;
    p[i] -= c.lr / (1.0 - std::pow(c.beta1, c.step)) * m[i] / denom;
  }
}

static bool same(float a, float b) {
  return bits(a) == bits(b) || (std::isnan(a) && std::isnan(b));
}

static void run_case(Isa isa, const Case& cs, int64_t n, DType gdt, int out_kind, int threads) {
  std::mt19937 rng(static_cast<uint32_t>(n * 31 + static_cast<int>(gdt) * 7 + out_kind));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> p(n), m(n), v(n), g32(n);
  std::vector<uint16_t> g16(n);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = normal(rng);
    m[i] = 0.1f * normal(rng);
    v[i] = 0.01f * std::fabs(normal(rng));
    g32[i] = normal(rng) * static_cast<float>(cs.cfg.grad_scale);
    g16[i] = gdt == DType::kFloat16 ? float_to_fp16(g32[i]) : float_to_bf16(g32[i]);
  }
  if (n > 3) {  // specials in the params: they must flow through every path identically
    p[1] = INFINITY;
    p[2] = from_bits(0x00000123);  // subnormal
    p[3] = NAN;
  }
  std::vector<float> gref(n);
  for (int64_t i = 0; i < n; ++i) gref[i] = grad_value(g16, g32, gdt, i);
  std::vector<float> rp = p, rm = m, rv = v;
  std::vector<double> dp(p.begin(), p.end()), dm(m.begin(), m.end()), dv(v.begin(), v.end());
  std::vector<float> out32(n, -7.0f);
  std::vector<uint16_t> out16(n, 0xABCD);
  const DType odt = out_kind < 0 ? DType::kFloat32 : static_cast<DType>(out_kind);
  for (int s = 1; s <= 3; ++s) {
    AdamWConfig cfg = cs.cfg;
    cfg.step = s;
    AdamWBuffers b;
    b.param = p.data();
    b.grad = gdt == DType::kFloat32 ? static_cast<const void*>(g32.data()) : g16.data();
    b.grad_dtype = gdt;
    b.exp_avg = m.data();
    b.exp_avg_sq = v.data();
    b.numel = n;
    if (out_kind >= 0) {
      b.out = odt == DType::kFloat32 ? static_cast<void*>(out32.data()) : out16.data();
      b.out_dtype = odt;
    }
    const Isa ran = adamw_step(b, cfg, isa, threads);
    CHECK(ran == isa, "ran %s, forced %s", isa_name(ran), isa_name(isa));
    reference_step(cfg, rp, gref, rm, rv);
    double_step(cfg, dp, gref, dm, dv);
  }
  int bad = 0;
  for (int64_t i = 0; i < n && bad < 3; ++i) {
    const bool ok = same(p[i], rp[i]) && same(m[i], rm[i]) && same(v[i], rv[i]);
    if (!ok) ++bad;
    CHECK(ok, "%s %s n=%lld grad=%s i=%lld: p %a/%a m %a/%a v %a/%a", isa_name(isa), cs.name,
          static_cast<long long>(n), zk::dtype_name(gdt), static_cast<long long>(i), p[i], rp[i],
          m[i], rm[i], v[i], rv[i]);
    if (out_kind < 0) continue;
    if (odt == DType::kFloat32) {
      CHECK(same(out32[i], p[i]), "%s out f32 i=%lld", isa_name(isa), static_cast<long long>(i));
    } else {
      const uint16_t want = odt == DType::kBFloat16 ? float_to_bf16(p[i]) : float_to_fp16(p[i]);
      const bool nan16 = odt == DType::kFloat16 && std::isnan(p[i]) &&
                         (out16[i] & 0x7C00) == 0x7C00 && (out16[i] & 0x3FF) != 0;
      CHECK(out16[i] == want || nan16, "%s out %s i=%lld: 0x%04x want 0x%04x", isa_name(isa),
            zk::dtype_name(odt), static_cast<long long>(i), out16[i], want);
    }
  }
  // rtol/atol of tests/conftest.py's fp32 row, on the normal elements (4.. skip the specials)
  int far = 0;
  for (int64_t i = 4; i < n && far < 3; ++i) {
    const bool close = std::fabs(rp[i] - dp[i]) <= 1e-6 + 1e-5 * std::fabs(dp[i]);
    if (!close) ++far;
    CHECK(close, "%s n=%lld i=%lld: float %.9g vs double %.9g", cs.name,
          static_cast<long long>(n), static_cast<long long>(i), rp[i], dp[i]);
  }
}

static void test_adamw(Isa isa) {
  std::vector<Case> cases;
  {
    Case c{AdamWConfig{}, "adamw"};
    c.cfg.lr = 1e-2; c.cfg.weight_decay = 0.01;
    cases.push_back(c);
    Case l2{AdamWConfig{}, "adam-l2"};
    l2.cfg.decoupled = false; l2.cfg.weight_decay = 0.1;
    cases.push_back(l2);
    Case lerp{AdamWConfig{}, "beta1=0.3"};
    lerp.cfg.beta1 = 0.3; lerp.cfg.lr = 0.1;
    cases.push_back(lerp);
    Case scaled{AdamWConfig{}, "grad_scale=1024"};
    scaled.cfg.grad_scale = 1024.0;
    cases.push_back(scaled);
  }
  const int64_t sizes[] = {0, 1, 7, 15, 16, 17, 31, 33, 1000, 2 * 16384 + 5};
  for (const Case& cs : cases) {
    for (int64_t n : sizes) {
      for (DType g : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
        for (int out_kind : {-1, 0, 1, 2}) run_case(isa, cs, n, g, out_kind, n > 16384 ? 2 : 1);
      }
    }
  }
  // found_inf: nothing changes, not even the out copy
  std::vector<float> p(37, 1.0f), m(37, 0.5f), v(37, 0.25f), g(37, 3.0f);
  std::vector<uint16_t> out(37, 0x1234);
  const float inf_flag = 1.0f;
  AdamWBuffers b;
  b.param = p.data(); b.grad = g.data(); b.exp_avg = m.data(); b.exp_avg_sq = v.data();
  b.numel = 37; b.found_inf = &inf_flag; b.out = out.data(); b.out_dtype = DType::kBFloat16;
  adamw_step(b, AdamWConfig{}, isa, 1);
  bool unchanged = true;
  for (int i = 0; i < 37; ++i) {
    unchanged &= p[i] == 1.0f && m[i] == 0.5f && v[i] == 0.25f && out[i] == 0x1234;
  }
  CHECK(unchanged, "%s: found_inf != 0 must leave every buffer untouched", isa_name(isa));
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
  std::vector<float> x(4, 0.0f);
  AdamWBuffers b;
  b.param = x.data(); b.grad = x.data(); b.exp_avg = x.data(); b.exp_avg_sq = x.data();
  b.numel = 4;
  AdamWConfig cfg;
  expect_invalid([&] { parse_isa("sse9"); }, "bad isa name", "isa must be one of");
  expect_invalid([&] { AdamWConfig c = cfg; c.step = 0; adamw_step(b, c); }, "step 0", "step");
  expect_invalid([&] { AdamWConfig c = cfg; c.beta1 = 1.0; adamw_step(b, c); }, "beta1", "beta1");
  expect_invalid([&] { AdamWConfig c = cfg; c.grad_scale = 0; adamw_step(b, c); }, "scale 0",
                 "grad_scale");
  expect_invalid([&] { AdamWBuffers bb = b; bb.exp_avg = nullptr; adamw_step(bb, cfg); },
                 "null exp_avg", "exp_avg");
  expect_invalid([&] { adamw_step(b, cfg, Isa::kAuto, -1); }, "threads", "num_threads");
  std::printf("errors ok\n");
}

int main() {
  test_conversions();
  test_errors();
  return run_paths(test_adamw);
}
