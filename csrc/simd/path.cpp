// One ISA's path of the whole CPU core: every tile body instantiated with that ISA's vector
// traits, gathered in its table of simd/paths.h.
//
// [Note: one instantiation per ISA]
// Each tile body is written once, as a template over the vector traits V (simd/scalar.h,
// avx2.h, avx512.h), and this one file instantiates all of them: CMake compiles it once per
// ISA with ZK_PATH_ISA = 0 (scalar), 1 (AVX2) or 2 (AVX-512), which picks the traits and the
// table the object defines (kScalarPaths, kAvx2Paths, kAvx512Paths). The traits carry their
// ISA's target attribute (ZK_SIMD) on every function, so the objects are built with the
// library's baseline flags and only run where isa_supported() says so. A new kernel family or
// optimizer kind is an entry of the table here, never a new file per ISA. The optimizer
// bodies (csrc/optim) are their own scalar path (simd::Scalar); the older families keep a
// scalar path of their own, written in their kernel.h, which the scalar table takes. Off
// x86-64 the SIMD tables are the scalar ones (isa_supported() never reports them there).
#if !defined(ZK_PATH_ISA)
#error "compile with -DZK_PATH_ISA=0 (scalar), 1 (avx2) or 2 (avx512)"
#endif

#if ZK_PATH_ISA != 0 && defined(__x86_64__)
#define ZK_VECTOR_PATH 1
#if ZK_PATH_ISA == 2
#include "simd/avx512.h"
#define ZK_TRAITS simd::Avx512
#else
#include "simd/avx2.h"
#define ZK_TRAITS simd::Avx2
#endif
#include "cpu_adam/tile.h"
#include "cpu_adam_lowbit/tile.h"
#include "cpu_ops/tile.h"
#include "cpu_quant/tile.h"
#else
#define ZK_VECTOR_PATH 0
#include "simd/scalar.h"
#define ZK_TRAITS simd::Scalar
#endif

#if ZK_PATH_ISA == 2
#define ZK_TABLE kAvx512Paths
#elif ZK_PATH_ISA == 1
#define ZK_TABLE kAvx2Paths
#else
#define ZK_TABLE kScalarPaths
#endif

#include "optim/registry.h"
#include "simd/paths.h"

namespace zk::cpu {
namespace {

using V = ZK_TRAITS;

#define ZK_RANGE(K) &optim::step_range<optim::K, V>,
constexpr optim::RangeFn kOptim[] = {ZK_OPTIMIZERS(ZK_RANGE)};
#undef ZK_RANGE

#if ZK_VECTOR_PATH
using QuantOps = quant::Vec<V>;
ZK_SIMD void adam(const detail::Kernel& k, int64_t b, int64_t e) { detail::adam_range<V>(k, b, e); }
ZK_SIMD void adam_lowbit(const lowbit::Kernel& k, int64_t b, int64_t e) {
  lowbit::lowbit_range<V>(k, b, e);
}
constexpr detail::Path kOps = {detail::copy_range<V>, detail::unscale_range<V>,
                               detail::sumsq_chunk<V>};
#else
using QuantOps = quant::Scalar;
constexpr auto adam = detail::run_scalar_range;
constexpr auto adam_lowbit = lowbit::run_scalar_range;
constexpr detail::Path kOps = detail::kScalarPath;
#endif

ZK_SIMD void quantize(const QuantizeArgs& a, int64_t b0, int64_t b1) {
  quant::quantize_blocks<QuantOps>(a, b0, b1);
}
ZK_SIMD void dequantize(const DequantizeArgs& a, int64_t b0, int64_t b1) {
  quant::dequantize_blocks<QuantOps>(a, b0, b1);
}

}  // namespace

extern const Paths ZK_TABLE = {kOptim, adam, adam_lowbit, kOps, quantize, dequantize};

}  // namespace zk::cpu
