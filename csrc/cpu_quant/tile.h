// The vector element operations of csrc/cpu_quant (the `P` of kernel.h's block skeletons),
// written once over the vector traits V of the including path (csrc/simd/path.cpp): the scalar operations of quant::Scalar on kWidth elements at a time (IEEE
// division and product, round half to even), so every path gives the scalar path's bits. A
// block's ragged end loads +0 in its missing lanes, which changes no max and no stored lane.
#pragma once

#include "kernel.h"
#include "simd/vec.h"

namespace zk::cpu::quant {

template <class V>
struct Vec {
  using F = typename V::F;
  static ZK_SIMD uint32_t top(const float* x, int64_t n) {
    const typename V::I abs_mask = V::set1i(0x7FFFFFFFu);
    typename V::I m = V::set1i(0);
    simd::for_vectors<V>(0, n, [&](int64_t i, auto mask) ZK_SIMD_LAMBDA {
      m = V::max_u32(m, V::and_i(V::bits(V::load(x + i, mask)), abs_mask));
    });
    return V::reduce_max_u32(m);
  }
  static ZK_SIMD void codes(const float* x, int64_t n, float amax, float qmax, int8_t* out) {
    const F d = V::set1(amax), q = V::set1(qmax);
    simd::for_vectors<V>(0, n, [&](int64_t i, auto mask) ZK_SIMD_LAMBDA {
      V::store_i8(out + i, V::rint_i32(V::mul(V::div(V::load(x + i, mask), d), q)), mask);
    });
  }
  static ZK_SIMD void widen(const void* src, DType dt, int64_t n, float* dst) {
    simd::for_vectors<V>(0, n, [&](int64_t i, auto mask) ZK_SIMD_LAMBDA {
      V::store(dst + i, simd::load_as<V>(src, dt, i, mask), mask);
    });
  }
  static ZK_SIMD void dequant(const int8_t* c, int64_t n, float s, float* acc, bool add) {
    const F sv = V::set1(s);
    simd::for_vectors<V>(0, n, [&](int64_t i, auto mask) ZK_SIMD_LAMBDA {
      F p = V::mul(V::to_f32(V::load_i8(c + i, mask)), sv);
      if (add) p = V::add(V::load(acc + i, mask), p);
      V::store(acc + i, p, mask);
    });
  }
  // acc[i] (times scale when `scaled`, plus out[i] when `accumulate`) rounded into out[i].
  static ZK_SIMD void finish(float* acc, int64_t n, bool scaled, float scale, bool accumulate,
                             void* out, DType dt) {
    const F sv = V::set1(scale);
    const typename V::I nan_hi = simd::bf16_nan_high<V>(0xFFFF);
    simd::for_vectors<V>(0, n, [&](int64_t i, auto mask) ZK_SIMD_LAMBDA {
      F v = V::load(acc + i, mask);
      if (scaled) v = V::mul(v, sv);
      if (accumulate) v = V::add(simd::load_as<V>(out, dt, i, mask), v);
      simd::store_as<V>(out, dt, i, v, mask, nan_hi);
    });
  }
};

}  // namespace zk::cpu::quant
