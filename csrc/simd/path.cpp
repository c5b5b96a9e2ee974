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
// optimizer kind is an entry of the table here, never a new file per ISA; off x86-64 the SIMD
// tables are the scalar instantiation (isa_supported() never reports them there).
#if !defined(ZK_PATH_ISA)
#error "compile with -DZK_PATH_ISA=0 (scalar), 1 (avx2) or 2 (avx512)"
#endif

#if ZK_PATH_ISA == 2 && defined(__x86_64__)
#include "simd/avx512.h"
#define ZK_TRAITS simd::Avx512
#elif ZK_PATH_ISA == 1 && defined(__x86_64__)
#include "simd/avx2.h"
#define ZK_TRAITS simd::Avx2
#else
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

}  // namespace

extern const Paths ZK_TABLE = {kOptim};

}  // namespace zk::cpu
