// Vector traits of the scalar path: one fp32 lane, the IEEE operation of each trait on plain
// floats, and the dtype conversions of cpu_convert.h. With them a tile body written over the
// traits (csrc/optim/*.h, csrc/cpu_adam/tile.h) is also the scalar path, so no body is written
// twice. Only the traits those bodies and simd/vec.h use are here. Include it (or avx2.h,
// avx512.h) first, in the scalar instantiation of csrc/simd/path.cpp.
#pragma once

#if defined(ZK_SIMD)
#error "one ISA's vector traits per translation unit"
#endif

#include <cmath>
#include <cstdint>

#include "cpu_convert.h"

#define ZK_SIMD
#define ZK_SIMD_INLINE __attribute__((always_inline)) inline

namespace zk::simd {

struct Scalar {
  static constexpr int kWidth = 1;
  using F = float;
  using I = uint32_t;
  using H = uint16_t;
  struct Full {};
  using Part = Full;  // one lane: a ragged end never happens (for_vectors asks for none)
  static ZK_SIMD_INLINE Part part(int64_t) { return {}; }

  static ZK_SIMD_INLINE F load(const float* p, Full) { return *p; }
  static ZK_SIMD_INLINE void store(float* p, F x, Full) { *p = x; }
  static ZK_SIMD_INLINE H load_u16(const uint16_t* p, Full) { return *p; }
  static ZK_SIMD_INLINE void store_u16(uint16_t* p, H h, Full) { *p = h; }

  static ZK_SIMD_INLINE F set1(float x) { return x; }
  static ZK_SIMD_INLINE F add(F a, F b) { return a + b; }
  static ZK_SIMD_INLINE F sub(F a, F b) { return a - b; }
  static ZK_SIMD_INLINE F mul(F a, F b) { return a * b; }
  static ZK_SIMD_INLINE F div(F a, F b) { return a / b; }
  static ZK_SIMD_INLINE F sqrt(F a) { return std::sqrt(a); }  // -fno-math-errno: sqrtss
  // torch.sign: (0 < x) - (x < 0), so +-0 and NaN give +0
  static ZK_SIMD_INLINE F sign(F x) { return (0.0f < x ? 1.0f : 0.0f) - (x < 0.0f ? 1.0f : 0.0f); }

  static ZK_SIMD_INLINE I set1i(uint32_t x) { return x; }
  static ZK_SIMD_INLINE I bits(F x) { return cpu::detail::bits_of(x); }
  static ZK_SIMD_INLINE F from_bits(I u) { return cpu::detail::float_of(u); }
  static ZK_SIMD_INLINE I and_i(I a, I b) { return a & b; }
  static ZK_SIMD_INLINE I add_i(I a, I b) { return a + b; }
  static ZK_SIMD_INLINE I srl16(I a) { return a >> 16; }
  static ZK_SIMD_INLINE I sll16(I a) { return a << 16; }
  static ZK_SIMD_INLINE I select_nan(F x, I r, I nan) { return std::isnan(x) ? nan : r; }
  static ZK_SIMD_INLINE I widen_u16(H h) { return h; }
  static ZK_SIMD_INLINE H narrow_u16(I r) { return static_cast<H>(r); }
  static ZK_SIMD_INLINE F from_fp16(H h) { return cpu::detail::from_fp16(h); }
  static ZK_SIMD_INLINE H to_fp16(F x) { return cpu::detail::to_fp16(x); }
};

}  // namespace zk::simd
