// What the C++ tests of the CPU libraries share: CHECK (counts failures, prints the first
// 30), bit casts, independent references of the fp32 -> bf16 / fp16 roundings, and the loop
// that forces every SIMD path the CPU supports in turn.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstdio>

#include "cpu_convert.h"
#include "simd/isa.h"

namespace zk_test {

inline int g_failures = 0;

constexpr auto& bits = zk::cpu::detail::bits_of;
constexpr auto& from_bits = zk::cpu::detail::float_of;

// Exact round-to-nearest-even to bf16 by comparing the two neighbours in double; NaN -> `nan`.
inline uint16_t exact_bf16(float x, uint16_t nan = 0xFFFF) {
  if (std::isnan(x)) return nan;
  const uint32_t lo = bits(x) >> 16;
  const double a = std::fabs(static_cast<double>(x));
  const double dlo = std::fabs(static_cast<double>(from_bits(lo << 16)));
  if (std::isinf(x)) return static_cast<uint16_t>(lo);
  // the next bf16 up, with an unbounded exponent (past the largest finite value: 2^128)
  const double dhi = ((lo + 1) & 0x7FFF) == 0x7F80
                         ? std::ldexp(1.0, 128)
                         : std::fabs(static_cast<double>(from_bits((lo + 1) << 16)));
  const double below = a - dlo, above = dhi - a;
  if (below < above || (below == above && (lo & 1) == 0)) return static_cast<uint16_t>(lo);
  return static_cast<uint16_t>(lo + 1);
}

#if defined(__x86_64__)
__attribute__((target("f16c"))) inline uint16_t hw_fp16(float x) {
  return static_cast<uint16_t>(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT));
}
__attribute__((target("f16c"))) inline float hw_from_fp16(uint16_t h) { return _cvtsh_ss(h); }
inline bool have_f16c() { return __builtin_cpu_supports("f16c"); }
#else  // no hardware reference: the fp16 conversions are then checked only against the scalar path
inline uint16_t hw_fp16(float) { return 0; }
inline float hw_from_fp16(uint16_t) { return 0.0f; }
inline bool have_f16c() { return false; }
#endif

// fn(isa) for every path, forced in turn; prints "PATH <isa> ok" for each that ran (and
// passed), "PATH <isa> unsupported on this CPU" for the others, then the best path and
// returns the exit status (0 iff no CHECK failed).
template <typename Fn>
int run_paths(Fn fn) {
  using zk::cpu::Isa;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (!zk::cpu::isa_supported(isa)) {
      std::printf("PATH %s unsupported on this CPU\n", zk::cpu::isa_name(isa));
      continue;
    }
    const int before = g_failures;
    fn(isa);
    if (g_failures == before) std::printf("PATH %s ok\n", zk::cpu::isa_name(isa));
  }
  std::printf("best path: %s\n", zk::cpu::isa_name(zk::cpu::best_isa()));
  if (g_failures) std::fprintf(stderr, "%d check(s) failed\n", g_failures);
  return g_failures ? 1 : 0;
}

}  // namespace zk_test

#define CHECK(cond, ...)                                                         \
  do {                                                                           \
    if (!(cond)) {                                                               \
      if (++zk_test::g_failures <= 30) {                                         \
        std::fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);     \
        std::fprintf(stderr, __VA_ARGS__);                                       \
        std::fprintf(stderr, "\n");                                              \
      }                                                                          \
    }                                                                            \
  } while (0)
