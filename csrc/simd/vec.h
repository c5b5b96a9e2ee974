// What every tile body builds on, written once over a vector-traits struct V (avx2.h,
// avx512.h; include one of them first): dtype loads and stores through fp32 lanes, the
// fp32 -> bf16 round to nearest even, and the loop over full vectors plus one ragged end.
// Everything here is a template over V: each ISA's translation unit gets its own copies,
// compiled for its own target.
#pragma once

#if !defined(ZK_SIMD)
#error "include simd/avx2.h or simd/avx512.h first"
#endif

#include <cstdint>

#include "dtype.h"

// A tile body's per-vector lambda: `[&](int64_t i, auto m) ZK_SIMD_LAMBDA { ... }`.
#define ZK_SIMD_LAMBDA ZK_SIMD __attribute__((always_inline))

namespace zk::simd {

// fp32 -> bf16 bits in the high half of each lane, round to nearest even, subnormals kept
// (as torch's CPU cast; vcvtneps2bf16 would flush them), NaN lanes -> `nan_hi` (the NaN
// pattern << 16). The scalar twin is zk::cpu::detail::to_bf16 (cpu_convert.h).
template <class V>
ZK_SIMD_INLINE typename V::I bf16_high(typename V::F x, typename V::I nan_hi) {
  const typename V::I u = V::bits(x);
  const typename V::I lsb = V::and_i(V::srl16(u), V::set1i(1));
  return V::select_nan(x, V::add_i(V::add_i(u, V::set1i(0x7FFF)), lsb), nan_hi);
}

template <class V>
ZK_SIMD_INLINE typename V::I bf16_nan_high(uint16_t nan) {
  return V::set1i(static_cast<uint32_t>(nan) << 16);
}

// Lanes [i, i + kWidth) of `p` (dtype S) as fp32; M is V::Full or V::Part.
template <class V, DType S, class M>
ZK_SIMD_INLINE typename V::F load_as(const void* p, int64_t i, M m) {
  if constexpr (S == DType::kFloat32) {
    return V::load(static_cast<const float*>(p) + i, m);
  } else {
    const typename V::H h = V::load_u16(static_cast<const uint16_t*>(p) + i, m);
    if constexpr (S == DType::kFloat16) return V::from_fp16(h);
    return V::from_bits(V::sll16(V::widen_u16(h)));
  }
}

// x rounded to dtype D (bf16 NaN lanes -> nan_hi >> 16) into lanes [i, i + kWidth) of `p`.
template <class V, DType D, class M>
ZK_SIMD_INLINE void store_as(void* p, int64_t i, typename V::F x, M m, typename V::I nan_hi) {
  if constexpr (D == DType::kFloat32) {
    V::store(static_cast<float*>(p) + i, x, m);
  } else if constexpr (D == DType::kFloat16) {
    V::store_u16(static_cast<uint16_t*>(p) + i, V::to_fp16(x), m);
  } else {
    V::store_u16(static_cast<uint16_t*>(p) + i, V::narrow_u16(V::srl16(bf16_high<V>(x, nan_hi))),
                 m);
  }
}

// Run-time dtype versions, for bodies that stage per block rather than per element.
template <class V, class M>
ZK_SIMD_INLINE typename V::F load_as(const void* p, DType dt, int64_t i, M m) {
  switch (dt) {
    case DType::kBFloat16: return load_as<V, DType::kBFloat16>(p, i, m);
    case DType::kFloat16: return load_as<V, DType::kFloat16>(p, i, m);
    default: return load_as<V, DType::kFloat32>(p, i, m);
  }
}

template <class V, class M>
ZK_SIMD_INLINE void store_as(void* p, DType dt, int64_t i, typename V::F x, M m,
                             typename V::I nan_hi) {
  switch (dt) {
    case DType::kBFloat16: return store_as<V, DType::kBFloat16>(p, i, x, m, nan_hi);
    case DType::kFloat16: return store_as<V, DType::kFloat16>(p, i, x, m, nan_hi);
    default: return store_as<V, DType::kFloat32>(p, i, x, m, nan_hi);
  }
}

// body(i, V::Full{}) for each full vector of [begin, end), then body(i, V::part(n)) for the
// ragged end, if any.
template <class V, class Body>
ZK_SIMD_INLINE void for_vectors(int64_t begin, int64_t end, Body&& body) {
  int64_t i = begin;
  for (; i + V::kWidth <= end; i += V::kWidth) body(i, typename V::Full{});
  if (i < end) body(i, V::part(end - i));
}

}  // namespace zk::simd
