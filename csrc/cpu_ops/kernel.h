// Internal to csrc/cpu_ops: the scalar element operations every path reproduces and the
// per-path range functions.
#pragma once

#include <cstdint>

#include "cpu_convert.h"
#include "cpu_ops.h"

namespace zk::cpu::detail {

// [Note: sum_squares order]
// The sum is defined by its order, the same on every path and thread count: each tensor is
// cut into chunks of kSumChunk elements; within a chunk, element k is added (as an exact fp64
// square) to lane k % 16 of 16 fp64 accumulators that start at +0, in increasing k; the lanes
// are then folded as lane[j] += lane[j + s] for s = 8, 4, 2, 1 and lane 0 is the chunk's
// partial; the partials are added in (tensor, chunk) order starting from +0. An AVX-512 path
// holds lanes 0-7 and 8-15 in two registers, AVX2 in four; a masked (zero) lane adds +0, which
// changes no accumulator (they are never -0). fp64 FMA equals mul-then-add here because the
// square of an fp32 value is exact in fp64.
constexpr int64_t kSumChunk = 16384;
constexpr int kSumLanes = 16;

inline float load_f(const void* p, DType dt, int64_t i) {
  switch (dt) {
    case DType::kBFloat16: return from_bf16(static_cast<const uint16_t*>(p)[i]);
    case DType::kFloat16: return from_fp16(static_cast<const uint16_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

inline void store_f(void* p, DType dt, int64_t i, float x, uint16_t bf16_nan) {
  switch (dt) {
    case DType::kBFloat16: static_cast<uint16_t*>(p)[i] = to_bf16(x, bf16_nan); break;
    case DType::kFloat16: static_cast<uint16_t*>(p)[i] = to_fp16(x); break;
    default: static_cast<float*>(p)[i] = x; break;
  }
}

inline bool non_finite(float x) { return (bits_of(x) & 0x7F800000u) == 0x7F800000u; }

// Elements [begin, end) of one segment, converted (never called for an unscaled same-dtype
// copy: that is a memcpy). Templated so that the dtype switches fold away and the compiler
// can vectorize the loop on any architecture.
template <DType S, DType D, bool SCALED>
inline void copy_loop(const CopySpec& s, const void* src, void* dst, int64_t begin,
                      int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    float x = load_f(src, S, i);
    if (SCALED) x = x * s.scale;
    store_f(dst, D, i, x, s.bf16_nan);
  }
}

template <DType S, DType D>
inline void copy_loop_scaled(const CopySpec& s, const void* src, void* dst, int64_t b,
                             int64_t e) {
  if (s.scaled) return copy_loop<S, D, true>(s, src, dst, b, e);
  return copy_loop<S, D, false>(s, src, dst, b, e);
}

template <DType S>
inline void copy_loop_dst(const CopySpec& s, const void* src, void* dst, int64_t b, int64_t e) {
  switch (s.dst) {
    case DType::kBFloat16: return copy_loop_scaled<S, DType::kBFloat16>(s, src, dst, b, e);
    case DType::kFloat16: return copy_loop_scaled<S, DType::kFloat16>(s, src, dst, b, e);
    default: return copy_loop_scaled<S, DType::kFloat32>(s, src, dst, b, e);
  }
}

inline void copy_range_scalar(const CopySpec& s, const void* src, void* dst, int64_t begin,
                              int64_t end) {
  switch (s.src) {
    case DType::kBFloat16: return copy_loop_dst<DType::kBFloat16>(s, src, dst, begin, end);
    case DType::kFloat16: return copy_loop_dst<DType::kFloat16>(s, src, dst, begin, end);
    default: return copy_loop_dst<DType::kFloat32>(s, src, dst, begin, end);
  }
}

template <DType T>
inline bool unscale_loop(void* x, int64_t begin, int64_t end, float inv) {
  bool bad = false;
  for (int64_t i = begin; i < end; ++i) {
    const float v = load_f(x, T, i);
    bad |= non_finite(v);
    store_f(x, T, i, v * inv, 0xFFFF);
  }
  return bad;
}

inline bool unscale_range_scalar(void* x, DType dt, int64_t begin, int64_t end, float inv) {
  switch (dt) {
    case DType::kBFloat16: return unscale_loop<DType::kBFloat16>(x, begin, end, inv);
    case DType::kFloat16: return unscale_loop<DType::kFloat16>(x, begin, end, inv);
    default: return unscale_loop<DType::kFloat32>(x, begin, end, inv);
  }
}

// The chunk partial of [Note: sum_squares order] for elements [0, n) of `data`, n <= kSumChunk.
inline double fold_lanes(double* lane) {
  for (int s = kSumLanes / 2; s >= 1; s /= 2) {
    for (int j = 0; j < s; ++j) lane[j] += lane[j + s];
  }
  return lane[0];
}

template <DType T>
inline double sumsq_loop(const void* data, int64_t n) {
  double lane[kSumLanes] = {};
  int64_t i = 0;
  for (; i + kSumLanes <= n; i += kSumLanes) {
    for (int j = 0; j < kSumLanes; ++j) {
      const double x = load_f(data, T, i + j);
      lane[j] += x * x;
    }
  }
  for (; i < n; ++i) {
    const double x = load_f(data, T, i);
    lane[i % kSumLanes] += x * x;
  }
  return fold_lanes(lane);
}

inline double sumsq_chunk_scalar(const void* data, DType dt, int64_t n) {
  switch (dt) {
    case DType::kBFloat16: return sumsq_loop<DType::kBFloat16>(data, n);
    case DType::kFloat16: return sumsq_loop<DType::kFloat16>(data, n);
    default: return sumsq_loop<DType::kFloat32>(data, n);
  }
}

// One path's range functions (a member of each csrc/simd/paths.h table).
struct Path {
  void (*copy)(const CopySpec& s, const void* src, void* dst, int64_t begin, int64_t end);
  bool (*unscale)(void* x, DType dt, int64_t begin, int64_t end, float inv);
  double (*sumsq)(const void* data, DType dt, int64_t n);
};
inline constexpr Path kScalarPath = {copy_range_scalar, unscale_range_scalar, sumsq_chunk_scalar};

}  // namespace zk::cpu::detail
