// CPU AdamW over low-bit moments: argument checks, coefficients, run-time path choice and
// OpenMP tiling over whole quantization blocks.
#include "cpu_adam_lowbit.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include "kernel.h"
#include "parallel.h"
#include "simd/paths.h"

namespace zk::cpu {
namespace {

// The tile driver's items (parallel.h) must hold whole blocks.
static_assert(kTileNumel % lowbit::kMaxBlock == 0, "tiles must hold whole blocks");

void require(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument(msg);
}

lowbit::Coeffs coefficients(const AdamWConfig& cfg) {
  lowbit::Coeffs c{};
  c.unscale = cfg.grad_scale != 1.0;
  c.grad_scale = static_cast<float>(cfg.grad_scale);
  c.decoupled = cfg.decoupled;
  c.decay = static_cast<float>(1.0 - cfg.lr * cfg.weight_decay);
  c.l2 = !cfg.decoupled && cfg.weight_decay != 0.0;
  c.wd = static_cast<float>(cfg.weight_decay);
  c.w = static_cast<float>(1.0 - cfg.beta1);
  c.w_minus_one = c.w - 1.0f;
  c.w_small = std::fabs(c.w) < 0.5f;
  c.beta2 = static_cast<float>(cfg.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - cfg.beta2);
  const double bc1 = 1.0 - std::pow(cfg.beta1, cfg.step);
  const double bc2 = 1.0 - std::pow(cfg.beta2, cfg.step);
  c.sqrt_bc2 = static_cast<float>(std::sqrt(bc2));
  c.eps = static_cast<float>(cfg.eps);
  c.neg_step_size = static_cast<float>(-(cfg.lr / bc1));
  return c;
}

void check(const LowbitBuffers& b, const AdamWConfig& cfg) {
  require(b.numel >= 0, "numel must be >= 0, got " + std::to_string(b.numel));
  require(b.param_dtype == DType::kFloat32 || b.param_dtype == DType::kBFloat16,
          std::string("param must be float32 or bfloat16, got ") + dtype_name(b.param_dtype));
  const bool int8 = b.format == MomentFormat::kInt8;
  require(b.format == MomentFormat::kBf16 || int8, "format must be bf16 or int8");
  if (int8) {
    require(quant_block_ok(b.block_size), "block_size must be a power of two in [2, 8192], "
                                          "got " + std::to_string(b.block_size));
  }
  if (b.numel > 0) {
    require(b.param != nullptr, "param must not be null");
    require(b.grad != nullptr, "grad must not be null");
    require(b.exp_avg != nullptr, "exp_avg must not be null");
    require(b.exp_avg_sq != nullptr, "exp_avg_sq must not be null");
    if (int8) {
      require(b.exp_avg_scales != nullptr, "exp_avg_scales must not be null (int8 format)");
      require(b.exp_avg_sq_scales != nullptr,
              "exp_avg_sq_scales must not be null (int8 format)");
    }
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

Isa adamw_step_lowbit(const LowbitBuffers& b, const AdamWConfig& cfg, Isa isa,
                      int num_threads) {
  check(b, cfg);
  isa = resolve_isa(isa);
  const int threads = tile_threads(num_threads, b.numel);
  if (b.numel == 0 || (b.found_inf != nullptr && *b.found_inf != 0.0f)) return isa;

  const lowbit::Kernel k{coefficients(cfg), b.param,         b.param_dtype,
                         b.grad,            b.grad_dtype,    b.format,
                         b.exp_avg,         b.exp_avg_sq,    b.exp_avg_scales,
                         b.exp_avg_sq_scales, b.block_size,  b.numel,
                         b.out,             b.out_dtype};
  const auto fn = paths(isa).adam_lowbit;
  for_ranges(b.numel, kTileNumel, threads, [&](int64_t b0, int64_t b1) { fn(k, b0, b1); });
  return isa;
}

}  // namespace zk::cpu
