// Vector traits of the AVX2 path (+ FMA, F16C): 8 fp32 lanes. AVX2 has no cheap masked 16- and
// 8-bit moves, so a ragged end goes through a zeroed stack vector (the same lane operations
// as a full vector, so the same bits). Include it (or avx512.h) in exactly one translation
// unit per library, before the tile bodies: ZK_SIMD is the target attribute they carry.
#pragma once

#if defined(ZK_SIMD)
#error "one ISA's vector traits per translation unit"
#endif

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#define ZK_SIMD __attribute__((target("avx2,fma,f16c")))
#define ZK_SIMD_INLINE ZK_SIMD __attribute__((always_inline)) inline

namespace zk::simd {

struct Avx2 {
  static constexpr int kWidth = 8;
  // Quotients by a constant keep the divider: with 8 lanes it is not the bottleneck, and the
  // FMA form measured slower ([Note: dividing by a constant without the divider]).
  static constexpr bool kFmaQuotient = false;
  using F = __m256;   // kWidth fp32
  using I = __m256i;  // kWidth int32 (or 2 kWidth 16-bit words)
  using H = __m128i;  // kWidth 16-bit words
  using D = __m256d;  // kWidth / 2 fp64
  using B = __m256i;
  struct Full {};
  struct Part {  // the first n < kWidth lanes; the others load 0 and are not stored
    int64_t n;
  };
  static ZK_SIMD_INLINE Part part(int64_t n) { return {n}; }

  static ZK_SIMD_INLINE F load(const float* p, Full) { return _mm256_loadu_ps(p); }
  static ZK_SIMD_INLINE F load(const float* p, Part m) {
    alignas(32) float b[kWidth] = {};
    std::memcpy(b, p, static_cast<size_t>(m.n) * 4);
    return _mm256_load_ps(b);
  }
  static ZK_SIMD_INLINE void store(float* p, F x, Full) { _mm256_storeu_ps(p, x); }
  static ZK_SIMD_INLINE void store(float* p, F x, Part m) {
    alignas(32) float b[kWidth];
    _mm256_store_ps(b, x);
    std::memcpy(p, b, static_cast<size_t>(m.n) * 4);
  }
  static ZK_SIMD_INLINE H load_u16(const uint16_t* p, Full) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  }
  static ZK_SIMD_INLINE H load_u16(const uint16_t* p, Part m) {
    alignas(16) uint16_t b[kWidth] = {};
    std::memcpy(b, p, static_cast<size_t>(m.n) * 2);
    return _mm_load_si128(reinterpret_cast<const __m128i*>(b));
  }
  static ZK_SIMD_INLINE void store_u16(uint16_t* p, H h, Full) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  }
  static ZK_SIMD_INLINE void store_u16(uint16_t* p, H h, Part m) {
    alignas(16) uint16_t b[kWidth];
    _mm_store_si128(reinterpret_cast<__m128i*>(b), h);
    std::memcpy(p, b, static_cast<size_t>(m.n) * 2);
  }
  // int8 <-> int32 lanes (stores narrow values in [-128, 127] exactly)
  static ZK_SIMD_INLINE I load_i8(const int8_t* p, Full) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static ZK_SIMD_INLINE I load_i8(const int8_t* p, Part m) {
    int64_t b = 0;
    std::memcpy(&b, p, static_cast<size_t>(m.n));
    return _mm256_cvtepi8_epi32(_mm_cvtsi64_si128(b));
  }
  static ZK_SIMD_INLINE __m128i narrow_i8(I c) {
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    return _mm_packs_epi16(w, w);
  }
  static ZK_SIMD_INLINE void store_i8(int8_t* p, I c, Full) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), narrow_i8(c));
  }
  static ZK_SIMD_INLINE void store_i8(int8_t* p, I c, Part m) {
    const int64_t b = _mm_cvtsi128_si64(narrow_i8(c));
    std::memcpy(p, &b, static_cast<size_t>(m.n));
  }
  // uint8 <-> int32 lanes (stores values in [0, 255] exactly)
  static ZK_SIMD_INLINE I load_u8(const uint8_t* p, Full) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static ZK_SIMD_INLINE I load_u8(const uint8_t* p, Part m) {
    int64_t b = 0;
    std::memcpy(&b, p, static_cast<size_t>(m.n));
    return _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(b));
  }
  static ZK_SIMD_INLINE __m128i narrow_u8(I c) {
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    return _mm_packus_epi16(w, w);
  }
  static ZK_SIMD_INLINE void store_u8(uint8_t* p, I c, Full) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), narrow_u8(c));
  }
  static ZK_SIMD_INLINE void store_u8(uint8_t* p, I c, Part m) {
    const int64_t b = _mm_cvtsi128_si64(narrow_u8(c));
    std::memcpy(p, &b, static_cast<size_t>(m.n));
  }
  static ZK_SIMD_INLINE I load_i(const void* p) {
    return _mm256_loadu_si256(static_cast<const __m256i*>(p));
  }
  static ZK_SIMD_INLINE void store_i(void* p, I x) {
    _mm256_storeu_si256(static_cast<__m256i*>(p), x);
  }
  // The last bytes < 2 * sizeof(I) of a byte copy.
  static ZK_SIMD_INLINE void move_tail(char* d, const char* s, int64_t bytes) {
    if (bytes > 0) std::memcpy(d, s, static_cast<size_t>(bytes));
  }

  static ZK_SIMD_INLINE F set1(float x) { return _mm256_set1_ps(x); }
  static ZK_SIMD_INLINE F add(F a, F b) { return _mm256_add_ps(a, b); }
  static ZK_SIMD_INLINE F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static ZK_SIMD_INLINE F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static ZK_SIMD_INLINE F div(F a, F b) { return _mm256_div_ps(a, b); }
  static ZK_SIMD_INLINE F sqrt(F a) { return _mm256_sqrt_ps(a); }
  // a * b + c rounded once (torch's Vectorized fmadd)
  static ZK_SIMD_INLINE F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  // a * b - c and -(a * b) + c, rounded once
  static ZK_SIMD_INLINE F fmsub(F a, F b, F c) { return _mm256_fmsub_ps(a, b, c); }
  static ZK_SIMD_INLINE F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  // torch.sign: (0 < x) - (x < 0), so +-0 and NaN give +0
  static ZK_SIMD_INLINE F sign(F x) {
    const F zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
    const F pos = _mm256_and_ps(_mm256_cmp_ps(zero, x, _CMP_LT_OQ), one);
    const F neg = _mm256_and_ps(_mm256_cmp_ps(x, zero, _CMP_LT_OQ), one);
    return _mm256_sub_ps(pos, neg);
  }
  // round half to even (the explicit rounding mode, whatever MXCSR says)
  static ZK_SIMD_INLINE I rint_i32(F x) {
    return _mm256_cvttps_epi32(_mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static ZK_SIMD_INLINE F to_f32(I c) { return _mm256_cvtepi32_ps(c); }

  static ZK_SIMD_INLINE I set1i(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  static ZK_SIMD_INLINE I bits(F x) { return _mm256_castps_si256(x); }
  static ZK_SIMD_INLINE F from_bits(I u) { return _mm256_castsi256_ps(u); }
  static ZK_SIMD_INLINE I and_i(I a, I b) { return _mm256_and_si256(a, b); }
  static ZK_SIMD_INLINE I add_i(I a, I b) { return _mm256_add_epi32(a, b); }
  static ZK_SIMD_INLINE I sub_i(I a, I b) { return _mm256_sub_epi32(a, b); }
  static ZK_SIMD_INLINE I xor_i(I a, I b) { return _mm256_xor_si256(a, b); }
  static ZK_SIMD_INLINE I abs_i(I a) { return _mm256_abs_epi32(a); }
  template <int N>
  static ZK_SIMD_INLINE I srai(I a) { return _mm256_srai_epi32(a, N); }
  template <int N>
  static ZK_SIMD_INLINE I slli(I a) { return _mm256_slli_epi32(a, N); }
  // lanes whose int32 `cond` is negative (sign bit set) take `neg`, the others `pos`
  static ZK_SIMD_INLINE I select_neg_i(I cond, I neg, I pos) {
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(pos),
                                                 _mm256_castsi256_ps(neg),
                                                 _mm256_castsi256_ps(cond)));
  }
  static ZK_SIMD_INLINE F select_neg_f(I cond, F neg, F pos) {
    return _mm256_blendv_ps(pos, neg, _mm256_castsi256_ps(cond));
  }
  static ZK_SIMD_INLINE I srl16(I a) { return _mm256_srli_epi32(a, 16); }
  static ZK_SIMD_INLINE I sll16(I a) { return _mm256_slli_epi32(a, 16); }
  static ZK_SIMD_INLINE I max_u32(I a, I b) { return _mm256_max_epu32(a, b); }
  // whether some lane has a >= lim (unsigned)
  static ZK_SIMD_INLINE bool any_ge_u32(I a, I lim) {
    return _mm256_movemask_ps(_mm256_castsi256_ps(
               _mm256_cmpeq_epi32(_mm256_max_epu32(a, lim), a))) != 0;
  }
  static ZK_SIMD_INLINE uint32_t reduce_max_u32(I a) {
    alignas(32) uint32_t lane[kWidth];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lane), a);
    uint32_t t = 0;
    for (uint32_t v : lane) t = v > t ? v : t;
    return t;
  }
  // lanes where x is NaN take `nan`, the others r
  static ZK_SIMD_INLINE I select_nan(F x, I r, I nan) {
    return _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  }

  static ZK_SIMD_INLINE I widen_u16(H h) { return _mm256_cvtepu16_epi32(h); }
  // r <= 0xFFFF: the unsigned-saturating pack is exact; it packs per 128-bit lane, and the
  // permute gathers the two lanes' low halves.
  static ZK_SIMD_INLINE H narrow_u16(I r) {
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
  }
  // The high 16-bit words of a's lanes, then of b's, as one vector.
  static ZK_SIMD_INLINE I pack_high_words(I a, I b) {
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(srl16(a), srl16(b)), 0xD8);
  }
  static ZK_SIMD_INLINE F from_fp16(H h) { return _mm256_cvtph_ps(h); }
  static ZK_SIMD_INLINE H to_fp16(F x) {
    return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }

  // Lanes whose exponent is all ones (inf or NaN), as all-ones int32 lanes.
  static ZK_SIMD_INLINE B non_finite(F x) {
    const __m256i e = _mm256_set1_epi32(0x7F800000);
    return _mm256_cmpeq_epi32(_mm256_and_si256(bits(x), e), e);
  }
  static ZK_SIMD_INLINE B no_lanes() { return _mm256_setzero_si256(); }
  static ZK_SIMD_INLINE B or_lanes(B a, B b) { return _mm256_or_si256(a, b); }
  static ZK_SIMD_INLINE bool any(B a) { return !_mm256_testz_si256(a, a); }

  static ZK_SIMD_INLINE D zero_d() { return _mm256_setzero_pd(); }
  static ZK_SIMD_INLINE D low_d(F x) { return _mm256_cvtps_pd(_mm256_castps256_ps128(x)); }
  static ZK_SIMD_INLINE D high_d(F x) { return _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)); }
  static ZK_SIMD_INLINE D fmadd_d(D a, D b, D c) { return _mm256_fmadd_pd(a, b, c); }
  static ZK_SIMD_INLINE void store_d(double* p, D x) { _mm256_storeu_pd(p, x); }
};

}  // namespace zk::simd
