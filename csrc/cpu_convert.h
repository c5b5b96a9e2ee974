// Scalar fp32 <-> bf16/fp16 conversions shared by every CPU kernel (csrc/cpu_adam, csrc/cpu_ops).
// They reproduce torch's CPU `tensor.to(dtype)` bit for bit: round to nearest even,
// subnormals kept; NaN patterns as documented on each function.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace zk::cpu::detail {

inline uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

inline float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// `nan`: the pattern a NaN becomes (torch's vectorized fp32->bf16 cast writes 0xFFFF; its
// scalar fp16->bf16 cast 0x7FC0).
inline uint16_t to_bf16(float x, uint16_t nan = 0xFFFF) {
  uint32_t u = bits_of(x);
  if (std::isnan(x)) return nan;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float from_bf16(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

// IEEE binary16, round to nearest even, as vcvtps2ph does it (NaN: quiet, payload kept).
inline uint16_t to_fp16(float x) {
  const uint32_t u = bits_of(x);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 -> inf
  if (a < 0x38800000u) {                                               // fp16 subnormal range
    if (a <= 0x33000000u) return static_cast<uint16_t>(sign);          // <= 2^-25 -> 0 (tie)
    const uint32_t e = a >> 23;
    const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126u - e;  // value * 2^24 = m * 2^(e - 126)
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  const uint32_t v = a - 0x38000000u;  // rebias the exponent from 127 to 15
  return static_cast<uint16_t>(sign | ((v + 0xFFFu + ((v >> 13) & 1u)) >> 13));
}

inline float from_fp16(uint16_t h) {
  const uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  const uint32_t m = h & 0x3FFu;
  if (e == 0x1Fu) {  // inf, or NaN made quiet as vcvtph2ps does
    return float_of(sign | 0x7F800000u | (m << 13) | (m != 0 ? 0x400000u : 0u));
  }
  if (e != 0) return float_of(sign | ((e + 112u) << 23) | (m << 13));
  // zero or subnormal: m * 2^-24, exact in fp32
  const float mag = static_cast<float>(m) * 5.9604644775390625e-8f;
  return float_of(sign | bits_of(mag));
}

}  // namespace zk::cpu::detail
