// Internal to csrc/cpu_adam: the per-step coefficients, the scalar element update that every
// path reproduces, and the per-path tile functions.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_adam.h"
#include "cpu_convert.h"

namespace zk::cpu::detail {

// Step-invariant coefficients, computed once per call in double and rounded to float the way
// torch rounds a Python scalar applied to a float tensor.
struct Coeffs {
  float inv_scale;      // 1 / grad_scale (exact for the power-of-two scales GradScaler uses)
  float decay;          // 1 - lr * wd for AdamW, 1 otherwise
  float wd;             // L2 coefficient (used only when l2)
  bool l2;              // classic Adam with L2 and wd != 0
  float lerp_weight;    // 1 - beta1
  float lerp_one_minus; // 1 - lerp_weight, for torch's lerp when the weight is >= 0.5
  bool lerp_small;      // torch.lerp's branch: |weight| < 0.5
  float beta2;
  float one_minus_beta2;
  float inv_sqrt_bc2;   // 1 / sqrt(1 - beta2^t)
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^t)
};

// Everything a tile function needs; a tile updates elements [begin, end) of the full buffers.
struct Kernel {
  Coeffs c;
  float* param;
  const void* grad;
  DType grad_dtype;
  float* exp_avg;
  float* exp_avg_sq;
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

// The update of one element; the SIMD paths perform exactly these operations in this order.
inline void update(const Coeffs& c, float g, float& p, float& m, float& v) {
  g = g * c.inv_scale;
  if (c.l2) g = g + c.wd * p;
  p = p * c.decay;
  const float diff = g - m;
  m = c.lerp_small ? m + c.lerp_weight * diff : g - diff * c.lerp_one_minus;
  v = v * c.beta2 + (c.one_minus_beta2 * g) * g;
  const float denom = std::sqrt(v) * c.inv_sqrt_bc2 + c.eps;
  p = p + c.neg_step_size * (m / denom);
}

inline void run_scalar_range(const Kernel& k, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    float p = k.param[i], m = k.exp_avg[i], v = k.exp_avg_sq[i];
    update(k.c, load_grad(k.grad, k.grad_dtype, i), p, m, v);
    k.param[i] = p;
    k.exp_avg[i] = m;
    k.exp_avg_sq[i] = v;
    if (k.out) store_out(k.out, k.out_dtype, i, p);
  }
}

}  // namespace zk::cpu::detail
