// The vector tiles of csrc/cpu_optim, written once over the vector traits V of the including
// path (path_avx2.cpp, path_avx512.cpp): the operations of optim::lion_update and
// optim::sgd_update, in their order, on kWidth elements at a time, so every path gives the
// scalar path's bits.
#pragma once

#include "kernel.h"
#include "simd/vec.h"

namespace zk::cpu::optim {

template <class V, DType G, int O>  // O: -1 no copy, else the DType of `out`
ZK_SIMD void lion_tile(const Kernel& k, int64_t begin, int64_t end) {
  using F = typename V::F;
  const Coeffs& c = k.c;
  const F inv_scale = V::set1(c.inv_scale), decay = V::set1(c.decay);
  const F b1 = V::set1(c.beta1), omb1 = V::set1(c.one_minus_beta1);
  const F b2 = V::set1(c.beta2), omb2 = V::set1(c.one_minus_beta2), nlr = V::set1(c.neg_lr);
  const typename V::I nan_hi = simd::bf16_nan_high<V>(0xFFFF);
  simd::for_vectors<V>(begin, end, [&](int64_t i, auto mask) ZK_SIMD_LAMBDA {
    F g = simd::load_as<V, G>(k.grad, i, mask);
    F p = V::load(k.param + i, mask);
    F m = V::load(k.state + i, mask);
    g = V::mul(g, inv_scale);
    p = V::mul(p, decay);
    const F u = V::sign(V::add(V::mul(m, b1), V::mul(g, omb1)));
    p = V::add(p, V::mul(u, nlr));
    m = V::add(V::mul(m, b2), V::mul(g, omb2));
    V::store(k.param + i, p, mask);
    V::store(k.state + i, m, mask);
    if constexpr (O >= 0) simd::store_as<V, static_cast<DType>(O)>(k.out, i, p, mask, nan_hi);
  });
}

// MOM: 0 no momentum, 1 momentum (first step: b = g), 2 momentum (b = momentum*b + (1-d)*g);
// WD, NEST: compile-time, so the vector loop carries no per-vector branch.
template <class V, DType G, int O, int MOM, bool WD, bool NEST>
ZK_SIMD void sgd_tile(const Kernel& k, int64_t begin, int64_t end) {
  using F = typename V::F;
  const Coeffs& c = k.c;
  const F inv_scale = V::set1(c.inv_scale), wd = V::set1(c.wd), mom = V::set1(c.momentum);
  const F omd = V::set1(c.one_minus_dampening), nlr = V::set1(c.neg_lr);
  const typename V::I nan_hi = simd::bf16_nan_high<V>(0xFFFF);
  simd::for_vectors<V>(begin, end, [&](int64_t i, auto mask) ZK_SIMD_LAMBDA {
    F g = simd::load_as<V, G>(k.grad, i, mask);
    F p = V::load(k.param + i, mask);
    g = V::mul(g, inv_scale);
    if constexpr (WD) g = V::add(g, V::mul(p, wd));
    if constexpr (MOM > 0) {
      F b;
      if constexpr (MOM == 1) {
        b = g;
      } else {
        b = V::add(V::mul(V::load(k.state + i, mask), mom), V::mul(g, omd));
      }
      V::store(k.state + i, b, mask);
      if constexpr (NEST) {
        g = V::add(g, V::mul(b, mom));
      } else {
        g = b;
      }
    }
    p = V::add(p, V::mul(g, nlr));
    V::store(k.param + i, p, mask);
    if constexpr (O >= 0) simd::store_as<V, static_cast<DType>(O)>(k.out, i, p, mask, nan_hi);
  });
}

template <class V, DType G, int O, bool WD>
ZK_SIMD void sgd_tile_for_momentum(const Kernel& k, int64_t begin, int64_t end) {
  if (!k.c.has_momentum) return sgd_tile<V, G, O, 0, WD, false>(k, begin, end);
  if (k.c.nesterov) {
    if (k.c.first_step) return sgd_tile<V, G, O, 1, WD, true>(k, begin, end);
    return sgd_tile<V, G, O, 2, WD, true>(k, begin, end);
  }
  if (k.c.first_step) return sgd_tile<V, G, O, 1, WD, false>(k, begin, end);
  return sgd_tile<V, G, O, 2, WD, false>(k, begin, end);
}

template <class V, DType G, int O>
ZK_SIMD void rule_tile(const Kernel& k, int64_t begin, int64_t end) {
  if (k.c.rule == Rule::kLion) return lion_tile<V, G, O>(k, begin, end);
  if (k.c.has_wd) return sgd_tile_for_momentum<V, G, O, true>(k, begin, end);
  return sgd_tile_for_momentum<V, G, O, false>(k, begin, end);
}

template <class V, DType G>
ZK_SIMD void tile_for_out(const Kernel& k, int64_t begin, int64_t end) {
  constexpr int kBf16 = static_cast<int>(DType::kBFloat16);
  constexpr int kFp16 = static_cast<int>(DType::kFloat16);
  constexpr int kFp32 = static_cast<int>(DType::kFloat32);
  if (!k.out) return rule_tile<V, G, -1>(k, begin, end);
  switch (k.out_dtype) {
    case DType::kBFloat16: return rule_tile<V, G, kBf16>(k, begin, end);
    case DType::kFloat16: return rule_tile<V, G, kFp16>(k, begin, end);
    default: return rule_tile<V, G, kFp32>(k, begin, end);
  }
}

// Elements [begin, end) on path V.
template <class V>
ZK_SIMD void optim_range(const Kernel& k, int64_t begin, int64_t end) {
  switch (k.grad_dtype) {
    case DType::kBFloat16: return tile_for_out<V, DType::kBFloat16>(k, begin, end);
    case DType::kFloat16: return tile_for_out<V, DType::kFloat16>(k, begin, end);
    default: return tile_for_out<V, DType::kFloat32>(k, begin, end);
  }
}

}  // namespace zk::cpu::optim
