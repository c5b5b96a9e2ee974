// AVX-512 path (F + BW + VL): 16 elements per iteration, masked loads/stores for the tail so
// no scalar epilogue runs. Built with a per-function target attribute: the rest of the
// library stays baseline x86-64 and this code runs only after __builtin_cpu_supports says so.
#include "kernel.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define ZK_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define ZK_AVX512_INLINE ZK_AVX512 __attribute__((always_inline)) inline

namespace zk::cpu::detail {
namespace {

ZK_AVX512_INLINE __m512 load_grad16(const void* grad, int64_t i, __mmask16 mask, DType dt) {
  if (dt == DType::kFloat32) return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(grad) + i);
  const __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(grad) + i);
  if (dt == DType::kFloat16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

ZK_AVX512_INLINE void store_out16(void* out, int64_t i, __mmask16 mask, DType dt, __m512 p) {
  if (dt == DType::kFloat32) {
    _mm512_mask_storeu_ps(static_cast<float*>(out) + i, mask, p);
    return;
  }
  __m256i h;
  if (dt == DType::kFloat16) {
    h = _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  } else {
    // Integer round-to-nearest-even (as torch does; vcvtneps2bf16 would flush subnormals).
    const __m512i u = _mm512_castps_si512(p);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0xFFFF));
    h = _mm512_cvtepi32_epi16(r);
  }
  _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + i, mask, h);
}

template <DType G, int O>  // O: -1 no copy, else the DType of `out`
ZK_AVX512 void tile(const Kernel& k, int64_t begin, int64_t end) {
  const Coeffs& c = k.c;
  const __m512 inv_scale = _mm512_set1_ps(c.inv_scale), decay = _mm512_set1_ps(c.decay);
  const __m512 wd = _mm512_set1_ps(c.wd), lw = _mm512_set1_ps(c.lerp_weight);
  const __m512 l1m = _mm512_set1_ps(c.lerp_one_minus), b2 = _mm512_set1_ps(c.beta2);
  const __m512 omb2 = _mm512_set1_ps(c.one_minus_beta2), ibc2 = _mm512_set1_ps(c.inv_sqrt_bc2);
  const __m512 eps = _mm512_set1_ps(c.eps), nss = _mm512_set1_ps(c.neg_step_size);
  for (int64_t i = begin; i < end; i += 16) {
    const int64_t left = end - i;
    const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF)
                                      : static_cast<__mmask16>((1u << left) - 1u);
    __m512 g = load_grad16(k.grad, i, mask, G);
    __m512 p = _mm512_maskz_loadu_ps(mask, k.param + i);
    __m512 m = _mm512_maskz_loadu_ps(mask, k.exp_avg + i);
    __m512 v = _mm512_maskz_loadu_ps(mask, k.exp_avg_sq + i);
    g = _mm512_mul_ps(g, inv_scale);
    if (c.l2) g = _mm512_add_ps(g, _mm512_mul_ps(wd, p));
    p = _mm512_mul_ps(p, decay);
    const __m512 diff = _mm512_sub_ps(g, m);
    m = c.lerp_small ? _mm512_add_ps(m, _mm512_mul_ps(lw, diff))
                     : _mm512_sub_ps(g, _mm512_mul_ps(diff, l1m));
    v = _mm512_add_ps(_mm512_mul_ps(v, b2), _mm512_mul_ps(_mm512_mul_ps(omb2, g), g));
    const __m512 denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(v), ibc2), eps);
    p = _mm512_add_ps(p, _mm512_mul_ps(nss, _mm512_div_ps(m, denom)));
    _mm512_mask_storeu_ps(k.param + i, mask, p);
    _mm512_mask_storeu_ps(k.exp_avg + i, mask, m);
    _mm512_mask_storeu_ps(k.exp_avg_sq + i, mask, v);
    if constexpr (O >= 0) store_out16(k.out, i, mask, static_cast<DType>(O), p);
  }
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

void run_avx512(const Kernel& k, int64_t begin, int64_t end) {
  switch (k.grad_dtype) {
    case DType::kBFloat16: return tile_for_out<DType::kBFloat16>(k, begin, end);
    case DType::kFloat16: return tile_for_out<DType::kFloat16>(k, begin, end);
    default: return tile_for_out<DType::kFloat32>(k, begin, end);
  }
}

}  // namespace zk::cpu::detail

#else  // not x86-64: isa_supported() never reports this path, so this is never called

namespace zk::cpu::detail {
void run_avx512(const Kernel& k, int64_t begin, int64_t end) { run_scalar_range(k, begin, end); }
}  // namespace zk::cpu::detail

#endif
