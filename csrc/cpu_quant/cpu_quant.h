// Blockwise int8/int4 quantize, dequantize and the fused dequantize-and-sum of ZeRO++'s
// quantized collectives, natively (SIMD + OpenMP). Each reproduces zkernels/reference/quant.py
// bit for bit on every path and thread count: see [Note: blockwise quantization semantics]
// there for the arithmetic (per block: integer max of |x| bits, scale = amax / qmax,
// q = rint((x / amax) * qmax); out = round_to(dst, acc) with acc summed in chunk order).
#pragma once

#include <cstdint>

#include "dtype.h"
#include "simd/isa.h"  // Isa, resolve_isa

namespace zk::cpu {

// Block sizes the ops take: powers of two in [kMinQuantBlock, kMaxQuantBlock].
constexpr int64_t kMinQuantBlock = 2;
constexpr int64_t kMaxQuantBlock = 8192;

// True for 8 and 4.
inline bool quant_bits_ok(int bits) { return bits == 8 || bits == 4; }
inline bool quant_block_ok(int64_t b) {
  return b >= kMinQuantBlock && b <= kMaxQuantBlock && (b & (b - 1)) == 0;
}

struct QuantizeArgs {
  const void* x = nullptr;  // numel elements of `dtype`
  DType dtype = DType::kFloat32;
  int64_t numel = 0;
  int bits = 8;
  int64_t block = 256;
  void* q = nullptr;         // numel int8 codes, or ceil(numel / 2) int4 bytes
  float* scales = nullptr;   // ceil(numel / block)
};

// The dequantize (chunks == 1, sum false) and the dequantize-and-sum of `chunks` chunks,
// `q_row` bytes and `s_row` scales apart, into `out` (numel elements of `out_dtype`).
struct DequantizeArgs {
  const void* q = nullptr;
  int64_t q_row = 0;
  const float* scales = nullptr;
  int64_t s_row = 0;
  int64_t chunks = 1;
  int64_t numel = 0;
  int bits = 8;
  int64_t block = 256;
  void* out = nullptr;
  DType out_dtype = DType::kFloat32;
  bool sum = false;        // acc = +0 + chunk 0 + ... then acc * scale (+ out)
  float scale = 1.0f;
  bool accumulate = false;
};

// Threads: num_threads > 0 uses at most that many, 0 OpenMP's default. Return the path that
// ran; throw std::invalid_argument on bad bits / block size or an unsupported forced path.
Isa quantize(const QuantizeArgs& args, Isa isa = Isa::kAuto, int num_threads = 0);
Isa dequantize(const DequantizeArgs& args, Isa isa = Isa::kAuto, int num_threads = 0);

}  // namespace zk::cpu
