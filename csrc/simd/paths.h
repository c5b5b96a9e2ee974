// The instruction-set paths of the CPU core as tables of function pointers, one table per ISA,
// each filled by one instantiation of csrc/simd/path.cpp ([Note: one instantiation per ISA]
// there). An op picks its path with paths(resolve_isa(isa)).
#pragma once

#include "optim/kernel.h"
#include "simd/isa.h"

namespace zk::cpu {

struct Paths {
  const optim::RangeFn* optim;  // csrc/optim: one per kind, in ZK_OPTIMIZERS order
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
