// Internal to csrc/optim: what a tile function of any kind receives.
#pragma once

#include <cstdint>

#include "optim/optimizer.h"

namespace zk::cpu::optim {

// Everything a tile function needs; a tile updates elements [begin, end) of the full buffers.
struct Kernel {
  float c[kMaxCoeffs];    // the coefficients, each rounded to fp32 once
  double cd[kMaxCoeffs];  // the same in double (flags and branches are decided on these)
  float inv_scale;        // fp32(1 / grad_scale)
  float* param;
  const void* grad;
  DType grad_dtype;
  float* states[kMaxStates];
  void* out;  // nullptr: no copy
  DType out_dtype;
};

using RangeFn = void (*)(const Kernel&, int64_t, int64_t);

}  // namespace zk::cpu::optim
