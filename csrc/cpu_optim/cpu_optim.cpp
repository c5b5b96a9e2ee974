// CPU Lion and SGD: argument checks, coefficients, run-time path choice and OpenMP tiling.
#include "cpu_optim.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "kernel.h"

namespace zk::cpu {
namespace {

// Elements per OpenMP work item: 64 KiB of each fp32 stream, a multiple of every vector width
// so that only the last tile has a ragged end. Below two tiles the call stays on one thread.
constexpr int64_t kTileNumel = 16384;

void require(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument(msg);
}

void check_buffers(const OptimBuffers& b, bool needs_state) {
  require(b.numel >= 0, "numel must be >= 0, got " + std::to_string(b.numel));
  if (b.numel > 0) {
    require(b.param != nullptr, "param must not be null");
    require(b.grad != nullptr, "grad must not be null");
    if (needs_state) require(b.state != nullptr, "state must not be null");
  }
}

void check_scale(double grad_scale) {
  require(std::isfinite(grad_scale) && grad_scale > 0.0,
          "grad_scale must be finite and > 0, got " + std::to_string(grad_scale));
}

using TileFn = void (*)(const optim::Kernel&, int64_t, int64_t);

TileFn tile_function(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return optim::run_avx512;
    case Isa::kAvx2: return optim::run_avx2;
    default: return optim::run_scalar_range;
  }
}

Isa run(const OptimBuffers& b, const optim::Coeffs& c, Isa isa, int num_threads) {
  isa = resolve_isa(isa);
  require(num_threads >= 0, "num_threads must be >= 0, got " + std::to_string(num_threads));
  if (b.numel == 0 || (b.found_inf != nullptr && *b.found_inf != 0.0f)) return isa;
  const optim::Kernel k{c, b.param, b.grad, b.grad_dtype, b.state, b.out, b.out_dtype};
  const TileFn fn = tile_function(isa);
  const int64_t num_tiles = (b.numel + kTileNumel - 1) / kTileNumel;
  const int64_t wanted = num_threads > 0 ? num_threads : omp_get_max_threads();
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min(wanted, num_tiles)));
  if (threads == 1) {
    fn(k, 0, b.numel);
    return isa;
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < num_tiles; ++t) {
    fn(k, t * kTileNumel, std::min(b.numel, (t + 1) * kTileNumel));
  }
  return isa;
}

}  // namespace

Isa lion_step(const OptimBuffers& b, const LionConfig& cfg, Isa isa, int num_threads) {
  check_buffers(b, /*needs_state=*/true);
  require(cfg.beta1 >= 0.0 && cfg.beta1 <= 1.0,
          "beta1 must be in [0, 1], got " + std::to_string(cfg.beta1));
  require(cfg.beta2 >= 0.0 && cfg.beta2 <= 1.0,
          "beta2 must be in [0, 1], got " + std::to_string(cfg.beta2));
  check_scale(cfg.grad_scale);
  optim::Coeffs c{};
  c.rule = optim::Rule::kLion;
  c.inv_scale = static_cast<float>(1.0 / cfg.grad_scale);
  c.decay = static_cast<float>(1.0 - cfg.lr * cfg.weight_decay);
  c.beta1 = static_cast<float>(cfg.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - cfg.beta1);
  c.beta2 = static_cast<float>(cfg.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - cfg.beta2);
  c.neg_lr = static_cast<float>(-cfg.lr);
  return run(b, c, isa, num_threads);
}

Isa sgd_step(const OptimBuffers& b, const SgdConfig& cfg, Isa isa, int num_threads) {
  check_buffers(b, /*needs_state=*/cfg.momentum != 0.0);
  require(cfg.momentum >= 0.0, "momentum must be >= 0, got " + std::to_string(cfg.momentum));
  require(!cfg.nesterov || (cfg.momentum > 0.0 && cfg.dampening == 0.0),
          "nesterov needs momentum > 0 and dampening == 0");
  check_scale(cfg.grad_scale);
  optim::Coeffs c{};
  c.rule = optim::Rule::kSgd;
  c.inv_scale = static_cast<float>(1.0 / cfg.grad_scale);
  c.has_wd = cfg.weight_decay != 0.0;
  c.wd = static_cast<float>(cfg.weight_decay);
  c.has_momentum = cfg.momentum != 0.0;
  c.nesterov = cfg.nesterov;
  c.first_step = cfg.first_step;
  c.momentum = static_cast<float>(cfg.momentum);
  c.one_minus_dampening = static_cast<float>(1.0 - cfg.dampening);
  c.neg_lr = static_cast<float>(-cfg.lr);
  return run(b, c, isa, num_threads);
}

}  // namespace zk::cpu
