// AVX-512 path (F + BW + VL + DQ) of csrc/cpu_ops: 16 elements per step, a masked step for the
// ragged end. Same element operations as the scalar path (kernel.h), so bit-identical results.
// Per-function target attributes: the library stays baseline x86-64 and this code runs only
// after isa_supported() said so.
#include "kernel.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define ZK_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define ZK_AVX512_INLINE ZK_AVX512 __attribute__((always_inline)) inline

namespace zk::cpu::detail {
namespace {

template <DType S>
ZK_AVX512_INLINE __m512 load16(const void* p, int64_t i, __mmask16 mask) {
  if constexpr (S == DType::kFloat32) {
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(p) + i);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(p) + i);
    if constexpr (S == DType::kFloat16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

template <DType D>
ZK_AVX512_INLINE void store16(void* p, int64_t i, __mmask16 mask, __m512 x, __m512i bf16_nan) {
  if constexpr (D == DType::kFloat32) {
    _mm512_mask_storeu_ps(static_cast<float*>(p) + i, mask, x);
  } else {
    __m256i h;
    if constexpr (D == DType::kFloat16) {
      h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    } else {
      // Integer round to nearest even (vcvtneps2bf16 would flush subnormals).
      const __m512i u = _mm512_castps_si512(x);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
      r = _mm512_srli_epi32(r, 16);
      r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), bf16_nan);
      h = _mm512_cvtepi32_epi16(r);
    }
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p) + i, mask, h);
  }
}

// 32 floats rounded to bf16 and stored as one 64-byte vector: the rounding of store16, but
// the high halves of both vectors are gathered by one vpermt2w (NaN lanes set to
// bf16_nan << 16 first) instead of a shift and a narrowing move per vector.
ZK_AVX512_INLINE __m512i bf16_high(__m512 x, __m512i nan_hi) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), nan_hi);
}

ZK_AVX512_INLINE void store32_bf16(void* p, int64_t i, __m512 a, __m512 b, __m512i nan_hi,
                                   __m512i odd_words) {
  const __m512i h = _mm512_permutex2var_epi16(bf16_high(a, nan_hi), odd_words,
                                              bf16_high(b, nan_hi));
  _mm512_storeu_si512(static_cast<uint16_t*>(p) + i, h);
}

template <DType S>
ZK_AVX512_INLINE __m512 load16_full(const void* p, int64_t i) {
  if constexpr (S == DType::kFloat32) {
    return _mm512_loadu_ps(static_cast<const float*>(p) + i);
  } else {
    const __m256i h =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i));
    if constexpr (S == DType::kFloat16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

template <DType D>
ZK_AVX512_INLINE void store16_full(void* p, int64_t i, __m512 x) {
  if constexpr (D == DType::kFloat32) {
    _mm512_storeu_ps(static_cast<float*>(p) + i, x);
  } else {
    static_assert(D == DType::kFloat16, "bf16 goes through store32_bf16");
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p) + i),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

template <DType S, DType D, bool SCALED>
ZK_AVX512 void copy_tile(const CopySpec& s, const void* src, void* dst, int64_t begin,
                         int64_t end) {
  const __m512 scale = _mm512_set1_ps(s.scale);
  const __m512i nan = _mm512_set1_epi32(s.bf16_nan);
  const __m512i nan_hi = _mm512_set1_epi32(static_cast<int>(uint32_t{s.bf16_nan} << 16));
  const __m512i odd_words = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41,
                                             39, 37, 35, 33, 31, 29, 27, 25, 23, 21, 19, 17,
                                             15, 13, 11, 9, 7, 5, 3, 1);
  const __mmask16 all = 0xFFFF;
  int64_t i = begin;
  for (; i + 32 <= end; i += 32) {
    __m512 a = load16_full<S>(src, i), b = load16_full<S>(src, i + 16);
    if constexpr (SCALED) {
      a = _mm512_mul_ps(a, scale);
      b = _mm512_mul_ps(b, scale);
    }
    if constexpr (D == DType::kBFloat16) {
      store32_bf16(dst, i, a, b, nan_hi, odd_words);
    } else {
      store16_full<D>(dst, i, a);
      store16_full<D>(dst, i + 16, b);
    }
  }
  for (; i < end; i += 16) {
    const int64_t left = end - i;
    const __mmask16 mask = left >= 16 ? all : static_cast<__mmask16>((1u << left) - 1u);
    __m512 a = load16<S>(src, i, mask);
    if constexpr (SCALED) a = _mm512_mul_ps(a, scale);
    store16<D>(dst, i, mask, a, nan);
  }
}

// An unscaled same-dtype copy: plain vector moves (faster here than libc's memcpy on the
// 10 KB - 1 MB pieces of a bucket), bits untouched.
ZK_AVX512 void move_bytes(const void* src, void* dst, int64_t bytes) {
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  int64_t i = 0;
  for (; i + 128 <= bytes; i += 128) {
    const __m512i a = _mm512_loadu_si512(s + i), b = _mm512_loadu_si512(s + i + 64);
    _mm512_storeu_si512(d + i, a);
    _mm512_storeu_si512(d + i + 64, b);
  }
  for (; i < bytes; i += 64) {
    const int64_t left = bytes - i;
    const __mmask64 mask = left >= 64 ? ~__mmask64{0} : (__mmask64{1} << left) - 1;
    _mm512_mask_storeu_epi8(d + i, mask, _mm512_maskz_loadu_epi8(mask, s + i));
  }
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
ZK_AVX512 bool unscale_tile(void* x, int64_t begin, int64_t end, float inv_scale) {
  const __m512 inv = _mm512_set1_ps(inv_scale);
  const __m512i expo = _mm512_set1_epi32(0x7F800000);
  const __m512i nan = _mm512_set1_epi32(0xFFFF);
  __mmask16 bad = 0;
  for (int64_t i = begin; i < end; i += 16) {
    const int64_t left = end - i;
    const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF)
                                      : static_cast<__mmask16>((1u << left) - 1u);
    const __m512 v = load16<T>(x, i, mask);
    const __m512i e = _mm512_and_si512(_mm512_castps_si512(v), expo);
    bad |= _mm512_mask_cmpeq_epi32_mask(mask, e, expo);
    store16<T>(x, i, mask, _mm512_mul_ps(v, inv), nan);
  }
  return bad != 0;
}

template <DType T>
ZK_AVX512 double sumsq_tile(const void* data, int64_t n) {
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();  // lanes 0-7, 8-15
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t left = n - i;
    const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF)
                                      : static_cast<__mmask16>((1u << left) - 1u);
    const __m512 x = load16<T>(data, i, mask);  // masked lanes load +0
    const __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d b = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    lo = _mm512_fmadd_pd(a, a, lo);
    hi = _mm512_fmadd_pd(b, b, hi);
  }
  alignas(64) double lane[kSumLanes];
  _mm512_store_pd(lane, lo);
  _mm512_store_pd(lane + 8, hi);
  return fold_lanes(lane);
}

}  // namespace

void copy_range_avx512(const CopySpec& s, const void* src, void* dst, int64_t b, int64_t e) {
  switch (s.src) {
    case DType::kBFloat16: return copy_for_dst<DType::kBFloat16>(s, src, dst, b, e);
    case DType::kFloat16: return copy_for_dst<DType::kFloat16>(s, src, dst, b, e);
    default: return copy_for_dst<DType::kFloat32>(s, src, dst, b, e);
  }
}

bool unscale_range_avx512(void* x, DType dt, int64_t b, int64_t e, float inv) {
  switch (dt) {
    case DType::kBFloat16: return unscale_tile<DType::kBFloat16>(x, b, e, inv);
    case DType::kFloat16: return unscale_tile<DType::kFloat16>(x, b, e, inv);
    default: return unscale_tile<DType::kFloat32>(x, b, e, inv);
  }
}

double sumsq_chunk_avx512(const void* data, DType dt, int64_t n) {
  switch (dt) {
    case DType::kBFloat16: return sumsq_tile<DType::kBFloat16>(data, n);
    case DType::kFloat16: return sumsq_tile<DType::kFloat16>(data, n);
    default: return sumsq_tile<DType::kFloat32>(data, n);
  }
}

}  // namespace zk::cpu::detail

#else  // not x86-64: isa_supported() never reports this path, so these are never called

namespace zk::cpu::detail {
void copy_range_avx512(const CopySpec& s, const void* src, void* dst, int64_t b, int64_t e) {
  copy_range_scalar(s, src, dst, b, e);
}
bool unscale_range_avx512(void* x, DType dt, int64_t b, int64_t e, float inv) {
  return unscale_range_scalar(x, dt, b, e, inv);
}
double sumsq_chunk_avx512(const void* data, DType dt, int64_t n) {
  return sumsq_chunk_scalar(data, dt, n);
}
}  // namespace zk::cpu::detail

#endif
