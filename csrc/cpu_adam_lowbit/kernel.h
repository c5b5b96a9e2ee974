// Internal to csrc/cpu_adam_lowbit: the per-step coefficients, the scalar element update and
// block requantization that every path reproduces, and the per-path tile functions.
//
// [Note: lowbit arithmetic is torch's]
// The reference (zkernels.reference.adamw_step_lowbit) is a chain of torch ops, and torch's
// CPU kernels (AVX2 and AVX-512 builds, torch 2.x as tested) fuse some of them: ``lerp_`` is
// ``fma(w, end - self, self)`` for |w| < 0.5 and ``fma(w - 1, end - self, end)`` otherwise,
// ``addcmul_(t1, t2, value=s)`` is ``fma(s * t1, t2, self)``, ``add(x, alpha=a)`` is
// ``fma(a, x, self)``, while ``addcdiv_`` is ``self + (value * t1) / t2`` unfused and a tensor
// divided by a Python scalar is an IEEE division (not a product by the reciprocal). This
// kernel performs exactly those operations (every other product and sum rounded on its own:
// the TU is built with -ffp-contract=off), in the reference's order. Its sqrt is the IEEE
// instruction, and the reference's is correctly rounded too ([Note: correctly rounded sqrt] in
// zkernels/reference/adamw.py: torch's own CPU ``sqrt`` runs MKL's vector sqrt, which on
// AVX-512 CPUs is 1 ulp off for ~0.6% of fp32 inputs). So the kernel equals the reference bit
// for bit on every path wherever torch's kernels fuse as above (every capability but DEFAULT;
// tests/native/test_cpu_adam_lowbit.py, tests/ops/test_adamw_lowbit.py).
// csrc/cpu_adam keeps the unfused order of its own recipe instead (compared with the
// reference to the fp32 tolerance).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_adam_lowbit.h"
#include "cpu_convert.h"
#include "cpu_quant/kernel.h"  // quant::block_scale, the blockwise arithmetic

// Its own namespace (see the note in csrc/cpu_optim/kernel.h): one module links every library.
namespace zk::cpu::lowbit {

using detail::from_bf16;
using detail::from_fp16;
using detail::to_bf16;
using detail::to_fp16;

// The 8-bit float codes of [Note: low-bit moment formats] (zkernels/reference/adamw_lowbit.py):
// a block's scale is its absmax, and y = |x| / absmax in [0, 1] is coded with kMant* mantissa
// bits, normal from 2^kEmin, linear (subnormal) below, rounded to nearest even.
constexpr int kMantM = 3;  // exp_avg: sign + code, |codes| <= 120
constexpr int kMantR = 4;  // sqrt(exp_avg_sq): codes <= 240
constexpr int kEmin = -14;
constexpr int32_t kCodeBase = (127 + kEmin) << 23;  // the bits of 2^kEmin
constexpr int64_t kMaxBlock = kMaxQuantBlock;

constexpr float pow2(int e) {
  return e > 0 ? 2.0f * pow2(e - 1) : e < 0 ? pow2(e + 1) / 2.0f : 1.0f;
}

// encode_ratio: the code of y in [0, 1] (its bits read as int32; the normal branch rounds the
// bits to 23 - M fewer mantissa bits, half to even, which carries into the exponent).
template <int M>
inline int32_t encode(float y) {
  constexpr int S = 23 - M;
  const int32_t d = static_cast<int32_t>(detail::bits_of(y)) - kCodeBase;
  if (d >= 0) return ((d + ((1 << (S - 1)) - 1) + ((d >> S) & 1)) >> S) + (1 << M);
  return static_cast<int32_t>(std::rint(y * pow2(M - kEmin)));
}

// decode_ratio: the value of code c >= 0, exactly.
template <int M>
inline float decode(int32_t c) {
  constexpr int S = 23 - M;
  const int32_t d = c - (1 << M);
  if (d >= 0) return detail::float_of(static_cast<uint32_t>(d << S) + kCodeBase);
  return static_cast<float>(c) * pow2(kEmin - M);
}

// Step-invariant coefficients, each rounded to float as torch rounds a Python scalar applied
// to a float tensor.
struct Coeffs {
  bool unscale;        // g = g / grad_scale (grad_scale != 1)
  float grad_scale;
  bool decoupled;      // p = p * decay
  float decay;         // 1 - lr * wd
  bool l2;             // !decoupled && wd != 0: g = fma(wd, p, g)
  float wd;
  bool w_small;        // torch.lerp's branch: |w| < 0.5
  float w;             // 1 - beta1
  float w_minus_one;   // w - 1, in float (torch computes it on the float weight)
  float beta2;
  float one_minus_beta2;
  float sqrt_bc2;      // sqrt(1 - beta2^t), the divisor of sqrt(v)
  float eps;
  float neg_step_size; // -lr / (1 - beta1^t)
};

// Everything a tile function needs; a tile updates elements [begin, end) of the full buffers
// (for the int8 format, begin is a multiple of the block size).
struct Kernel {
  Coeffs c;
  void* param;
  DType param_dtype;
  const void* grad;
  DType grad_dtype;
  MomentFormat format;
  void* exp_avg;
  void* exp_avg_sq;
  float* m_scales;
  float* v_scales;
  int64_t block;
  int64_t numel;
  void* out;  // nullptr: no copy
  DType out_dtype;
};

inline float load_as(const void* p, DType dt, int64_t i) {
  switch (dt) {
    case DType::kBFloat16: return from_bf16(static_cast<const uint16_t*>(p)[i]);
    case DType::kFloat16: return from_fp16(static_cast<const uint16_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

inline void store_as(void* p, DType dt, int64_t i, float x) {
  switch (dt) {
    case DType::kBFloat16: static_cast<uint16_t*>(p)[i] = to_bf16(x); break;
    case DType::kFloat16: static_cast<uint16_t*>(p)[i] = to_fp16(x); break;
    default: static_cast<float*>(p)[i] = x; break;
  }
}

// The update of one element, in the reference's order ([Note: lowbit arithmetic is torch's]);
// returns sqrt(v), which is both the denominator's root and what the int8 format quantizes.
// The AVX-512 path gets its quotients by a per-step or per-block constant from FMAs instead of
// the divider, with the division's bits ([Note: dividing by a constant without the divider]
// in tile.h); this scalar path divides.
inline float update(const Coeffs& c, float g, float& p, float& m, float& v) {
  if (c.unscale) g = g / c.grad_scale;
  if (c.decoupled) {
    p = p * c.decay;
  } else if (c.l2) {
    g = std::fma(c.wd, p, g);
  }
  const float diff = g - m;
  m = c.w_small ? std::fma(c.w, diff, m) : std::fma(c.w_minus_one, diff, g);
  v = std::fma(c.one_minus_beta2 * g, g, v * c.beta2);
  const float r = std::sqrt(v);
  const float denom = r / c.sqrt_bc2 + c.eps;
  p = p + (c.neg_step_size * m) / denom;
  return r;
}

// The bf16 format, elements [begin, end).
inline void scalar_bf16(const Kernel& k, int64_t begin, int64_t end) {
  uint16_t* em = static_cast<uint16_t*>(k.exp_avg);
  uint16_t* ev = static_cast<uint16_t*>(k.exp_avg_sq);
  for (int64_t i = begin; i < end; ++i) {
    float p = load_as(k.param, k.param_dtype, i), m = from_bf16(em[i]), v = from_bf16(ev[i]);
    update(k.c, load_as(k.grad, k.grad_dtype, i), p, m, v);
    store_as(k.param, k.param_dtype, i, p);
    em[i] = to_bf16(m);
    ev[i] = to_bf16(v);
    if (k.out) store_as(k.out, k.out_dtype, i, p);
  }
}

// The int8 format, blocks [b0, b1): decode, update (staging the new m and sqrt(v) and their
// largest |bits|), then the block's scales (quant::block_scale's absmax) and codes.
inline void scalar_int8(const Kernel& k, int64_t b0, int64_t b1) {
  alignas(64) float ms[kMaxBlock], rs[kMaxBlock];
  int8_t* qm = static_cast<int8_t*>(k.exp_avg);
  uint8_t* qv = static_cast<uint8_t*>(k.exp_avg_sq);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t base = b * k.block;
    const int64_t n = k.numel - base < k.block ? k.numel - base : k.block;
    const float sm = k.m_scales[b], sv = k.v_scales[b];
    uint32_t tm = 0, tr = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t j = base + i;
      float p = load_as(k.param, k.param_dtype, j);
      const int32_t cm = qm[j];
      float m = decode<kMantM>(cm < 0 ? -cm : cm) * sm;
      if (cm < 0) m = -m;
      const float r0 = decode<kMantR>(qv[j]) * sv;
      float v = r0 * r0;
      const float r = update(k.c, load_as(k.grad, k.grad_dtype, j), p, m, v);
      store_as(k.param, k.param_dtype, j, p);
      if (k.out) store_as(k.out, k.out_dtype, j, p);
      ms[i] = m;
      rs[i] = r;
      const uint32_t am = detail::bits_of(m) & 0x7FFFFFFFu, ar = detail::bits_of(r) & 0x7FFFFFFFu;
      tm = am > tm ? am : tm;
      tr = ar > tr ? ar : tr;
    }
    const quant::BlockScale s_m = quant::block_scale(tm, 1.0f);  // scale = absmax
    const quant::BlockScale s_r = quant::block_scale(tr, 1.0f);
    k.m_scales[b] = s_m.scale;
    k.v_scales[b] = s_r.scale;
    for (int64_t i = 0; i < n; ++i) {
      const int32_t mag = encode<kMantM>(std::fabs(ms[i]) / s_m.amax);
      qm[base + i] = s_m.ok ? static_cast<int8_t>(ms[i] < 0.0f ? -mag : mag) : 0;
      qv[base + i] = s_r.ok ? static_cast<uint8_t>(encode<kMantR>(rs[i] / s_r.amax)) : 0;
    }
  }
}

inline void run_scalar_range(const Kernel& k, int64_t begin, int64_t end) {
  if (k.format == MomentFormat::kBf16) return scalar_bf16(k, begin, end);
  scalar_int8(k, begin / k.block, (end + k.block - 1) / k.block);
}

}  // namespace zk::cpu::lowbit
