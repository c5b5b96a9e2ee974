// Internal to csrc/cpu_quant: the per-block skeleton every path shares, the scalar element
// operations, and the per-path block-range functions.
//
// A path is a struct of static element operations over one block's run of n elements (n <=
// the block size): `top` (max of |x| bits), `codes` (rint((x / amax) * qmax) to int8),
// `widen` (bf16/fp16 -> fp32), `dequant` (acc = q * s, or acc + q * s), `finish` (acc * scale,
// + out, rounded into out). The skeletons below stage a block in fp32 / int8 buffers on the
// stack (L1-resident; int4 is packed and unpacked there), so the paths only ever see int8
// codes and fp32 values. Each path's operations round exactly as the scalar ones do (IEEE
// division and products, round half to even, no contraction: -ffp-contract=off), so every
// path writes the same bits.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_convert.h"
#include "cpu_quant.h"

namespace zk::cpu::quant {

using detail::bits_of;
using detail::float_of;

constexpr uint32_t kInfBits = 0x7F800000u;
constexpr uint32_t kNanBits = 0x7FC00000u;

inline float qmax_of(int bits) { return bits == 8 ? 127.0f : 7.0f; }

// A block's scale from its top |x| bits; `ok` (finite nonzero amax) says whether its codes
// are computed (else all 0); `amax` is then the divisor.
struct BlockScale {
  float scale;
  float amax;
  bool ok;
};

inline BlockScale block_scale(uint32_t top, float qmax) {
  if (top > kInfBits) return {float_of(kNanBits), 1.0f, false};
  if (top == kInfBits) return {float_of(kInfBits), 1.0f, false};
  if (top == 0) return {0.0f, 1.0f, false};
  const float amax = float_of(top);
  return {amax / qmax, amax, true};
}

inline int8_t code_of(float x, float amax, float qmax) {
  return static_cast<int8_t>(static_cast<int32_t>(std::rint((x / amax) * qmax)));
}

inline int8_t nibble(uint32_t v) {
  v &= 0xFu;
  return static_cast<int8_t>(static_cast<int32_t>(v) - static_cast<int32_t>((v & 8u) << 1));
}

inline float load_as_float(const void* p, DType dt, int64_t i) {
  switch (dt) {
    case DType::kBFloat16: return detail::from_bf16(static_cast<const uint16_t*>(p)[i]);
    case DType::kFloat16: return detail::from_fp16(static_cast<const uint16_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

inline void store_rounded(void* p, DType dt, int64_t i, float x) {
  switch (dt) {
    case DType::kBFloat16: static_cast<uint16_t*>(p)[i] = detail::to_bf16(x, 0xFFFF); break;
    case DType::kFloat16: static_cast<uint16_t*>(p)[i] = detail::to_fp16(x); break;
    default: static_cast<float*>(p)[i] = x; break;
  }
}

// The scalar element operations (the scalar path; tile.h has their vector twins).
struct Scalar {
  static uint32_t top(const float* x, int64_t n) {
    uint32_t m = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t a = bits_of(x[i]) & 0x7FFFFFFFu;
      m = a > m ? a : m;
    }
    return m;
  }
  static void codes(const float* x, int64_t n, float amax, float qmax, int8_t* out) {
    for (int64_t i = 0; i < n; ++i) out[i] = code_of(x[i], amax, qmax);
  }
  static void widen(const void* src, DType dt, int64_t n, float* dst) {
    for (int64_t i = 0; i < n; ++i) dst[i] = load_as_float(src, dt, i);
  }
  static void dequant(const int8_t* c, int64_t n, float s, float* acc, bool add) {
    if (add) {
      for (int64_t i = 0; i < n; ++i) acc[i] = acc[i] + static_cast<float>(c[i]) * s;
    } else {
      for (int64_t i = 0; i < n; ++i) acc[i] = static_cast<float>(c[i]) * s;
    }
  }
  // acc[i] (times scale when `scaled`, plus out[i] when `accumulate`) rounded into out[i].
  static void finish(float* acc, int64_t n, bool scaled, float scale, bool accumulate,
                     void* out, DType dt) {
    for (int64_t i = 0; i < n; ++i) {
      float v = acc[i];
      if (scaled) v = v * scale;
      if (accumulate) v = load_as_float(out, dt, i) + v;
      store_rounded(out, dt, i, v);
    }
  }
};

// Blocks [b0, b1) of a quantize, with path P's element operations.
template <typename P>
__attribute__((always_inline)) inline void quantize_blocks(const QuantizeArgs& a, int64_t b0,
                                                           int64_t b1) {
  alignas(64) float staged[kMaxQuantBlock];
  alignas(64) int8_t codes[kMaxQuantBlock + 2];
  const float qmax = qmax_of(a.bits);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * a.block;
    const int64_t n = a.numel - start < a.block ? a.numel - start : a.block;
    const float* x;
    if (a.dtype == DType::kFloat32) {
      x = static_cast<const float*>(a.x) + start;
    } else {
      P::widen(static_cast<const uint16_t*>(a.x) + start, a.dtype, n, staged);
      x = staged;
    }
    const BlockScale s = block_scale(P::top(x, n), qmax);
    a.scales[b] = s.scale;
    int8_t* dst = a.bits == 8 ? static_cast<int8_t*>(a.q) + start : codes;
    if (s.ok) {
      P::codes(x, n, s.amax, qmax, dst);
    } else {
      std::memset(dst, 0, static_cast<size_t>(n));
    }
    if (a.bits == 4) {
      codes[n] = 0;  // an odd last element's high nibble
      uint8_t* q = static_cast<uint8_t*>(a.q) + start / 2;
      for (int64_t j = 0; j < (n + 1) / 2; ++j) {
        q[j] = static_cast<uint8_t>((codes[2 * j] & 0xF) | ((codes[2 * j + 1] & 0xF) << 4));
      }
    }
  }
}

// Blocks [b0, b1) of a dequantize / dequantize-and-sum, with path P's element operations.
template <typename P>
__attribute__((always_inline)) inline void dequantize_blocks(const DequantizeArgs& a,
                                                             int64_t b0, int64_t b1) {
  alignas(64) float acc[kMaxQuantBlock];
  alignas(64) int8_t codes[kMaxQuantBlock + 2];
  const int64_t out_bytes = dtype_bytes(a.out_dtype);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * a.block;
    const int64_t n = a.numel - start < a.block ? a.numel - start : a.block;
    if (a.sum) std::memset(acc, 0, static_cast<size_t>(n) * sizeof(float));  // acc = +0
    for (int64_t r = 0; r < a.chunks; ++r) {
      const char* row = static_cast<const char*>(a.q) + r * a.q_row;
      const int8_t* c;
      if (a.bits == 8) {
        c = reinterpret_cast<const int8_t*>(row) + start;
      } else {
        const uint8_t* q = reinterpret_cast<const uint8_t*>(row) + start / 2;
        for (int64_t j = 0; j < (n + 1) / 2; ++j) {
          codes[2 * j] = nibble(q[j]);
          codes[2 * j + 1] = nibble(static_cast<uint32_t>(q[j]) >> 4);
        }
        c = codes;
      }
      P::dequant(c, n, a.scales[r * a.s_row + b], acc, a.sum);
    }
    P::finish(acc, n, a.sum, a.scale, a.sum && a.accumulate,
              static_cast<char*>(a.out) + start * out_bytes, a.out_dtype);
  }
}

}  // namespace zk::cpu::quant
