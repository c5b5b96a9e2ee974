// Internal to csrc/cpu_optim: the per-step coefficients, the scalar element updates that every
// path reproduces, and the per-path tile functions.
#pragma once

#include <cstdint>

#include "cpu_convert.h"
#include "cpu_optim.h"

// Its own namespace, not cpu_adam's zk::cpu::detail: both libraries link into one module, and
// same-named Kernel/run_avx2/... there would be one symbol (an ODR clash, the wrong tile run).
namespace zk::cpu::optim {

using detail::from_bf16;
using detail::from_fp16;
using detail::to_bf16;
using detail::to_fp16;

enum class Rule : int32_t { kLion = 0, kSgd = 1 };

// Step-invariant coefficients, computed once per call in double and rounded to float the way
// torch rounds a Python scalar applied to a float tensor.
struct Coeffs {
  Rule rule;
  float inv_scale;  // 1 / grad_scale (exact for the power-of-two scales GradScaler uses)
  // Lion
  float decay;      // 1 - lr * wd
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  // SGD
  bool has_wd, has_momentum, nesterov, first_step;
  float wd, momentum, one_minus_dampening;
  float neg_lr;  // -lr (both)
};

// Everything a tile function needs; a tile updates elements [begin, end) of the full buffers.
struct Kernel {
  Coeffs c;
  float* param;
  const void* grad;
  DType grad_dtype;
  float* state;
  void* out;  // nullptr: no copy
  DType out_dtype;
};

inline float load_grad(const void* grad, DType dt, int64_t i) {
  switch (dt) {
    case DType::kBFloat16: return from_bf16(static_cast<const uint16_t*>(grad)[i]);
    case DType::kFloat16: return from_fp16(static_cast<const uint16_t*>(grad)[i]);
    default: return static_cast<const float*>(grad)[i];
  }
}

inline void store_out(void* out, DType dt, int64_t i, float p) {
  switch (dt) {
    case DType::kBFloat16: static_cast<uint16_t*>(out)[i] = to_bf16(p); break;
    case DType::kFloat16: static_cast<uint16_t*>(out)[i] = to_fp16(p); break;
    default: static_cast<float*>(out)[i] = p; break;
  }
}

// torch.sign: (0 < x) - (x < 0); +-0 and NaN give +0.
inline float sign(float x) { return (0.0f < x ? 1.0f : 0.0f) - (x < 0.0f ? 1.0f : 0.0f); }

// The updates of one element; the SIMD paths perform exactly these operations in this order.
inline void lion_update(const Coeffs& c, float g, float& p, float& m) {
  g = g * c.inv_scale;
  p = p * c.decay;
  const float u = sign(m * c.beta1 + g * c.one_minus_beta1);
  p = p + u * c.neg_lr;
  m = m * c.beta2 + g * c.one_minus_beta2;
}

inline void sgd_update(const Coeffs& c, float g, float& p, float* b) {
  g = g * c.inv_scale;
  if (c.has_wd) g = g + p * c.wd;
  if (c.has_momentum) {
    *b = c.first_step ? g : *b * c.momentum + g * c.one_minus_dampening;
    g = c.nesterov ? g + *b * c.momentum : *b;
  }
  p = p + g * c.neg_lr;
}

inline void run_scalar_range(const Kernel& k, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    float p = k.param[i];
    const float g = load_grad(k.grad, k.grad_dtype, i);
    if (k.c.rule == Rule::kLion) {
      lion_update(k.c, g, p, k.state[i]);
    } else {
      sgd_update(k.c, g, p, k.c.has_momentum ? &k.state[i] : nullptr);
    }
    k.param[i] = p;
    if (k.out) store_out(k.out, k.out_dtype, i, p);
  }
}

// Tile functions, one per path: update elements [begin, end).
void run_avx2(const Kernel& k, int64_t begin, int64_t end);
void run_avx512(const Kernel& k, int64_t begin, int64_t end);

}  // namespace zk::cpu::optim
