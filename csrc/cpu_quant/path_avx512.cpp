// The AVX-512 path of csrc/cpu_quant: kernel.h's block skeletons with tile.h's element
// operations instantiated for the AVX-512 vector traits.
#include "kernel.h"

#if defined(__x86_64__)
#include "simd/avx512.h"
#include "tile.h"
#define ZK_PATH Vec<simd::Avx512>
#else  // not x86-64: isa_supported() never reports this path, so it is never called
#define ZK_SIMD
#define ZK_PATH Scalar
#endif

namespace zk::cpu::quant {
ZK_SIMD void quantize_avx512(const QuantizeArgs& a, int64_t b0, int64_t b1) {
  quantize_blocks<ZK_PATH>(a, b0, b1);
}
ZK_SIMD void dequantize_avx512(const DequantizeArgs& a, int64_t b0, int64_t b1) {
  dequantize_blocks<ZK_PATH>(a, b0, b1);
}
}  // namespace zk::cpu::quant
