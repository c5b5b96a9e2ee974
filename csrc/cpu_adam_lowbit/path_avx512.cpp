// The AVX-512 path of csrc/cpu_adam_lowbit: tile.h instantiated with the AVX-512 vector traits.
#include "kernel.h"

#if defined(__x86_64__)
#include "simd/avx512.h"
#include "tile.h"
#define ZK_PATH lowbit_range<simd::Avx512>
#else  // not x86-64: isa_supported() never reports this path, so it is never called
#define ZK_SIMD
#define ZK_PATH run_scalar_range
#endif

namespace zk::cpu::lowbit {
ZK_SIMD void run_avx512(const Kernel& k, int64_t b, int64_t e) { ZK_PATH(k, b, e); }
}  // namespace zk::cpu::lowbit
