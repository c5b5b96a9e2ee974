// Vector traits of the AVX-512 path (F + BW + VL + DQ): 16 fp32 lanes, masked loads and stores
// for a ragged end. Include it (or avx2.h) in exactly one translation unit per library, before
// the tile bodies: ZK_SIMD is the target attribute every body function then carries, so the
// library stays baseline x86-64 and this code runs only after isa_supported() said so.
#pragma once

#if defined(ZK_SIMD)
#error "one ISA's vector traits per translation unit"
#endif

#include <immintrin.h>

#include <cstdint>

#define ZK_SIMD __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define ZK_SIMD_INLINE ZK_SIMD __attribute__((always_inline)) inline

namespace zk::simd {

struct Avx512 {
  static constexpr int kWidth = 16;
  // Quotients by a constant through products and FMAs rather than the divider (see
  // [Note: dividing by a constant without the divider] in csrc/cpu_adam_lowbit/tile.h).
  static constexpr bool kFmaQuotient = true;
  using F = __m512;   // kWidth fp32
  using I = __m512i;  // kWidth int32 (or 2 kWidth 16-bit words)
  using H = __m256i;  // kWidth 16-bit words
  using D = __m512d;  // kWidth / 2 fp64
  using B = __mmask16;
  struct Full {};
  struct Part {  // the first n < kWidth lanes; the others load 0 and are not stored
    __mmask16 k;
  };
  static ZK_SIMD_INLINE Part part(int64_t n) { return {static_cast<__mmask16>((1u << n) - 1u)}; }

  static ZK_SIMD_INLINE F load(const float* p, Full) { return _mm512_loadu_ps(p); }
  static ZK_SIMD_INLINE F load(const float* p, Part m) { return _mm512_maskz_loadu_ps(m.k, p); }
  static ZK_SIMD_INLINE void store(float* p, F x, Full) { _mm512_storeu_ps(p, x); }
  static ZK_SIMD_INLINE void store(float* p, F x, Part m) { _mm512_mask_storeu_ps(p, m.k, x); }
  static ZK_SIMD_INLINE H load_u16(const uint16_t* p, Full) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static ZK_SIMD_INLINE H load_u16(const uint16_t* p, Part m) {
    return _mm256_maskz_loadu_epi16(m.k, p);
  }
  static ZK_SIMD_INLINE void store_u16(uint16_t* p, H h, Full) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  }
  static ZK_SIMD_INLINE void store_u16(uint16_t* p, H h, Part m) {
    _mm256_mask_storeu_epi16(p, m.k, h);
  }
  // int8 <-> int32 lanes (stores narrow values in [-128, 127] exactly)
  static ZK_SIMD_INLINE I load_i8(const int8_t* p, Full) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static ZK_SIMD_INLINE I load_i8(const int8_t* p, Part m) {
    return _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m.k, p));
  }
  static ZK_SIMD_INLINE void store_i8(int8_t* p, I c, Full) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(c));
  }
  static ZK_SIMD_INLINE void store_i8(int8_t* p, I c, Part m) {
    _mm512_mask_cvtepi32_storeu_epi8(p, m.k, c);
  }
  // uint8 <-> int32 lanes (stores values in [0, 255] exactly)
  static ZK_SIMD_INLINE I load_u8(const uint8_t* p, Full) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static ZK_SIMD_INLINE I load_u8(const uint8_t* p, Part m) {
    return _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m.k, p));
  }
  static ZK_SIMD_INLINE void store_u8(uint8_t* p, I c, Full) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(c));
  }
  static ZK_SIMD_INLINE void store_u8(uint8_t* p, I c, Part m) {
    _mm512_mask_cvtepi32_storeu_epi8(p, m.k, c);
  }
  static ZK_SIMD_INLINE I load_i(const void* p) { return _mm512_loadu_si512(p); }
  static ZK_SIMD_INLINE void store_i(void* p, I x) { _mm512_storeu_si512(p, x); }
  // The last bytes < 2 * sizeof(I) of a byte copy.
  static ZK_SIMD_INLINE void move_tail(char* d, const char* s, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) {
      const int64_t left = bytes - i;
      const __mmask64 k = left >= 64 ? ~__mmask64{0} : (__mmask64{1} << left) - 1;
      _mm512_mask_storeu_epi8(d + i, k, _mm512_maskz_loadu_epi8(k, s + i));
    }
  }

  static ZK_SIMD_INLINE F set1(float x) { return _mm512_set1_ps(x); }
  static ZK_SIMD_INLINE F add(F a, F b) { return _mm512_add_ps(a, b); }
  static ZK_SIMD_INLINE F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static ZK_SIMD_INLINE F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static ZK_SIMD_INLINE F div(F a, F b) { return _mm512_div_ps(a, b); }
  static ZK_SIMD_INLINE F sqrt(F a) { return _mm512_sqrt_ps(a); }
  // a * b + c rounded once (torch's Vectorized fmadd)
  static ZK_SIMD_INLINE F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  // a * b - c and -(a * b) + c, rounded once
  static ZK_SIMD_INLINE F fmsub(F a, F b, F c) { return _mm512_fmsub_ps(a, b, c); }
  static ZK_SIMD_INLINE F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  // torch.sign: (0 < x) - (x < 0), so +-0 and NaN give +0
  static ZK_SIMD_INLINE F sign(F x) {
    const F zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
    const F pos = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(zero, x, _CMP_LT_OQ), one);
    const F neg = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ), one);
    return _mm512_sub_ps(pos, neg);
  }
  // round half to even (the explicit rounding mode, whatever MXCSR says)
  static ZK_SIMD_INLINE I rint_i32(F x) {
    return _mm512_cvt_roundps_epi32(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static ZK_SIMD_INLINE F to_f32(I c) { return _mm512_cvtepi32_ps(c); }

  static ZK_SIMD_INLINE I set1i(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static ZK_SIMD_INLINE I bits(F x) { return _mm512_castps_si512(x); }
  static ZK_SIMD_INLINE F from_bits(I u) { return _mm512_castsi512_ps(u); }
  static ZK_SIMD_INLINE I and_i(I a, I b) { return _mm512_and_si512(a, b); }
  static ZK_SIMD_INLINE I add_i(I a, I b) { return _mm512_add_epi32(a, b); }
  static ZK_SIMD_INLINE I sub_i(I a, I b) { return _mm512_sub_epi32(a, b); }
  static ZK_SIMD_INLINE I xor_i(I a, I b) { return _mm512_xor_si512(a, b); }
  static ZK_SIMD_INLINE I abs_i(I a) { return _mm512_abs_epi32(a); }
  template <int N>
  static ZK_SIMD_INLINE I srai(I a) { return _mm512_srai_epi32(a, N); }
  template <int N>
  static ZK_SIMD_INLINE I slli(I a) { return _mm512_slli_epi32(a, N); }
  // lanes whose int32 `cond` is negative (sign bit set) take `neg`, the others `pos`
  static ZK_SIMD_INLINE I select_neg_i(I cond, I neg, I pos) {
    return _mm512_mask_mov_epi32(pos, _mm512_movepi32_mask(cond), neg);
  }
  static ZK_SIMD_INLINE F select_neg_f(I cond, F neg, F pos) {
    return _mm512_mask_mov_ps(pos, _mm512_movepi32_mask(cond), neg);
  }
  static ZK_SIMD_INLINE I srl16(I a) { return _mm512_srli_epi32(a, 16); }
  static ZK_SIMD_INLINE I sll16(I a) { return _mm512_slli_epi32(a, 16); }
  static ZK_SIMD_INLINE I max_u32(I a, I b) { return _mm512_max_epu32(a, b); }
  static ZK_SIMD_INLINE uint32_t reduce_max_u32(I a) { return _mm512_reduce_max_epu32(a); }
  // whether some lane has a >= lim (unsigned)
  static ZK_SIMD_INLINE bool any_ge_u32(I a, I lim) {
    return _mm512_cmpge_epu32_mask(a, lim) != 0;
  }
  // lanes where x is NaN take `nan`, the others r
  static ZK_SIMD_INLINE I select_nan(F x, I r, I nan) {
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), nan);
  }

  static ZK_SIMD_INLINE I widen_u16(H h) { return _mm512_cvtepu16_epi32(h); }
  static ZK_SIMD_INLINE H narrow_u16(I r) { return _mm512_cvtepi32_epi16(r); }  // r <= 0xFFFF
  // The high 16-bit words of a's lanes, then of b's, as one vector: a single vpermt2w.
  static ZK_SIMD_INLINE I pack_high_words(I a, I b) {
    const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37,
                                         35, 33, 31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9,
                                         7, 5, 3, 1);
    return _mm512_permutex2var_epi16(a, odd, b);
  }
  static ZK_SIMD_INLINE F from_fp16(H h) { return _mm512_cvtph_ps(h); }
  static ZK_SIMD_INLINE H to_fp16(F x) {
    return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }

  // Lanes whose exponent is all ones (inf or NaN).
  static ZK_SIMD_INLINE B non_finite(F x) {
    const __m512i e = _mm512_set1_epi32(0x7F800000);
    return _mm512_cmpeq_epi32_mask(_mm512_and_si512(bits(x), e), e);
  }
  static ZK_SIMD_INLINE B no_lanes() { return 0; }
  static ZK_SIMD_INLINE B or_lanes(B a, B b) { return a | b; }
  static ZK_SIMD_INLINE bool any(B a) { return a != 0; }

  static ZK_SIMD_INLINE D zero_d() { return _mm512_setzero_pd(); }
  static ZK_SIMD_INLINE D low_d(F x) { return _mm512_cvtps_pd(_mm512_castps512_ps256(x)); }
  static ZK_SIMD_INLINE D high_d(F x) {
    return _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  }
  static ZK_SIMD_INLINE D fmadd_d(D a, D b, D c) { return _mm512_fmadd_pd(a, b, c); }
  static ZK_SIMD_INLINE void store_d(double* p, D x) { _mm512_storeu_pd(p, x); }
};

}  // namespace zk::simd
