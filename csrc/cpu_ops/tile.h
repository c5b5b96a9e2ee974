// The vector tiles of csrc/cpu_ops, written once over the vector traits V of the including
// path (csrc/simd/path.cpp): the element operations of kernel.h's scalar path on
// kWidth elements at a time, so every path gives the scalar path's bits.
#pragma once

#include <algorithm>

#include "kernel.h"
#include "simd/vec.h"

namespace zk::cpu::detail {

template <class V, DType S, DType D, bool SCALED>
ZK_SIMD void copy_tile(const CopySpec& s, const void* src, void* dst, int64_t begin,
                       int64_t end) {
  using F = typename V::F;
  constexpr int W = V::kWidth;
  const F scale = V::set1(s.scale);
  const typename V::I nan_hi = simd::bf16_nan_high<V>(s.bf16_nan);
  const typename V::Full full;
  int64_t i = begin;
  for (; i + 2 * W <= end; i += 2 * W) {  // two vectors a step: a bf16 result is one store
    F a = simd::load_as<V, S>(src, i, full), b = simd::load_as<V, S>(src, i + W, full);
    if constexpr (SCALED) {
      a = V::mul(a, scale);
      b = V::mul(b, scale);
    }
    if constexpr (D == DType::kBFloat16) {
      const typename V::I h = V::pack_high_words(simd::bf16_high<V>(a, nan_hi),
                                                 simd::bf16_high<V>(b, nan_hi));
      V::store_i(static_cast<uint16_t*>(dst) + i, h);
    } else {
      simd::store_as<V, D>(dst, i, a, full, nan_hi);
      simd::store_as<V, D>(dst, i + W, b, full, nan_hi);
    }
  }
  simd::for_vectors<V>(i, end, [&](int64_t j, auto mask) ZK_SIMD_LAMBDA {
    F a = simd::load_as<V, S>(src, j, mask);
    if constexpr (SCALED) a = V::mul(a, scale);
    simd::store_as<V, D>(dst, j, a, mask, nan_hi);
  });
}

// An unscaled same-dtype copy: plain vector moves (faster here than libc's memcpy on the
// 10 KB - 1 MB pieces of a bucket), bits untouched.
template <class V>
ZK_SIMD void move_bytes(const void* src, void* dst, int64_t bytes) {
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  constexpr int64_t kStep = 2 * sizeof(typename V::I);
  int64_t i = 0;
  for (; i + kStep <= bytes; i += kStep) {
    const typename V::I a = V::load_i(s + i), b = V::load_i(s + i + kStep / 2);
    V::store_i(d + i, a);
    V::store_i(d + i + kStep / 2, b);
  }
  V::move_tail(d + i, s + i, bytes - i);
}

template <class V, DType S, DType D>
ZK_SIMD void copy_for_scale(const CopySpec& s, const void* src, void* dst, int64_t b,
                            int64_t e) {
  if (s.scaled) return copy_tile<V, S, D, true>(s, src, dst, b, e);
  if constexpr (S == D) {
    const int64_t esize = dtype_bytes(S);
    return move_bytes<V>(static_cast<const char*>(src) + b * esize,
                         static_cast<char*>(dst) + b * esize, (e - b) * esize);
  }
  return copy_tile<V, S, D, false>(s, src, dst, b, e);
}

template <class V, DType S>
ZK_SIMD void copy_for_dst(const CopySpec& s, const void* src, void* dst, int64_t b, int64_t e) {
  switch (s.dst) {
    case DType::kBFloat16: return copy_for_scale<V, S, DType::kBFloat16>(s, src, dst, b, e);
    case DType::kFloat16: return copy_for_scale<V, S, DType::kFloat16>(s, src, dst, b, e);
    default: return copy_for_scale<V, S, DType::kFloat32>(s, src, dst, b, e);
  }
}

template <class V>
ZK_SIMD void copy_range(const CopySpec& s, const void* src, void* dst, int64_t b, int64_t e) {
  switch (s.src) {
    case DType::kBFloat16: return copy_for_dst<V, DType::kBFloat16>(s, src, dst, b, e);
    case DType::kFloat16: return copy_for_dst<V, DType::kFloat16>(s, src, dst, b, e);
    default: return copy_for_dst<V, DType::kFloat32>(s, src, dst, b, e);
  }
}

template <class V, DType T>
ZK_SIMD bool unscale_tile(void* x, int64_t begin, int64_t end, float inv_scale) {
  const typename V::F inv = V::set1(inv_scale);
  const typename V::I nan_hi = simd::bf16_nan_high<V>(0xFFFF);
  typename V::B bad = V::no_lanes();
  simd::for_vectors<V>(begin, end, [&](int64_t i, auto mask) ZK_SIMD_LAMBDA {
    const typename V::F v = simd::load_as<V, T>(x, i, mask);  // a ragged end's lanes load +0
    bad = V::or_lanes(bad, V::non_finite(v));
    simd::store_as<V, T>(x, i, V::mul(v, inv), mask, nan_hi);
  });
  return V::any(bad);
}

template <class V>
ZK_SIMD bool unscale_range(void* x, DType dt, int64_t b, int64_t e, float inv) {
  switch (dt) {
    case DType::kBFloat16: return unscale_tile<V, DType::kBFloat16>(x, b, e, inv);
    case DType::kFloat16: return unscale_tile<V, DType::kFloat16>(x, b, e, inv);
    default: return unscale_tile<V, DType::kFloat32>(x, b, e, inv);
  }
}

// [Note: sum_squares order] on path V: kSumLanes / kWidth fp32 vectors a step, each widened to
// two fp64 vectors, so acc[q] holds lanes q * kWidth / 2 ... of the 16; the ragged end's
// missing lanes load +0 and add +0, which changes no accumulator.
template <class V, DType T>
ZK_SIMD double sumsq_tile(const void* data, int64_t n) {
  constexpr int W = V::kWidth, kVecs = kSumLanes / W;
  typename V::D acc[2 * kVecs];
  for (auto& a : acc) a = V::zero_d();
  auto add = [&](int64_t at, int j, auto mask) ZK_SIMD_LAMBDA {
    const typename V::F x = simd::load_as<V, T>(data, at, mask);
    const typename V::D lo = V::low_d(x), hi = V::high_d(x);
    acc[2 * j] = V::fmadd_d(lo, lo, acc[2 * j]);
    acc[2 * j + 1] = V::fmadd_d(hi, hi, acc[2 * j + 1]);
  };
  int64_t i = 0;
  for (; i + kSumLanes <= n; i += kSumLanes) {
    for (int j = 0; j < kVecs; ++j) add(i + j * W, j, typename V::Full{});
  }
  for (int j = 0; j < kVecs && i + j * W < n; ++j) {
    add(i + j * W, j, V::part(std::min<int64_t>(W, n - i - j * W)));
  }
  double lane[kSumLanes];
  for (int q = 0; q < 2 * kVecs; ++q) V::store_d(lane + q * W / 2, acc[q]);
  return fold_lanes(lane);
}

template <class V>
ZK_SIMD double sumsq_chunk(const void* data, DType dt, int64_t n) {
  switch (dt) {
    case DType::kBFloat16: return sumsq_tile<V, DType::kBFloat16>(data, n);
    case DType::kFloat16: return sumsq_tile<V, DType::kFloat16>(data, n);
    default: return sumsq_tile<V, DType::kFloat32>(data, n);
  }
}

}  // namespace zk::cpu::detail
