// CPU data-movement and reduction ops of zkernels.ops, natively (SIMD + OpenMP): the
// copy-scale-cast behind flatten, unflatten, bucket_pack, bucket_unpack and cast; the fused
// unscale + non-finite check; the multi-tensor sum of squares.
//
// Each reproduces zkernels/reference (and the Triton kernels' CPU semantics, see
// [Note: exact rounding in kernels] in zkernels/kernels/_rounding.py) bit for bit, on every
// path: the copies round once per element exactly like Tensor.to; the sum of squares uses one
// fixed summation order on every path and thread count (see [Note: sum_squares order]).
#pragma once

#include <cstdint>

#include "dtype.h"
#include "simd/isa.h"  // Isa, resolve_isa

namespace zk::cpu {

// How each element is converted: y = round_to_dst(float(x) * scale) when `scaled`, else
// round_to_dst(float(x)) (same dtypes: a byte copy). A bf16 destination's NaN becomes
// `bf16_nan`: 0xFFFF (torch's vectorized fp32->bf16 cast) except for the plain fp16->bf16
// cast, where torch's scalar path writes 0x7FC0.
struct CopySpec {
  DType src = DType::kFloat32;
  DType dst = DType::kFloat32;
  bool scaled = false;
  float scale = 1.0f;
  uint16_t bf16_nan = 0xFFFF;
};

// One contiguous run of `numel` elements from `src` (spec.src dtype) to `dst` (spec.dst).
struct Segment {
  const void* src = nullptr;
  void* dst = nullptr;
  int64_t numel = 0;
};

// Copies every segment. Threads: num_threads > 0 uses at most that many, 0 OpenMP's default.
// Returns the path that ran; throws std::invalid_argument on an unsupported forced path.
Isa copy_segments(const Segment* segments, int64_t count, const CopySpec& spec,
                  Isa isa = Isa::kAuto, int num_threads = 0);

// In place x = round_to(x.dtype, float(x) * inv_scale); returns whether any input element was
// inf or NaN (checked before the multiply).
bool unscale_and_check(void* x, DType dtype, int64_t numel, float inv_scale,
                       Isa isa = Isa::kAuto, int num_threads = 0, Isa* ran = nullptr);

// A contiguous tensor read by sum_squares.
struct Span {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  int64_t numel = 0;
};

// Sum of x*x over every element of every span, in fp64 (every fp32 square is exact there),
// in the fixed order of [Note: sum_squares order]; the caller rounds it to fp32.
double sum_squares(const Span* spans, int64_t count, Isa isa = Isa::kAuto, int num_threads = 0,
                   Isa* ran = nullptr);

}  // namespace zk::cpu
