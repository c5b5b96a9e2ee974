// The vector tiles of csrc/cpu_adam_lowbit, written once over the vector traits V of the
// including path (path_avx2.cpp, path_avx512.cpp): the operations of lowbit::update and of
// the block requantization in kernel.h, in their order, on kWidth elements at a time, so every
// path gives the scalar path's bits. A block's ragged end loads code 0 (and grad, param 0)
// in its missing lanes: their m and sqrt(v) are 0 (NaN only where the block's scale is
// non-finite, which makes every element of the block NaN anyway), so they change no block
// max, and they are never stored.
#pragma once

#include "kernel.h"
#include "simd/vec.h"

namespace zk::cpu::lowbit {

template <class V>
struct Update {
  using F = typename V::F;
  Coeffs c;
  F grad_scale, decay, wd, w, w_minus_one, beta2, omb2, sqrt_bc2, eps, nss;

  ZK_SIMD_INLINE explicit Update(const Coeffs& co)
      : c(co), grad_scale(V::set1(co.grad_scale)), decay(V::set1(co.decay)),
        wd(V::set1(co.wd)), w(V::set1(co.w)), w_minus_one(V::set1(co.w_minus_one)),
        beta2(V::set1(co.beta2)), omb2(V::set1(co.one_minus_beta2)),
        sqrt_bc2(V::set1(co.sqrt_bc2)), eps(V::set1(co.eps)), nss(V::set1(co.neg_step_size)) {}

  // lowbit::update on kWidth lanes; returns sqrt(v).
  ZK_SIMD_INLINE F operator()(F g, F& p, F& m, F& v) const {
    if (c.unscale) g = V::div(g, grad_scale);
    if (c.decoupled) {
      p = V::mul(p, decay);
    } else if (c.l2) {
      g = V::fmadd(wd, p, g);
    }
    const F diff = V::sub(g, m);
    m = c.w_small ? V::fmadd(w, diff, m) : V::fmadd(w_minus_one, diff, g);
    v = V::fmadd(V::mul(omb2, g), g, V::mul(v, beta2));
    const F r = V::sqrt(v);
    const F denom = V::add(V::div(r, sqrt_bc2), eps);
    p = V::add(p, V::div(V::mul(nss, m), denom));
    return r;
  }
};

// encode<M> / decode<M> of kernel.h on kWidth lanes (the same integer and IEEE operations).
template <class V, int M>
ZK_SIMD_INLINE typename V::I encode_v(typename V::F y) {
  using I = typename V::I;
  constexpr int S = 23 - M;
  const I d = V::sub_i(V::bits(y), V::set1i(static_cast<uint32_t>(kCodeBase)));
  const I odd = V::and_i(V::template srai<S>(d), V::set1i(1));
  const I normal = V::add_i(
      V::template srai<S>(V::add_i(V::add_i(d, V::set1i((1u << (S - 1)) - 1u)), odd)),
      V::set1i(1u << M));
  const I sub = V::rint_i32(V::mul(y, V::set1(pow2(M - kEmin))));
  return V::select_neg_i(d, sub, normal);
}

template <class V, int M>
ZK_SIMD_INLINE typename V::F decode_v(typename V::I c) {
  using I = typename V::I;
  constexpr int S = 23 - M;
  const I d = V::sub_i(c, V::set1i(1u << M));
  const typename V::F normal =
      V::from_bits(V::add_i(V::template slli<S>(d), V::set1i(static_cast<uint32_t>(kCodeBase))));
  const typename V::F sub = V::mul(V::to_f32(c), V::set1(pow2(kEmin - M)));
  return V::select_neg_f(d, sub, normal);
}

// The grad as fp32 lanes (its dtype a run-time switch: a loop-invariant, predicted branch).
template <class V, class M>
ZK_SIMD_INLINE typename V::F load_grad(const Kernel& k, int64_t i, M mask) {
  return simd::load_as<V>(k.grad, k.grad_dtype, i, mask);
}

template <class V, DType P, int O>  // P: the param's dtype; O: -1 no copy, else out's DType
ZK_SIMD void bf16_tile(const Kernel& k, int64_t begin, int64_t end) {
  using F = typename V::F;
  const Update<V> up(k.c);
  const typename V::I nan_hi = simd::bf16_nan_high<V>(0xFFFF);
  simd::for_vectors<V>(begin, end, [&](int64_t i, auto mask) ZK_SIMD_LAMBDA {
    F g = load_grad<V>(k, i, mask);
    F p = simd::load_as<V, P>(k.param, i, mask);
    F m = simd::load_as<V, DType::kBFloat16>(k.exp_avg, i, mask);
    F v = simd::load_as<V, DType::kBFloat16>(k.exp_avg_sq, i, mask);
    up(g, p, m, v);
    simd::store_as<V, P>(k.param, i, p, mask, nan_hi);
    simd::store_as<V, DType::kBFloat16>(k.exp_avg, i, m, mask, nan_hi);
    simd::store_as<V, DType::kBFloat16>(k.exp_avg_sq, i, v, mask, nan_hi);
    if constexpr (O >= 0) simd::store_as<V, static_cast<DType>(O)>(k.out, i, p, mask, nan_hi);
  });
}

template <class V, DType P, int O>
ZK_SIMD void int8_tile(const Kernel& k, int64_t begin, int64_t end) {
  using F = typename V::F;
  using I = typename V::I;
  alignas(64) float ms[kMaxBlock], rs[kMaxBlock];
  const Update<V> up(k.c);
  const I nan_hi = simd::bf16_nan_high<V>(0xFFFF), abs_mask = V::set1i(0x7FFFFFFFu);
  const I sign_bit = V::set1i(0x80000000u), zero_i = V::set1i(0);
  int8_t* qm = static_cast<int8_t*>(k.exp_avg);
  uint8_t* qv = static_cast<uint8_t*>(k.exp_avg_sq);
  const int64_t b1 = (end + k.block - 1) / k.block;
  for (int64_t b = begin / k.block; b < b1; ++b) {
    const int64_t base = b * k.block;
    const int64_t n = k.numel - base < k.block ? k.numel - base : k.block;
    const F sm = V::set1(k.m_scales[b]), sv = V::set1(k.v_scales[b]);
    I tm = V::set1i(0), tr = V::set1i(0);
    simd::for_vectors<V>(0, n, [&](int64_t i, auto mask) ZK_SIMD_LAMBDA {
      const int64_t j = base + i;
      F g = load_grad<V>(k, j, mask);
      F p = simd::load_as<V, P>(k.param, j, mask);
      const I cm = V::load_i8(qm + j, mask);
      const F m_abs = V::mul(decode_v<V, kMantM>(V::abs_i(cm)), sm);
      F m = V::from_bits(V::xor_i(V::bits(m_abs), V::and_i(cm, sign_bit)));
      const F r0 = V::mul(decode_v<V, kMantR>(V::load_u8(qv + j, mask)), sv);
      F v = V::mul(r0, r0);
      const F r = up(g, p, m, v);
      simd::store_as<V, P>(k.param, j, p, mask, nan_hi);
      if constexpr (O >= 0) simd::store_as<V, static_cast<DType>(O)>(k.out, j, p, mask, nan_hi);
      V::store(ms + i, m, mask);
      V::store(rs + i, r, mask);
      tm = V::max_u32(tm, V::and_i(V::bits(m), abs_mask));
      tr = V::max_u32(tr, V::and_i(V::bits(r), abs_mask));
    });
    const quant::BlockScale s_m = quant::block_scale(V::reduce_max_u32(tm), 1.0f);
    const quant::BlockScale s_r = quant::block_scale(V::reduce_max_u32(tr), 1.0f);
    k.m_scales[b] = s_m.scale;
    k.v_scales[b] = s_r.scale;
    const F amax_m = V::set1(s_m.amax), amax_r = V::set1(s_r.amax);
    if (s_m.ok) {
      simd::for_vectors<V>(0, n, [&](int64_t i, auto mask) ZK_SIMD_LAMBDA {
        const I mb = V::bits(V::load(ms + i, mask));
        const I mag = encode_v<V, kMantM>(V::div(V::from_bits(V::and_i(mb, abs_mask)), amax_m));
        V::store_i8(qm + base + i, V::select_neg_i(mb, V::sub_i(zero_i, mag), mag), mask);
      });
    } else {
      std::memset(qm + base, 0, static_cast<size_t>(n));
    }
    if (s_r.ok) {
      simd::for_vectors<V>(0, n, [&](int64_t i, auto mask) ZK_SIMD_LAMBDA {
        V::store_u8(qv + base + i, encode_v<V, kMantR>(V::div(V::load(rs + i, mask), amax_r)),
                    mask);
      });
    } else {
      std::memset(qv + base, 0, static_cast<size_t>(n));
    }
  }
}

template <class V, DType P, int O>
ZK_SIMD void format_tile(const Kernel& k, int64_t begin, int64_t end) {
  if (k.format == MomentFormat::kBf16) return bf16_tile<V, P, O>(k, begin, end);
  return int8_tile<V, P, O>(k, begin, end);
}

template <class V, DType P>
ZK_SIMD void tile_for_out(const Kernel& k, int64_t begin, int64_t end) {
  constexpr int kBf16 = static_cast<int>(DType::kBFloat16);
  constexpr int kFp16 = static_cast<int>(DType::kFloat16);
  constexpr int kFp32 = static_cast<int>(DType::kFloat32);
  if (!k.out) return format_tile<V, P, -1>(k, begin, end);
  switch (k.out_dtype) {
    case DType::kBFloat16: return format_tile<V, P, kBf16>(k, begin, end);
    case DType::kFloat16: return format_tile<V, P, kFp16>(k, begin, end);
    default: return format_tile<V, P, kFp32>(k, begin, end);
  }
}

// Elements [begin, end) on path V.
template <class V>
ZK_SIMD void lowbit_range(const Kernel& k, int64_t begin, int64_t end) {
  if (k.param_dtype == DType::kBFloat16) {
    return tile_for_out<V, DType::kBFloat16>(k, begin, end);
  }
  return tile_for_out<V, DType::kFloat32>(k, begin, end);
}

}  // namespace zk::cpu::lowbit
