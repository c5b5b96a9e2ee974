// The AVX2 path of csrc/cpu_ops: tile.h instantiated with the AVX2 vector traits.
#include "kernel.h"

#if defined(__x86_64__)
#include "simd/avx2.h"
#include "tile.h"
#define ZK_PATH(fn) fn<simd::Avx2>
#else  // not x86-64: isa_supported() never reports this path, so it is never called
#define ZK_SIMD
#define ZK_PATH(fn) fn##_scalar
#endif

namespace zk::cpu::detail {
ZK_SIMD void copy_range_avx2(const CopySpec& s, const void* src, void* dst, int64_t b,
                             int64_t e) {
  ZK_PATH(copy_range)(s, src, dst, b, e);
}
ZK_SIMD bool unscale_range_avx2(void* x, DType dt, int64_t b, int64_t e, float inv) {
  return ZK_PATH(unscale_range)(x, dt, b, e, inv);
}
ZK_SIMD double sumsq_chunk_avx2(const void* data, DType dt, int64_t n) {
  return ZK_PATH(sumsq_chunk)(data, dt, n);
}
}  // namespace zk::cpu::detail
