// CPU AdamW: argument checks, coefficients, run-time path choice and OpenMP tiling.
#include "cpu_adam.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include "kernel.h"
#include "parallel.h"
#include "simd/paths.h"

namespace zk::cpu {
namespace {

void require(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument(msg);
}

detail::Coeffs coefficients(const AdamWConfig& cfg) {
  detail::Coeffs c{};
  c.inv_scale = static_cast<float>(1.0 / cfg.grad_scale);
  c.decay = static_cast<float>(cfg.decoupled ? 1.0 - cfg.lr * cfg.weight_decay : 1.0);
  c.wd = static_cast<float>(cfg.weight_decay);
  c.l2 = !cfg.decoupled && cfg.weight_decay != 0.0;
  const double w = 1.0 - cfg.beta1;
  c.lerp_weight = static_cast<float>(w);
  c.lerp_one_minus = 1.0f - c.lerp_weight;  // torch computes 1 - weight in the op's type
  c.lerp_small = std::fabs(c.lerp_weight) < 0.5f;
  c.beta2 = static_cast<float>(cfg.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - cfg.beta2);
  const double bc1 = 1.0 - std::pow(cfg.beta1, cfg.step);
  const double bc2 = 1.0 - std::pow(cfg.beta2, cfg.step);
  c.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  c.eps = static_cast<float>(cfg.eps);
  c.neg_step_size = static_cast<float>(-cfg.lr / bc1);
  return c;
}

void check(const AdamWBuffers& b, const AdamWConfig& cfg) {
  require(b.numel >= 0, "numel must be >= 0, got " + std::to_string(b.numel));
  if (b.numel > 0) {
    require(b.param != nullptr, "param must not be null");
    require(b.grad != nullptr, "grad must not be null");
    require(b.exp_avg != nullptr, "exp_avg must not be null");
    require(b.exp_avg_sq != nullptr, "exp_avg_sq must not be null");
  }
  require(cfg.step >= 1.0, "step must be >= 1 (the step number after incrementing), got " +
                               std::to_string(cfg.step));
  require(cfg.beta1 >= 0.0 && cfg.beta1 < 1.0,
          "beta1 must be in [0, 1), got " + std::to_string(cfg.beta1));
  require(cfg.beta2 >= 0.0 && cfg.beta2 < 1.0,
          "beta2 must be in [0, 1), got " + std::to_string(cfg.beta2));
  require(std::isfinite(cfg.grad_scale) && cfg.grad_scale > 0.0,
          "grad_scale must be finite and > 0, got " + std::to_string(cfg.grad_scale));
}

}  // namespace

Isa adamw_step(const AdamWBuffers& b, const AdamWConfig& cfg, Isa isa, int num_threads) {
  check(b, cfg);
  isa = resolve_isa(isa);
  const int threads = tile_threads(num_threads, b.numel);
  if (b.numel == 0 || (b.found_inf != nullptr && *b.found_inf != 0.0f)) return isa;

  const detail::Kernel k{coefficients(cfg), b.param,      b.grad, b.grad_dtype,
                         b.exp_avg,         b.exp_avg_sq, b.out,  b.out_dtype};
  const auto fn = paths(isa).adam;
  for_ranges(b.numel, kTileNumel, threads, [&](int64_t b0, int64_t b1) { fn(k, b0, b1); });
  return isa;
}

uint16_t float_to_bf16(float x) { return detail::to_bf16(x); }
uint16_t float_to_fp16(float x) { return detail::to_fp16(x); }
float bf16_to_float(uint16_t h) { return detail::from_bf16(h); }
float fp16_to_float(uint16_t h) { return detail::from_fp16(h); }

}  // namespace zk::cpu
