// Instruction-set paths of the CPU kernels and their run-time detection: one library
// (zk_cpu_isa) that cpu_adam, cpu_ops and cpu_quant each link, so that none links another.
#pragma once

#include <cstdint>
#include <string>

namespace zk::cpu {

// Instruction-set path of a kernel. kAuto picks the best one the running CPU supports.
enum class Isa : int32_t { kAuto = -1, kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

const char* isa_name(Isa isa);
// "auto", "scalar", "avx2", "avx512"; throws std::invalid_argument naming the choices.
Isa parse_isa(const std::string& name);
// Whether this CPU (and OS) can run `isa`: avx2 needs AVX2+FMA+F16C, avx512 needs F+BW+VL+DQ.
bool isa_supported(Isa isa);
Isa best_isa();
// `isa` itself, or (kAuto) best_isa(); throws std::invalid_argument when a forced path is one
// this CPU cannot run. Every CPU op resolves its `isa` through it.
Isa resolve_isa(Isa isa);

}  // namespace zk::cpu
