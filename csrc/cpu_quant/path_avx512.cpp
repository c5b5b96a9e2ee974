// AVX-512 path (F + BW + VL + DQ) of csrc/cpu_quant: 16 elements per step, a masked step for
// a block's ragged end. Same element operations as the scalar path (kernel.h): IEEE division
// and product, round half to even (vcvtps2dq with an explicit RN), so bit-identical results.
#include "kernel.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define ZK_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define ZK_AVX512_INLINE ZK_AVX512 __attribute__((always_inline)) inline

namespace zk::cpu::quant {
namespace {

ZK_AVX512_INLINE __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
}

// fp32 -> bf16 bits, round to nearest even, NaN -> 0xFFFF (torch's vectorized CPU cast).
ZK_AVX512_INLINE __m256i to_bf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                                                 lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0xFFFF));
  return _mm512_cvtepi32_epi16(r);
}

ZK_AVX512_INLINE __m512 load_as_float16(const void* p, DType dt, int64_t i, __mmask16 m) {
  if (dt == DType::kFloat32) return _mm512_maskz_loadu_ps(m, static_cast<const float*>(p) + i);
  const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(p) + i);
  if (dt == DType::kFloat16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

struct Avx512 {
  static ZK_AVX512 uint32_t top(const float* x, int64_t n) {
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
    __m512i m = _mm512_setzero_si512();
    for (int64_t i = 0; i < n; i += 16) {
      const __m512i v = _mm512_maskz_loadu_epi32(tail_mask(n - i), x + i);  // masked: 0
      m = _mm512_max_epu32(m, _mm512_and_si512(v, abs_mask));
    }
    return _mm512_reduce_max_epu32(m);
  }
  static ZK_AVX512 void codes(const float* x, int64_t n, float amax, float qmax,
                                     int8_t* out) {
    const __m512 d = _mm512_set1_ps(amax), q = _mm512_set1_ps(qmax);
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = tail_mask(n - i);
      const __m512 y = _mm512_mul_ps(_mm512_div_ps(_mm512_maskz_loadu_ps(m, x + i), d), q);
      const __m512i c = _mm512_cvt_roundps_epi32(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm512_mask_cvtepi32_storeu_epi8(out + i, m, c);
    }
  }
  static ZK_AVX512 void widen(const void* src, DType dt, int64_t n, float* dst) {
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = tail_mask(n - i);
      _mm512_mask_storeu_ps(dst + i, m, load_as_float16(src, dt, i, m));
    }
  }
  static ZK_AVX512 void dequant(const int8_t* c, int64_t n, float s, float* acc,
                                       bool add) {
    const __m512 sv = _mm512_set1_ps(s);
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = tail_mask(n - i);
      const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, c + i)));
      __m512 p = _mm512_mul_ps(q, sv);
      if (add) p = _mm512_add_ps(_mm512_maskz_loadu_ps(m, acc + i), p);
      _mm512_mask_storeu_ps(acc + i, m, p);
    }
  }
  static ZK_AVX512 void finish(float* acc, int64_t n, bool scaled, float scale,
                                      bool accumulate, void* out, DType dt) {
    const __m512 sv = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = tail_mask(n - i);
      __m512 v = _mm512_maskz_loadu_ps(m, acc + i);
      if (scaled) v = _mm512_mul_ps(v, sv);
      if (accumulate) v = _mm512_add_ps(load_as_float16(out, dt, i, m), v);
      if (dt == DType::kFloat32) {
        _mm512_mask_storeu_ps(static_cast<float*>(out) + i, m, v);
      } else {
        const __m256i h = dt == DType::kFloat16
                              ? _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                              : to_bf16(v);
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + i, m, h);
      }
    }
  }
};

}  // namespace

ZK_AVX512 void quantize_avx512(const QuantizeArgs& a, int64_t b0, int64_t b1) {
  quantize_blocks<Avx512>(a, b0, b1);
}

ZK_AVX512 void dequantize_avx512(const DequantizeArgs& a, int64_t b0, int64_t b1) {
  dequantize_blocks<Avx512>(a, b0, b1);
}

}  // namespace zk::cpu::quant

#else  // not x86-64: isa_supported() never reports this path, so these are never called

namespace zk::cpu::quant {
void quantize_avx512(const QuantizeArgs& a, int64_t b0, int64_t b1) {
  quantize_blocks<Scalar>(a, b0, b1);
}
void dequantize_avx512(const DequantizeArgs& a, int64_t b0, int64_t b1) {
  dequantize_blocks<Scalar>(a, b0, b1);
}
}  // namespace zk::cpu::quant

#endif
