// The AVX-512 path of csrc/cpu_ops: tile.h instantiated with the AVX-512 vector traits.
#include "kernel.h"

#if defined(__x86_64__)
#include "simd/avx512.h"
#include "tile.h"

namespace zk::cpu::detail {
const Path kAvx512Path = {copy_range<simd::Avx512>, unscale_range<simd::Avx512>,
                          sumsq_chunk<simd::Avx512>};
}  // namespace zk::cpu::detail

#else  // not x86-64: isa_supported() never reports this path, so it is never called
namespace zk::cpu::detail {
const Path kAvx512Path = kScalarPath;
}  // namespace zk::cpu::detail
#endif
