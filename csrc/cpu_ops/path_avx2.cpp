// AVX2 path (+ FMA, F16C) of csrc/cpu_ops: 8 elements per step; the last < 8 elements of a
// range go through the scalar element operations (AVX2 has no cheap masked 16-bit loads).
// Same element operations as the scalar path (kernel.h), so bit-identical results.
#include "kernel.h"

#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>

#define ZK_AVX2 __attribute__((target("avx2,fma,f16c")))
#define ZK_AVX2_INLINE ZK_AVX2 __attribute__((always_inline)) inline

namespace zk::cpu::detail {
namespace {

template <DType S>
ZK_AVX2_INLINE __m256 load8(const void* p, int64_t i) {
  if constexpr (S == DType::kFloat32) {
    return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  } else {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
    if constexpr (S == DType::kFloat16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

template <DType D>
ZK_AVX2_INLINE void store8(void* p, int64_t i, __m256 x, __m256i bf16_nan) {
  if constexpr (D == DType::kFloat32) {
    _mm256_storeu_ps(static_cast<float*>(p) + i, x);
  } else {
    __m128i h;
    if constexpr (D == DType::kFloat16) {
      h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
    } else {
      const __m256i u = _mm256_castps_si256(x);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
      __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
      r = _mm256_srli_epi32(r, 16);
      const __m256 isnan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
      r = _mm256_blendv_epi8(r, bf16_nan, _mm256_castps_si256(isnan));
      // Values are <= 0xFFFF, so the unsigned-saturating pack is exact; it packs per 128-bit
      // lane, and the permute gathers the two lanes' low halves.
      r = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
      h = _mm256_castsi256_si128(r);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p) + i), h);
  }
}

template <DType S, DType D, bool SCALED>
ZK_AVX2 void copy_tile(const CopySpec& s, const void* src, void* dst, int64_t begin,
                       int64_t end) {
  const __m256 scale = _mm256_set1_ps(s.scale);
  const __m256i nan = _mm256_set1_epi32(s.bf16_nan);
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    __m256 a = load8<S>(src, i), b = load8<S>(src, i + 8);
    if constexpr (SCALED) {
      a = _mm256_mul_ps(a, scale);
      b = _mm256_mul_ps(b, scale);
    }
    store8<D>(dst, i, a, nan);
    store8<D>(dst, i + 8, b, nan);
  }
  for (; i + 8 <= end; i += 8) {
    __m256 a = load8<S>(src, i);
    if constexpr (SCALED) a = _mm256_mul_ps(a, scale);
    store8<D>(dst, i, a, nan);
  }
  copy_range_scalar(s, src, dst, i, end);
}

// An unscaled same-dtype copy: plain vector moves, bits untouched.
ZK_AVX2 void move_bytes(const void* src, void* dst, int64_t bytes) {
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  int64_t i = 0;
  for (; i + 64 <= bytes; i += 64) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), a);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
  }
  if (i < bytes) std::memcpy(d + i, s + i, static_cast<size_t>(bytes - i));
}

template <DType S, DType D>
void copy_for_scale(const CopySpec& s, const void* src, void* dst, int64_t b, int64_t e) {
  if (s.scaled) return copy_tile<S, D, true>(s, src, dst, b, e);
  if constexpr (S == D) {
    const int64_t esize = dtype_bytes(S);
    return move_bytes(static_cast<const char*>(src) + b * esize,
                      static_cast<char*>(dst) + b * esize, (e - b) * esize);
  }
  return copy_tile<S, D, false>(s, src, dst, b, e);
}

template <DType S>
void copy_for_dst(const CopySpec& s, const void* src, void* dst, int64_t b, int64_t e) {
  switch (s.dst) {
    case DType::kBFloat16: return copy_for_scale<S, DType::kBFloat16>(s, src, dst, b, e);
    case DType::kFloat16: return copy_for_scale<S, DType::kFloat16>(s, src, dst, b, e);
    default: return copy_for_scale<S, DType::kFloat32>(s, src, dst, b, e);
  }
}

template <DType T>
ZK_AVX2 bool unscale_tile(void* x, int64_t begin, int64_t end, float inv_scale) {
  const __m256 inv = _mm256_set1_ps(inv_scale);
  const __m256i expo = _mm256_set1_epi32(0x7F800000);
  const __m256i nan = _mm256_set1_epi32(0xFFFF);
  __m256i bad = _mm256_setzero_si256();
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 v = load8<T>(x, i);
    const __m256i e = _mm256_and_si256(_mm256_castps_si256(v), expo);
    bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(e, expo));
    store8<T>(x, i, _mm256_mul_ps(v, inv), nan);
  }
  const bool tail_bad = unscale_range_scalar(x, T, i, end, inv_scale);
  return tail_bad || !_mm256_testz_si256(bad, bad);
}

template <DType T>
ZK_AVX2 double sumsq_tile(const void* data, int64_t n) {
  // acc[q] holds lanes 4q .. 4q+3 of [Note: sum_squares order].
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  __m256d acc2 = _mm256_setzero_pd(), acc3 = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 x0 = load8<T>(data, i), x1 = load8<T>(data, i + 8);
    const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(x0));
    const __m256d b = _mm256_cvtps_pd(_mm256_extractf128_ps(x0, 1));
    const __m256d c = _mm256_cvtps_pd(_mm256_castps256_ps128(x1));
    const __m256d d = _mm256_cvtps_pd(_mm256_extractf128_ps(x1, 1));
    acc0 = _mm256_fmadd_pd(a, a, acc0);
    acc1 = _mm256_fmadd_pd(b, b, acc1);
    acc2 = _mm256_fmadd_pd(c, c, acc2);
    acc3 = _mm256_fmadd_pd(d, d, acc3);
  }
  alignas(32) double lane[kSumLanes];
  _mm256_store_pd(lane, acc0);
  _mm256_store_pd(lane + 4, acc1);
  _mm256_store_pd(lane + 8, acc2);
  _mm256_store_pd(lane + 12, acc3);
  for (; i < n; ++i) {  // i is a multiple of 16 here, so element i belongs to lane i % 16
    const double x = load_f(data, T, i);
    lane[i % kSumLanes] += x * x;
  }
  return fold_lanes(lane);
}

}  // namespace

void copy_range_avx2(const CopySpec& s, const void* src, void* dst, int64_t b, int64_t e) {
  switch (s.src) {
    case DType::kBFloat16: return copy_for_dst<DType::kBFloat16>(s, src, dst, b, e);
    case DType::kFloat16: return copy_for_dst<DType::kFloat16>(s, src, dst, b, e);
    default: return copy_for_dst<DType::kFloat32>(s, src, dst, b, e);
  }
}

bool unscale_range_avx2(void* x, DType dt, int64_t b, int64_t e, float inv) {
  switch (dt) {
    case DType::kBFloat16: return unscale_tile<DType::kBFloat16>(x, b, e, inv);
    case DType::kFloat16: return unscale_tile<DType::kFloat16>(x, b, e, inv);
    default: return unscale_tile<DType::kFloat32>(x, b, e, inv);
  }
}

double sumsq_chunk_avx2(const void* data, DType dt, int64_t n) {
  switch (dt) {
    case DType::kBFloat16: return sumsq_tile<DType::kBFloat16>(data, n);
    case DType::kFloat16: return sumsq_tile<DType::kFloat16>(data, n);
    default: return sumsq_tile<DType::kFloat32>(data, n);
  }
}

}  // namespace zk::cpu::detail

#else  // not x86-64: isa_supported() never reports this path, so these are never called

namespace zk::cpu::detail {
void copy_range_avx2(const CopySpec& s, const void* src, void* dst, int64_t b, int64_t e) {
  copy_range_scalar(s, src, dst, b, e);
}
bool unscale_range_avx2(void* x, DType dt, int64_t b, int64_t e, float inv) {
  return unscale_range_scalar(x, dt, b, e, inv);
}
double sumsq_chunk_avx2(const void* data, DType dt, int64_t n) {
  return sumsq_chunk_scalar(data, dt, n);
}
}  // namespace zk::cpu::detail

#endif
