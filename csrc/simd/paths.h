// The instruction-set paths of the CPU core as tables of function pointers, one table per ISA,
// each filled by one instantiation of csrc/simd/path.cpp ([Note: one instantiation per ISA]
// there). An op picks its path with paths(resolve_isa(isa)).
#pragma once

#include <cstdint>

#include "cpu_adam/kernel.h"
#include "cpu_adam_lowbit/kernel.h"
#include "cpu_ops/kernel.h"
#include "cpu_quant/kernel.h"
#include "optim/kernel.h"
#include "simd/isa.h"

namespace zk::cpu {

struct Paths {
  const optim::RangeFn* optim;  // csrc/optim: one per kind, in ZK_OPTIMIZERS order
  void (*adam)(const detail::Kernel&, int64_t begin, int64_t end);         // csrc/cpu_adam
  void (*adam_lowbit)(const lowbit::Kernel&, int64_t begin, int64_t end);  // cpu_adam_lowbit
  detail::Path ops;                                                         // csrc/cpu_ops
  void (*quantize)(const QuantizeArgs&, int64_t b0, int64_t b1);           // csrc/cpu_quant
  void (*dequantize)(const DequantizeArgs&, int64_t b0, int64_t b1);
};

extern const Paths kScalarPaths;
extern const Paths kAvx2Paths;
extern const Paths kAvx512Paths;

inline const Paths& paths(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return kAvx512Paths;
    case Isa::kAvx2: return kAvx2Paths;
    default: return kScalarPaths;
  }
}

}  // namespace zk::cpu
