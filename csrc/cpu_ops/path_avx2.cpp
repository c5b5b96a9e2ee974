// The AVX2 path of csrc/cpu_ops: tile.h instantiated with the AVX2 vector traits.
#include "kernel.h"

#if defined(__x86_64__)
#include "simd/avx2.h"
#include "tile.h"

namespace zk::cpu::detail {
const Path kAvx2Path = {copy_range<simd::Avx2>, unscale_range<simd::Avx2>,
                        sumsq_chunk<simd::Avx2>};
}  // namespace zk::cpu::detail

#else  // not x86-64: isa_supported() never reports this path, so it is never called
namespace zk::cpu::detail {
const Path kAvx2Path = kScalarPath;
}  // namespace zk::cpu::detail
#endif
