// C++ tests of csrc/optim (Lion, SGD, AdEMAMix through optimizer_step): every SIMD path the CPU
// supports, forced in turn, against an independent scalar recipe written here (bit for bit: all
// paths do the same IEEE ops), a double-precision recipe (tolerance), found_inf and the
// argument checks.
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
#include "optim/optimizer.h"

using zk::DType;
using namespace zk::cpu;
using namespace zk_test;

// The hyperparameters of the recipes; the coefficient tuples are zkernels/optimizers' (by
// position: lion.py, sgd.py, ademamix.py).
struct LionConfig {
  double lr = 1e-4, beta1 = 0.9, beta2 = 0.99, weight_decay = 0.0, grad_scale = 1.0;
  std::vector<double> coeffs() const {
    return {beta1, 1.0 - beta1, beta2, 1.0 - beta2, 1.0 - lr * weight_decay, -lr};
  }
};

struct SgdConfig {
  double lr = 1e-2, momentum = 0.0, dampening = 0.0, weight_decay = 0.0;
  bool nesterov = false, first_step = false;
  double grad_scale = 1.0;
  std::vector<double> coeffs() const {
    return {weight_decay, momentum, 1.0 - dampening, -lr, first_step ? 1.0 : 0.0,
            nesterov ? 1.0 : 0.0};
  }
};

struct OptimBuffers {  // one state buffer (Lion's exp_avg, SGD's momentum_buffer)
  float* param = nullptr;
  const void* grad = nullptr;
  DType grad_dtype = DType::kFloat32;
  float* state = nullptr;
  int64_t numel = 0;
  const float* found_inf = nullptr;
  void* out = nullptr;
  DType out_dtype = DType::kFloat32;
  StepBuffers step() const {
    StepBuffers b;
    b.param = param; b.grad = grad; b.grad_dtype = grad_dtype; b.states[0] = state;
    b.numel = numel; b.found_inf = found_inf; b.out = out; b.out_dtype = out_dtype;
    return b;
  }
};

static Isa lion_step(const OptimBuffers& b, const LionConfig& c, Isa isa = Isa::kAuto,
                     int threads = 0) {
  const std::vector<double> k = c.coeffs();
  return optimizer_step("lion", b.step(), k.data(), static_cast<int>(k.size()), c.grad_scale,
                        isa, threads);
}

static Isa sgd_step(const OptimBuffers& b, const SgdConfig& c, Isa isa = Isa::kAuto,
                    int threads = 0) {
  const std::vector<double> k = c.coeffs();
  return optimizer_step("sgd", b.step(), k.data(), static_cast<int>(k.size()), c.grad_scale,
                        isa, threads);
}

static bool same(float a, float b) {
  return bits(a) == bits(b) || (std::isnan(a) && std::isnan(b));
}

// The reference recipes (zkernels/reference/lion.py, sgd.py), one float operation at a time.
static float sign_of(float x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f); }

static void lion_recipe(const LionConfig& c, std::vector<float>& p, const std::vector<float>& g,
                        std::vector<float>& m) {
  const float is = static_cast<float>(1.0 / c.grad_scale);
  const float decay = static_cast<float>(1.0 - c.lr * c.weight_decay);
  const float b1 = static_cast<float>(c.beta1), omb1 = static_cast<float>(1.0 - c.beta1);
  const float b2 = static_cast<float>(c.beta2), omb2 = static_cast<float>(1.0 - c.beta2);
  const float nlr = static_cast<float>(-c.lr);
  for (size_t i = 0; i < p.size(); ++i) {
    const float gi = g[i] * is;
    const float t1 = m[i] * b1, t2 = gi * omb1;
    const float u = sign_of(t1 + t2);
    p[i] = p[i] * decay;
    p[i] = p[i] + u * nlr;
    const float t3 = m[i] * b2, t4 = gi * omb2;
    m[i] = t3 + t4;
  }
}

static void sgd_recipe(const SgdConfig& c, std::vector<float>& p, const std::vector<float>& g,
                       std::vector<float>& b) {
  const float is = static_cast<float>(1.0 / c.grad_scale), wd = static_cast<float>(c.weight_decay);
  const float mom = static_cast<float>(c.momentum), omd = static_cast<float>(1.0 - c.dampening);
  const float nlr = static_cast<float>(-c.lr);
  for (size_t i = 0; i < p.size(); ++i) {
    float gi = g[i] * is;
    if (c.weight_decay != 0.0) gi = gi + p[i] * wd;
    if (c.momentum != 0.0) {
      if (c.first_step) {
        b[i] = gi;
      } else {
        const float t1 = b[i] * mom, t2 = gi * omd;
        b[i] = t1 + t2;
      }
      gi = c.nesterov ? gi + b[i] * mom : b[i];
    }
    p[i] = p[i] + gi * nlr;
  }
}

// The same steps in double: the float recipes must stay within fp32 round-off of them.
static void sgd_double(const SgdConfig& c, std::vector<double>& p, const std::vector<float>& g,
                       std::vector<double>& b) {
  for (size_t i = 0; i < p.size(); ++i) {
    double gi = g[i] / c.grad_scale + c.weight_decay * p[i];
    if (c.momentum != 0.0) {
      b[i] = c.first_step ? gi : c.momentum * b[i] + (1.0 - c.dampening) * gi;
      gi = c.nesterov ? gi + c.momentum * b[i] : b[i];
    }
    p[i] -= c.lr * gi;
  }
}

struct Data {
  std::vector<float> p, s, g32;
  std::vector<uint16_t> g16;
  std::vector<float> gref;
};

static Data make(int64_t n, DType gdt, double scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Data d{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n),
         std::vector<uint16_t>(n), std::vector<float>(n)};
  for (int64_t i = 0; i < n; ++i) {
    d.p[i] = normal(rng);
    d.s[i] = 0.1f * normal(rng);
    d.g32[i] = normal(rng) * static_cast<float>(scale);
    d.g16[i] = gdt == DType::kFloat16 ? hw_fp16(d.g32[i]) : exact_bf16(d.g32[i]);
  }
  if (n > 4) {  // specials: they must flow through every path identically
    d.p[1] = INFINITY;
    d.p[2] = from_bits(0x00000123);
    d.p[3] = NAN;
    d.g32[4] = 0.0f;  // sign(0) lanes when the state is 0 too
    d.s[4] = 0.0f;
  }
  for (int64_t i = 0; i < n; ++i) {
    if (gdt == DType::kFloat32) d.gref[i] = d.g32[i];
    else if (gdt == DType::kBFloat16) d.gref[i] = from_bits(static_cast<uint32_t>(d.g16[i]) << 16);
    else d.gref[i] = hw_from_fp16(d.g16[i]);
  }
  return d;
}

static OptimBuffers buffers(Data& d, DType gdt, std::vector<uint16_t>& out16, DType odt) {
  OptimBuffers b;
  b.param = d.p.data();
  b.grad = gdt == DType::kFloat32 ? static_cast<const void*>(d.g32.data()) : d.g16.data();
  b.grad_dtype = gdt;
  b.state = d.s.data();
  b.numel = static_cast<int64_t>(d.p.size());
  b.out = out16.data();
  b.out_dtype = odt;
  return b;
}

static void check_out(Isa isa, const char* what, const std::vector<float>& p,
                      const std::vector<uint16_t>& out16, DType odt) {
  int bad = 0;
  for (size_t i = 0; i < p.size() && bad < 3; ++i) {
    const uint16_t want = odt == DType::kBFloat16 ? exact_bf16(p[i]) : hw_fp16(p[i]);
    const bool nan16 = odt == DType::kFloat16 && std::isnan(p[i]) && (out16[i] & 0x7C00) == 0x7C00;
    const bool ok = out16[i] == want || nan16;
    bad += !ok;
    CHECK(ok, "%s %s out %s i=%zu: 0x%04x want 0x%04x", isa_name(isa), what, zk::dtype_name(odt),
          i, out16[i], want);
  }
}

static void compare(Isa isa, const char* what, int64_t n, const Data& d, const std::vector<float>& rp,
                    const std::vector<float>& rs) {
  int bad = 0;
  for (int64_t i = 0; i < n && bad < 3; ++i) {
    const bool ok = same(d.p[i], rp[i]) && same(d.s[i], rs[i]);
    bad += !ok;
    CHECK(ok, "%s %s n=%lld i=%lld: p %a/%a state %a/%a", isa_name(isa), what,
          static_cast<long long>(n), static_cast<long long>(i), d.p[i], rp[i], d.s[i], rs[i]);
  }
}

static void test_lion(Isa isa, int64_t n, DType gdt, DType odt) {
  LionConfig c;
  c.lr = 1e-3; c.beta1 = 0.9; c.beta2 = 0.99; c.weight_decay = 0.1; c.grad_scale = 1024.0;
  Data d = make(n, gdt, c.grad_scale, static_cast<uint32_t>(n * 3 + static_cast<int>(gdt)));
  std::vector<float> rp = d.p, rs = d.s;
  std::vector<uint16_t> out16(n, 0xABCD);
  for (int s = 0; s < 3; ++s) {
    const Isa ran = lion_step(buffers(d, gdt, out16, odt), c, isa, n > 16384 ? 2 : 1);
    CHECK(ran == isa, "ran %s, forced %s", isa_name(ran), isa_name(isa));
    lion_recipe(c, rp, d.gref, rs);
  }
  compare(isa, "lion", n, d, rp, rs);
  check_out(isa, "lion", d.p, out16, odt);
}

static void test_sgd(Isa isa, int64_t n, DType gdt, DType odt, bool nesterov, double damp) {
  SgdConfig c;
  c.lr = 1e-2; c.momentum = 0.9; c.dampening = damp; c.weight_decay = 1e-2;
  c.nesterov = nesterov;
  Data d = make(n, gdt, 1.0, static_cast<uint32_t>(n * 5 + static_cast<int>(gdt)));
  std::vector<float> rp = d.p, rs = d.s;
  std::vector<double> dp(d.p.begin(), d.p.end()), ds(d.s.begin(), d.s.end());
  std::vector<uint16_t> out16(n, 0xABCD);
  for (int s = 1; s <= 3; ++s) {
    c.first_step = s == 1;
    const Isa ran = sgd_step(buffers(d, gdt, out16, odt), c, isa, n > 16384 ? 2 : 1);
    CHECK(ran == isa, "ran %s, forced %s", isa_name(ran), isa_name(isa));
    sgd_recipe(c, rp, d.gref, rs);
    sgd_double(c, dp, d.gref, ds);
  }
  compare(isa, nesterov ? "sgd-nesterov" : "sgd", n, d, rp, rs);
  check_out(isa, "sgd", d.p, out16, odt);
  int far = 0;
  for (int64_t i = 5; i < n && far < 3; ++i) {
    const bool close = std::fabs(rp[i] - dp[i]) <= 1e-6 + 1e-5 * std::fabs(dp[i]);
    far += !close;
    CHECK(close, "sgd n=%lld i=%lld: float %.9g vs double %.9g", static_cast<long long>(n),
          static_cast<long long>(i), rp[i], dp[i]);
  }
  // momentum 0: no state buffer needed, plain p -= lr * (g + wd * p)
  SgdConfig plain = c;
  plain.momentum = 0.0; plain.nesterov = false;
  Data e = make(n, gdt, 1.0, 77);
  std::vector<float> ep = e.p, unused;
  OptimBuffers b = buffers(e, gdt, out16, odt);
  b.state = nullptr;
  sgd_step(b, plain, isa, 1);
  sgd_recipe(plain, ep, e.gref, unused);
  bool ok = true;
  for (int64_t i = 0; i < n; ++i) ok &= same(e.p[i], ep[i]);
  CHECK(ok, "%s sgd momentum=0 n=%lld", isa_name(isa), static_cast<long long>(n));
}

// AdEMAMix (SEAM 3): its coefficients at step t, then its element math one float op at a time.
static std::vector<double> ademamix_coeffs(int t) {
  const double b1 = 0.9, b2 = 0.999, b3 = 0.9999, alpha = 5.0;
  return {b1, 1.0 - b1, b2, 1.0 - b2, b3, 1.0 - b3, alpha, 1.0 - std::pow(b1, t),
          std::sqrt(1.0 - std::pow(b2, t)), 1e-8, 0.1, 1e-3};
}

static void ademamix_recipe(const std::vector<double>& cd, float inv_scale, std::vector<float>& p,
                            const std::vector<float>& g, std::vector<float>& m1,
                            std::vector<float>& m2, std::vector<float>& v) {
  float c[12];
  for (int j = 0; j < 12; ++j) c[j] = static_cast<float>(cd[j]);
  for (size_t i = 0; i < p.size(); ++i) {
    const float gi = g[i] * inv_scale;
    m1[i] = m1[i] * c[0] + gi * c[1];
    m2[i] = m2[i] * c[4] + gi * c[5];
    const float gg = gi * gi;
    v[i] = v[i] * c[2] + gg * c[3];
    const float d = std::sqrt(v[i]) / c[8] + c[9];
    const float num = m1[i] / c[7] + m2[i] * c[6];
    float u = num / d;
    u = u + p[i] * c[10];
    p[i] = p[i] - u * c[11];
  }
}

static void test_ademamix(Isa isa, int64_t n, DType gdt, DType odt) {
  Data d = make(n, gdt, 1024.0, static_cast<uint32_t>(n * 7 + static_cast<int>(gdt)));
  std::vector<float> m1 = d.s, m2(n), v(n);
  for (int64_t i = 0; i < n; ++i) {
    m2[i] = 0.5f * d.s[i];
    v[i] = d.s[i] * d.s[i];
  }
  std::vector<float> rp = d.p, r1 = m1, r2 = m2, rv = v;
  std::vector<uint16_t> out16(n, 0xABCD);
  for (int t = 1; t <= 3; ++t) {
    const std::vector<double> c = ademamix_coeffs(t);
    StepBuffers b = buffers(d, gdt, out16, odt).step();
    b.states[0] = m1.data(); b.states[1] = m2.data(); b.states[2] = v.data();
    const Isa ran = optimizer_step("ademamix", b, c.data(), 12, 1024.0, isa, n > 16384 ? 2 : 1);
    CHECK(ran == isa, "ran %s, forced %s", isa_name(ran), isa_name(isa));
    ademamix_recipe(c, 1.0f / 1024.0f, rp, d.gref, r1, r2, rv);
  }
  int bad = 0;
  for (int64_t i = 0; i < n && bad < 3; ++i) {
    const bool ok = same(d.p[i], rp[i]) && same(m1[i], r1[i]) && same(m2[i], r2[i]) &&
                    same(v[i], rv[i]);
    bad += !ok;
    CHECK(ok, "%s ademamix n=%lld i=%lld: p %a/%a m1 %a/%a m2 %a/%a v %a/%a", isa_name(isa),
          static_cast<long long>(n), static_cast<long long>(i), d.p[i], rp[i], m1[i], r1[i],
          m2[i], r2[i], v[i], rv[i]);
  }
  check_out(isa, "ademamix", d.p, out16, odt);
}

static void test_found_inf(Isa isa) {
  std::vector<float> p(37, 1.0f), m(37, 0.5f), g(37, 3.0f);
  std::vector<uint16_t> out(37, 0x1234);
  const float inf_flag = 1.0f;
  OptimBuffers b;
  b.param = p.data(); b.grad = g.data(); b.state = m.data(); b.numel = 37;
  b.found_inf = &inf_flag; b.out = out.data(); b.out_dtype = DType::kBFloat16;
  lion_step(b, LionConfig{}, isa, 1);
  SgdConfig s;
  s.momentum = 0.9;
  sgd_step(b, s, isa, 1);
  bool unchanged = true;
  for (int i = 0; i < 37; ++i) unchanged &= p[i] == 1.0f && m[i] == 0.5f && out[i] == 0x1234;
  CHECK(unchanged, "%s: found_inf != 0 must leave every buffer untouched", isa_name(isa));
}

static void test_paths(Isa isa) {
  const int64_t sizes[] = {0, 1, 7, 15, 16, 17, 33, 1000, 2 * 16384 + 5};
  for (int64_t n : sizes) {
    for (DType g : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      for (DType o : {DType::kBFloat16, DType::kFloat16}) {
        // the fp16 expectations come from F16C (check.h)
        if (!have_f16c() && (g == DType::kFloat16 || o == DType::kFloat16)) continue;
        test_lion(isa, n, g, o);
        test_sgd(isa, n, g, o, /*nesterov=*/false, /*damp=*/0.1);
        test_sgd(isa, n, g, o, /*nesterov=*/true, /*damp=*/0.0);
        test_ademamix(isa, n, g, o);
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
  std::vector<float> x(4, 0.0f);
  OptimBuffers b;
  b.param = x.data(); b.grad = x.data(); b.state = x.data(); b.numel = 4;
  expect_invalid([&] { LionConfig c; c.beta1 = 1.5; lion_step(b, c); }, "beta1", "beta1");
  expect_invalid([&] { LionConfig c; c.beta2 = -0.1; lion_step(b, c); }, "beta2", "beta2");
  expect_invalid([&] { LionConfig c; c.grad_scale = 0; lion_step(b, c); }, "scale", "grad_scale");
  expect_invalid([&] { OptimBuffers bb = b; bb.state = nullptr; lion_step(bb, LionConfig{}); },
                 "null state", "state");
  expect_invalid([&] { SgdConfig c; c.momentum = -1; sgd_step(b, c); }, "momentum", "momentum");
  expect_invalid([&] { SgdConfig c; c.nesterov = true; sgd_step(b, c); }, "nesterov", "nesterov");
  expect_invalid([&] { OptimBuffers bb = b; bb.state = nullptr; SgdConfig c; c.momentum = 0.9;
                       sgd_step(bb, c); }, "null buffer", "state");
  expect_invalid([&] { sgd_step(b, SgdConfig{}, Isa::kAuto, -1); }, "threads", "num_threads");
  const double c12[12] = {};
  StepBuffers sb = b.step();
  expect_invalid([&] { optimizer_step("adam", sb, c12, 12); }, "kind", "kind must be one of");
  expect_invalid([&] { optimizer_step("ademamix", sb, c12, 11); }, "coeffs", "12 coefficients");
  expect_invalid([&] { optimizer_step("ademamix", sb, c12, 12); }, "null m2", "exp_avg_slow");
  std::printf("errors ok\n");
}

int main() {
  test_errors();
  return run_paths(test_paths);
}
