// CPU Lion and SGD (momentum, dampening, nesterov, weight decay) over flat fp32 buffers: the
// other fused optimizer steps beside csrc/cpu_adam, in the same shape.
//
// One pass over memory per step: read param, grad and the one state buffer (Lion's exp_avg,
// SGD's momentum buffer); write param, the state and (optionally) the updated param cast to
// bf16/fp16. The arithmetic follows zkernels/reference/lion.py and sgd.py operation for
// operation; every SIMD path performs the same IEEE operations in the same order (the TU is
// built with -ffp-contract=off), so all paths give bit-identical results.
#pragma once

#include <cstdint>

#include "dtype.h"
#include "simd/isa.h"  // Isa and its detection

namespace zk::cpu {

// Lion (Chen et al. 2023): u = sign(b1*m + (1-b1)*g); p = p*(1 - lr*wd) - lr*u;
// m = b2*m + (1-b2)*g.
struct LionConfig {
  double lr = 1e-4;
  double beta1 = 0.9;
  double beta2 = 0.99;
  double weight_decay = 0.0;  // decoupled: p *= 1 - lr*wd
  double grad_scale = 1.0;    // the gradient is divided by this (a loss scale), > 0
};

// torch.optim.SGD: g += wd*p; with momentum b = g on the first step, else
// b = momentum*b + (1-dampening)*g; g = nesterov ? g + momentum*b : b; p = p - lr*g.
struct SgdConfig {
  double lr = 1e-2;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  bool first_step = false;  // the momentum buffer is set to the gradient (torch's clone)
  double grad_scale = 1.0;
};

// The flat buffers of one shard, all `numel` elements long and contiguous.
struct OptimBuffers {
  float* param = nullptr;
  const void* grad = nullptr;
  DType grad_dtype = DType::kFloat32;
  float* state = nullptr;  // Lion's exp_avg; SGD's momentum buffer (unused when momentum == 0)
  int64_t numel = 0;
  const float* found_inf = nullptr;  // optional; when *found_inf != 0 the call changes nothing
  void* out = nullptr;               // optional copy of the updated param, in out_dtype
  DType out_dtype = DType::kFloat32;
};

// One step in place. Threads: num_threads > 0 uses that many OpenMP threads, 0 uses OpenMP's
// default. Returns the path that ran (the one asked for, or the best for kAuto). Throws
// std::invalid_argument on bad arguments (named) or an unsupported forced path.
Isa lion_step(const OptimBuffers& buffers, const LionConfig& config, Isa isa = Isa::kAuto,
              int num_threads = 0);
Isa sgd_step(const OptimBuffers& buffers, const SgdConfig& config, Isa isa = Isa::kAuto,
             int num_threads = 0);

}  // namespace zk::cpu
