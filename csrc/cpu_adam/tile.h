// The vector tile of csrc/cpu_adam, written once over the vector traits V of the including
// path (csrc/simd/path.cpp): the operations of detail::update, in its order, on
// kWidth elements at a time, so every path gives the scalar path's bits.
#pragma once

#include "kernel.h"
#include "simd/vec.h"

namespace zk::cpu::detail {

template <class V, DType G, int O>  // O: -1 no copy, else the DType of `out`
ZK_SIMD void adam_tile(const Kernel& k, int64_t begin, int64_t end) {
  using F = typename V::F;
  const Coeffs& c = k.c;
  const F inv_scale = V::set1(c.inv_scale), decay = V::set1(c.decay), wd = V::set1(c.wd);
  const F lw = V::set1(c.lerp_weight), l1m = V::set1(c.lerp_one_minus), b2 = V::set1(c.beta2);
  const F omb2 = V::set1(c.one_minus_beta2), ibc2 = V::set1(c.inv_sqrt_bc2);
  const F eps = V::set1(c.eps), nss = V::set1(c.neg_step_size);
  const typename V::I nan_hi = simd::bf16_nan_high<V>(0xFFFF);
  simd::for_vectors<V>(begin, end, [&](int64_t i, auto mask) ZK_SIMD_LAMBDA {
    F g = simd::load_as<V, G>(k.grad, i, mask);
    F p = V::load(k.param + i, mask);
    F m = V::load(k.exp_avg + i, mask);
    F v = V::load(k.exp_avg_sq + i, mask);
    g = V::mul(g, inv_scale);
    if (c.l2) g = V::add(g, V::mul(wd, p));
    p = V::mul(p, decay);
    const F diff = V::sub(g, m);
    m = c.lerp_small ? V::add(m, V::mul(lw, diff)) : V::sub(g, V::mul(diff, l1m));
    v = V::add(V::mul(v, b2), V::mul(V::mul(omb2, g), g));
    const F denom = V::add(V::mul(V::sqrt(v), ibc2), eps);
    p = V::add(p, V::mul(nss, V::div(m, denom)));
    V::store(k.param + i, p, mask);
    V::store(k.exp_avg + i, m, mask);
    V::store(k.exp_avg_sq + i, v, mask);
    if constexpr (O >= 0) simd::store_as<V, static_cast<DType>(O)>(k.out, i, p, mask, nan_hi);
  });
}

template <class V, DType G>
ZK_SIMD void adam_tile_for_out(const Kernel& k, int64_t begin, int64_t end) {
  constexpr int kBf16 = static_cast<int>(DType::kBFloat16);
  constexpr int kFp16 = static_cast<int>(DType::kFloat16);
  constexpr int kFp32 = static_cast<int>(DType::kFloat32);
  if (!k.out) return adam_tile<V, G, -1>(k, begin, end);
  switch (k.out_dtype) {
    case DType::kBFloat16: return adam_tile<V, G, kBf16>(k, begin, end);
    case DType::kFloat16: return adam_tile<V, G, kFp16>(k, begin, end);
    default: return adam_tile<V, G, kFp32>(k, begin, end);
  }
}

// Elements [begin, end) on path V.
template <class V>
ZK_SIMD void adam_range(const Kernel& k, int64_t begin, int64_t end) {
  switch (k.grad_dtype) {
    case DType::kBFloat16: return adam_tile_for_out<V, DType::kBFloat16>(k, begin, end);
    case DType::kFloat16: return adam_tile_for_out<V, DType::kFloat16>(k, begin, end);
    default: return adam_tile_for_out<V, DType::kFloat32>(k, begin, end);
  }
}

}  // namespace zk::cpu::detail
