// Element types the native core moves and computes on. Plain enum: the core never sees a
// torch dtype (the bindings in python/src translate at the boundary).
#pragma once

#include <cstdint>

namespace zk {

enum class DType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

inline const char* dtype_name(DType d) {
  switch (d) {
    case DType::kFloat32: return "float32";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
  }
  return "unknown";
}

inline int64_t dtype_bytes(DType d) { return d == DType::kFloat32 ? 4 : 2; }

}  // namespace zk
