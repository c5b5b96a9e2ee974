// AVX2 path (+ FMA-era F16C): 8 elements per iteration, the last < 8 elements of a tile go
// through the scalar update (AVX2 has no cheap masked 16-bit loads). Same operations in the
// same order as detail::update, so the results are bit-identical to the scalar path.
#include "kernel.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define ZK_AVX2 __attribute__((target("avx2,fma,f16c")))
#define ZK_AVX2_INLINE ZK_AVX2 __attribute__((always_inline)) inline

namespace zk::cpu::detail {
namespace {

ZK_AVX2_INLINE __m256 load_grad8(const void* grad, int64_t i, DType dt) {
  if (dt == DType::kFloat32) return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
  const __m128i h =
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
  if (dt == DType::kFloat16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

ZK_AVX2_INLINE void store_out8(void* out, int64_t i, DType dt, __m256 p) {
  if (dt == DType::kFloat32) {
    _mm256_storeu_ps(static_cast<float*>(out) + i, p);
    return;
  }
  __m128i h;
  if (dt == DType::kFloat16) {
    h = _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT);
  } else {
    const __m256i u = _mm256_castps_si256(p);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
    r = _mm256_srli_epi32(r, 16);
    const __m256 nan = _mm256_cmp_ps(p, p, _CMP_UNORD_Q);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0xFFFF), _mm256_castps_si256(nan));
    // Values are <= 0xFFFF, so the unsigned-saturating pack is exact; it packs per 128-bit
    // lane, and the permute gathers the two lanes' low halves.
    r = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    h = _mm256_castsi256_si128(r);
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i), h);
}

template <DType G, int O>  // O: -1 no copy, else the DType of `out`
ZK_AVX2 void tile(const Kernel& k, int64_t begin, int64_t end) {
  const Coeffs& c = k.c;
  const __m256 inv_scale = _mm256_set1_ps(c.inv_scale), decay = _mm256_set1_ps(c.decay);
  const __m256 wd = _mm256_set1_ps(c.wd), lw = _mm256_set1_ps(c.lerp_weight);
  const __m256 l1m = _mm256_set1_ps(c.lerp_one_minus), b2 = _mm256_set1_ps(c.beta2);
  const __m256 omb2 = _mm256_set1_ps(c.one_minus_beta2), ibc2 = _mm256_set1_ps(c.inv_sqrt_bc2);
  const __m256 eps = _mm256_set1_ps(c.eps), nss = _mm256_set1_ps(c.neg_step_size);
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    __m256 g = load_grad8(k.grad, i, G);
    __m256 p = _mm256_loadu_ps(k.param + i);
    __m256 m = _mm256_loadu_ps(k.exp_avg + i);
    __m256 v = _mm256_loadu_ps(k.exp_avg_sq + i);
    g = _mm256_mul_ps(g, inv_scale);
    if (c.l2) g = _mm256_add_ps(g, _mm256_mul_ps(wd, p));
    p = _mm256_mul_ps(p, decay);
    const __m256 diff = _mm256_sub_ps(g, m);
    m = c.lerp_small ? _mm256_add_ps(m, _mm256_mul_ps(lw, diff))
                     : _mm256_sub_ps(g, _mm256_mul_ps(diff, l1m));
    v = _mm256_add_ps(_mm256_mul_ps(v, b2), _mm256_mul_ps(_mm256_mul_ps(omb2, g), g));
    const __m256 denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(v), ibc2), eps);
    p = _mm256_add_ps(p, _mm256_mul_ps(nss, _mm256_div_ps(m, denom)));
    _mm256_storeu_ps(k.param + i, p);
    _mm256_storeu_ps(k.exp_avg + i, m);
    _mm256_storeu_ps(k.exp_avg_sq + i, v);
    if constexpr (O >= 0) store_out8(k.out, i, static_cast<DType>(O), p);
  }
  run_scalar_range(k, i, end);
}

template <DType G>
void tile_for_out(const Kernel& k, int64_t begin, int64_t end) {
  if (!k.out) return tile<G, -1>(k, begin, end);
  switch (k.out_dtype) {
    case DType::kBFloat16: return tile<G, static_cast<int>(DType::kBFloat16)>(k, begin, end);
    case DType::kFloat16: return tile<G, static_cast<int>(DType::kFloat16)>(k, begin, end);
    default: return tile<G, static_cast<int>(DType::kFloat32)>(k, begin, end);
  }
}

}  // namespace

void run_avx2(const Kernel& k, int64_t begin, int64_t end) {
  switch (k.grad_dtype) {
    case DType::kBFloat16: return tile_for_out<DType::kBFloat16>(k, begin, end);
    case DType::kFloat16: return tile_for_out<DType::kFloat16>(k, begin, end);
    default: return tile_for_out<DType::kFloat32>(k, begin, end);
  }
}

}  // namespace zk::cpu::detail

#else  // not x86-64: isa_supported() never reports this path, so this is never called

namespace zk::cpu::detail {
void run_avx2(const Kernel& k, int64_t begin, int64_t end) { run_scalar_range(k, begin, end); }
}  // namespace zk::cpu::detail

#endif
