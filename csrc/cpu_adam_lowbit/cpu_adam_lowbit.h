// CPU AdamW over low-bit moments: bf16 moments, or blockwise int8 codes with fp32 block scales
// (the formats of [Note: low-bit moment formats] in zkernels/reference/adamw_lowbit.py).
//
// One pass over memory per step: read param (fp32 or bf16), grad and both moments (bf16, or
// int8 / uint8 codes and their scales); dequantize, run the AdamW update in fp32, requantize
// (per block, staged in L1) and write param, moments, scales and (optionally) the updated
// param cast to bf16/fp16. The arithmetic is the reference's, operation for operation, with
// the fusions torch's CPU kernels make, so every path (scalar, AVX2, AVX-512) and thread count
// gives the same bits, the reference's ([Note: lowbit arithmetic is torch's] in kernel.h).
#pragma once

#include <cstdint>

#include "cpu_adam/cpu_adam.h"  // AdamWConfig
#include "dtype.h"
#include "simd/isa.h"

namespace zk::cpu {

enum class MomentFormat : int32_t { kBf16 = 0, kInt8 = 1 };

// The flat buffers of one shard, `numel` elements long (scales: one per block), contiguous.
struct LowbitBuffers {
  void* param = nullptr;                // fp32 or bf16 (param_dtype)
  DType param_dtype = DType::kFloat32;
  const void* grad = nullptr;           // fp32, bf16 or fp16
  DType grad_dtype = DType::kFloat32;
  MomentFormat format = MomentFormat::kInt8;
  void* exp_avg = nullptr;              // bf16 bits, or int8 codes
  void* exp_avg_sq = nullptr;           // bf16 bits, or uint8 codes of sqrt(v)
  float* exp_avg_scales = nullptr;      // int8 format: ceil(numel / block_size) each
  float* exp_avg_sq_scales = nullptr;
  int64_t block_size = 256;             // int8 format: a power of two in [2, 8192]
  int64_t numel = 0;
  const float* found_inf = nullptr;  // optional; when *found_inf != 0 the call changes nothing
  void* out = nullptr;               // optional copy of the updated param, in out_dtype
  DType out_dtype = DType::kFloat32;
};

// One step in place; `config` as for adamw_step (grad_scale 1 means no unscale). Threads:
// num_threads > 0 uses that many OpenMP threads (over whole blocks), 0 OpenMP's default.
// Returns the path that ran. Throws std::invalid_argument on bad arguments (named) or an
// unsupported forced path.
Isa adamw_step_lowbit(const LowbitBuffers& buffers, const AdamWConfig& config,
                      Isa isa = Isa::kAuto, int num_threads = 0);

}  // namespace zk::cpu
