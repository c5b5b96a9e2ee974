// The one tile of csrc/optim, written once over the vector traits V of the including path
// (csrc/simd/path.cpp) and once for every kind: load the grad (fp32/bf16/fp16) and multiply it
// by 1/grad_scale, load the param, run the kind's body (its per-element math, which loads and
// stores its own states through Lanes), store the param and the optional rounded copy.
#pragma once

#include <stdexcept>
#include <string>

#include "optim/kernel.h"
#include "simd/vec.h"

namespace zk::cpu::optim {

// The states of the kWidth elements at i, for a body: load(j) and store(j, x) of state j.
template <class V, class M>
struct Lanes {
  float* const* st;
  int64_t i;
  M m;
  ZK_SIMD_INLINE typename V::F load(int j) const { return V::load(st[j] + i, m); }
  ZK_SIMD_INLINE void store(int j, typename V::F x) const { V::store(st[j] + i, x, m); }
};

// A kind with one body (no compile-time variants): Body<V>(coefficients).
template <template <class> class Body>
struct OneBody {
  template <class V, class Run>
  static ZK_SIMD_INLINE void with_body(const Kernel& k, Run&& run) {
    run(Body<V>(k.c));
  }
};

// What every kind shares by default: all states are read, no coefficient has a range to check.
struct KindDefaults {
  static bool needs_state(int, const double*) { return true; }
  static void check(const double*) {}
};

inline void require(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument(msg);
}

template <class V, DType G, int O, class Body>  // O: -1 no copy, else the DType of `out`
ZK_SIMD_INLINE void step_tile(const Kernel& k, const Body& body, int64_t begin, int64_t end) {
  using F = typename V::F;
  const F inv_scale = V::set1(k.inv_scale);
  const typename V::I nan_hi = simd::bf16_nan_high<V>(0xFFFF);
  simd::for_vectors<V>(begin, end, [&](int64_t i, auto mask) ZK_SIMD_LAMBDA {
    const F g = V::mul(simd::load_as<V, G>(k.grad, i, mask), inv_scale);
    F p = V::load(k.param + i, mask);
    body(g, p, Lanes<V, decltype(mask)>{k.states, i, mask});
    V::store(k.param + i, p, mask);
    if constexpr (O >= 0) simd::store_as<V, static_cast<DType>(O)>(k.out, i, p, mask, nan_hi);
  });
}

template <class V, DType G, class Body>
ZK_SIMD_INLINE void step_for_out(const Kernel& k, const Body& body, int64_t b, int64_t e) {
  if (!k.out) return step_tile<V, G, -1>(k, body, b, e);
  switch (k.out_dtype) {
    case DType::kBFloat16: return step_tile<V, G, static_cast<int>(DType::kBFloat16)>(k, body, b, e);
    case DType::kFloat16: return step_tile<V, G, static_cast<int>(DType::kFloat16)>(k, body, b, e);
    default: return step_tile<V, G, static_cast<int>(DType::kFloat32)>(k, body, b, e);
  }
}

// Elements [begin, end) of kind K on path V: the body chosen, the dtypes made compile-time.
template <class K, class V>
ZK_SIMD void step_range(const Kernel& k, int64_t b, int64_t e) {
  K::template with_body<V>(k, [&](const auto& body) ZK_SIMD_LAMBDA {
    switch (k.grad_dtype) {
      case DType::kBFloat16: return step_for_out<V, DType::kBFloat16>(k, body, b, e);
      case DType::kFloat16: return step_for_out<V, DType::kFloat16>(k, body, b, e);
      default: return step_for_out<V, DType::kFloat32>(k, body, b, e);
    }
  });
}

}  // namespace zk::cpu::optim
