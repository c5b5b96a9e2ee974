// Run-time detection of the SIMD paths (csrc/simd/isa.h).
#include "simd/isa.h"

#include <stdexcept>

namespace zk::cpu {

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAuto: return "auto";
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
  }
  return "unknown";
}

Isa parse_isa(const std::string& name) {
  for (Isa isa : {Isa::kAuto, Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (name == isa_name(isa)) return isa;
  }
  throw std::invalid_argument("isa must be one of auto, scalar, avx2, avx512; got '" + name +
                              "'");
}

bool isa_supported(Isa isa) {
#if !defined(__x86_64__)
  return isa == Isa::kAuto || isa == Isa::kScalar;  // the SIMD paths are x86-64 only
#else
  __builtin_cpu_init();
  switch (isa) {
    case Isa::kAuto:
    case Isa::kScalar: return true;
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case Isa::kAvx512:
      return isa_supported(Isa::kAvx2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512dq");
  }
  return false;
#endif
}

Isa best_isa() {
  if (isa_supported(Isa::kAvx512)) return Isa::kAvx512;
  if (isa_supported(Isa::kAvx2)) return Isa::kAvx2;
  return Isa::kScalar;
}

Isa resolve_isa(Isa isa) {
  if (isa == Isa::kAuto) isa = best_isa();
  if (!isa_supported(isa)) {
    throw std::invalid_argument(std::string("isa '") + isa_name(isa) +
                                "' was forced but this CPU does not support it");
  }
  return isa;
}

}  // namespace zk::cpu
