// Every element-wise optimizer of the CPU core behind one entry point: a kind (the name of its
// definition in zkernels/optimizers), its state buffers in the definition's order, and the
// per-step coefficients of the definition's coefficients(h, step), read by position.
//
// One pass over memory per step: read param, grad and the states; write param, the states and
// (optionally) the updated param cast to bf16/fp16. Each kind's per-element math is one tile
// body over the vector traits (csrc/optim/<kind>.h), and the same body is the scalar, AVX2 and
// AVX-512 path ([Note: one instantiation per ISA] in csrc/simd/path.cpp); built with
// -ffp-contract=off, every path performs the same IEEE operations in the same order, so all
// paths (and thread counts) give bit-identical results.
#pragma once

#include <cstdint>
#include <string>

#include "dtype.h"
#include "simd/isa.h"  // Isa and its detection

namespace zk::cpu {

constexpr int kMaxStates = 4;
constexpr int kMaxCoeffs = 16;

// What a kind takes: its state buffers' names (the definition's, in its order) and how many
// coefficients.
struct OptimizerKind {
  const char* name;
  int num_states;
  const char* const* state_names;
  int num_coeffs;
};

// The kinds, registered in csrc/optim/registry.h; `count` receives their number.
const OptimizerKind* optimizer_kinds(int* count);

// The flat buffers of one shard, all `numel` elements long and contiguous.
struct StepBuffers {
  float* param = nullptr;
  const void* grad = nullptr;
  DType grad_dtype = DType::kFloat32;
  float* states[kMaxStates] = {};  // the kind's states, in order; nullptr where absent
  int64_t numel = 0;
  const float* found_inf = nullptr;  // optional; when *found_inf != 0 the call changes nothing
  void* out = nullptr;               // optional copy of the updated param, in out_dtype
  DType out_dtype = DType::kFloat32;
};

// One step of optimizer `kind` in place. `coeffs`: `num_coeffs` doubles, each rounded to fp32
// once; the gradient is multiplied by fp32(1 / grad_scale) (exact for the power-of-two scales
// GradScaler uses). Threads: num_threads > 0 uses that many OpenMP threads, 0 OpenMP's default.
// Returns the path that ran (the one asked for, or the best for kAuto). Throws
// std::invalid_argument, naming it, on an unknown kind, a wrong number of coefficients, a
// missing state buffer, a coefficient out of its range, a bad grad_scale or num_threads, or an
// unsupported forced path.
Isa optimizer_step(const std::string& kind, const StepBuffers& buffers, const double* coeffs,
                   int num_coeffs, double grad_scale = 1.0, Isa isa = Isa::kAuto,
                   int num_threads = 0);

}  // namespace zk::cpu
