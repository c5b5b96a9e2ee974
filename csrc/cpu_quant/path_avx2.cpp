// AVX2 path (+ F16C) of csrc/cpu_quant: 8 elements per step; the last < 8 elements of a
// block's run go through the scalar element operations (kernel.h). Same arithmetic as the
// scalar path (IEEE division and product, round half to even), so bit-identical results.
#include "kernel.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define ZK_AVX2 __attribute__((target("avx2,fma,f16c")))
#define ZK_AVX2_INLINE ZK_AVX2 __attribute__((always_inline)) inline

namespace zk::cpu::quant {
namespace {

ZK_AVX2_INLINE __m256 load8(const void* p, DType dt, int64_t i) {
  if (dt == DType::kFloat32) return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  const __m128i h =
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
  if (dt == DType::kFloat16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// fp32 -> bf16 bits, round to nearest even, NaN -> 0xFFFF (torch's vectorized CPU cast).
ZK_AVX2_INLINE __m128i to_bf16(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)),
                                                 lsb), 16);
  const __m256 isnan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0xFFFF), _mm256_castps_si256(isnan));
  // Values <= 0xFFFF: the unsigned-saturating pack is exact; the permute joins the lanes.
  r = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  return _mm256_castsi256_si128(r);
}

struct Avx2 {
  static ZK_AVX2 uint32_t top(const float* x, int64_t n) {
    const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
    __m256i m = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
      m = _mm256_max_epu32(m, _mm256_and_si256(v, abs_mask));
    }
    alignas(32) uint32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), m);
    uint32_t t = Scalar::top(x + i, n - i);
    for (uint32_t v : lanes) t = v > t ? v : t;
    return t;
  }
  static ZK_AVX2 void codes(const float* x, int64_t n, float amax, float qmax,
                                   int8_t* out) {
    const __m256 d = _mm256_set1_ps(amax), q = _mm256_set1_ps(qmax);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 y = _mm256_mul_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), d), q);
      const __m256i c = _mm256_cvttps_epi32(
          _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(c),
                                        _mm256_extracti128_si256(c, 1));  // |c| <= 127: exact
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i), _mm_packs_epi16(w, w));
    }
    Scalar::codes(x + i, n - i, amax, qmax, out + i);
  }
  static ZK_AVX2 void widen(const void* src, DType dt, int64_t n, float* dst) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(src, dt, i));
    for (; i < n; ++i) dst[i] = load_as_float(src, dt, i);
  }
  static ZK_AVX2 void dequant(const int8_t* c, int64_t n, float s, float* acc, bool add) {
    const __m256 sv = _mm256_set1_ps(s);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + i));
      __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), sv);
      if (add) p = _mm256_add_ps(_mm256_loadu_ps(acc + i), p);
      _mm256_storeu_ps(acc + i, p);
    }
    Scalar::dequant(c + i, n - i, s, acc + i, add);
  }
  static ZK_AVX2 void finish(float* acc, int64_t n, bool scaled, float scale,
                                    bool accumulate, void* out, DType dt) {
    const __m256 sv = _mm256_set1_ps(scale);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      __m256 v = _mm256_loadu_ps(acc + i);
      if (scaled) v = _mm256_mul_ps(v, sv);
      if (accumulate) v = _mm256_add_ps(load8(out, dt, i), v);
      if (dt == DType::kFloat32) {
        _mm256_storeu_ps(static_cast<float*>(out) + i, v);
      } else {
        const __m128i h = dt == DType::kFloat16
                              ? _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                              : to_bf16(v);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i), h);
      }
    }
    Scalar::finish(acc + i, n - i, scaled, scale, accumulate,
                   static_cast<char*>(out) + i * dtype_bytes(dt), dt);
  }
};

}  // namespace

ZK_AVX2 void quantize_avx2(const QuantizeArgs& a, int64_t b0, int64_t b1) {
  quantize_blocks<Avx2>(a, b0, b1);
}

ZK_AVX2 void dequantize_avx2(const DequantizeArgs& a, int64_t b0, int64_t b1) {
  dequantize_blocks<Avx2>(a, b0, b1);
}

}  // namespace zk::cpu::quant

#else  // not x86-64: isa_supported() never reports this path, so these are never called

namespace zk::cpu::quant {
void quantize_avx2(const QuantizeArgs& a, int64_t b0, int64_t b1) {
  quantize_blocks<Scalar>(a, b0, b1);
}
void dequantize_avx2(const DequantizeArgs& a, int64_t b0, int64_t b1) {
  dequantize_blocks<Scalar>(a, b0, b1);
}
}  // namespace zk::cpu::quant

#endif
