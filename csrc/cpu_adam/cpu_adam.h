// CPU AdamW over flat fp32 buffers: the optimizer step of CPU offload.
//
// One pass over memory per step: read param, grad, exp_avg, exp_avg_sq; write param, exp_avg,
// exp_avg_sq and (optionally) the updated param cast to bf16/fp16 for the device copy. The
// arithmetic follows zkernels/reference/adamw.py (torch.optim.AdamW, single-tensor path)
// operation for operation; every SIMD path performs the same IEEE operations in the same order
// (the TU is built with -ffp-contract=off), so all paths give bit-identical results.
#pragma once

#include <cstdint>

#include "dtype.h"
#include "simd/isa.h"  // Isa and its detection

namespace zk::cpu {

// Hyperparameters of one step, as zkernels.reference.adamw_step takes them.
struct AdamWConfig {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  double step = 1.0;        // the step number after incrementing (>= 1)
  bool decoupled = true;    // AdamW decay; false: classic L2 (g += wd * p)
  double grad_scale = 1.0;  // the gradient is divided by this (a loss scale), > 0
};

// The flat buffers of one shard, all `numel` elements long and contiguous.
struct AdamWBuffers {
  float* param = nullptr;
  const void* grad = nullptr;
  DType grad_dtype = DType::kFloat32;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  int64_t numel = 0;
  const float* found_inf = nullptr;  // optional; when *found_inf != 0 the call changes nothing
  void* out = nullptr;               // optional copy of the updated param, in out_dtype
  DType out_dtype = DType::kFloat32;
};

// One AdamW step in place. Threads: num_threads > 0 uses that many OpenMP threads, 0 uses
// OpenMP's default. Returns the path that ran (the one asked for, or the best for kAuto).
// Throws std::invalid_argument on bad arguments (named) or an unsupported forced path.
Isa adamw_step(const AdamWBuffers& buffers, const AdamWConfig& config, Isa isa = Isa::kAuto,
               int num_threads = 0);

// The scalar conversions every path uses, exposed for the tests. They reproduce
// torch's CPU `tensor.to(dtype)` bit for bit: round to nearest even, subnormals kept,
// fp32->bf16 NaN -> 0xFFFF (torch's vectorized cast), fp32->fp16 NaN keeps sign and the top
// payload bits with the quiet bit set (F16C's vcvtps2ph).
uint16_t float_to_bf16(float x);
uint16_t float_to_fp16(float x);
float bf16_to_float(uint16_t h);
float fp16_to_float(uint16_t h);

}  // namespace zk::cpu
