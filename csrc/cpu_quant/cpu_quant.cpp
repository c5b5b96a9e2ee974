// CPU blockwise quantize / dequantize / dequantize-and-sum: argument checks, run-time path
// choice and OpenMP tiling over whole blocks.
#include "cpu_quant.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernel.h"
#include "parallel.h"
#include "simd/paths.h"

namespace zk::cpu {
namespace {

// Work items of kTileNumel elements (parallel.h), as csrc/cpu_ops: one tensor takes a second
// thread from two of them ([Note: when the list ops go parallel] in csrc/cpu_ops/cpu_ops.cpp).
// A dequantize-and-sum counts every chunk's elements. Results never depend on the thread
// count: blocks are independent and each element's sum runs in chunk order.

void check(int bits, int64_t block, int64_t numel) {
  if (!quant_bits_ok(bits)) {
    throw std::invalid_argument("bits must be 8 or 4, got " + std::to_string(bits));
  }
  if (!quant_block_ok(block)) {
    throw std::invalid_argument("block_size must be a power of two in [" +
                                std::to_string(kMinQuantBlock) + ", " +
                                std::to_string(kMaxQuantBlock) + "], got " +
                                std::to_string(block));
  }
  if (numel < 0) throw std::invalid_argument("numel must be >= 0");
}

// Runs fn(b0, b1) over all `num_blocks` blocks through the tile driver, in work items of
// about kTileNumel elements (times `weight`: the chunks a dequantize-and-sum reads per element).
template <typename Fn>
void over_blocks(int64_t num_blocks, int64_t block, int64_t numel, int64_t weight,
                 int num_threads, Fn fn) {
  const int64_t per_item = std::max<int64_t>(1, kTileNumel / block);
  const int64_t items = (num_blocks + per_item - 1) / per_item;
  const int threads = thread_count(num_threads, std::min(items, numel * weight / kTileNumel));
  for_ranges(num_blocks, per_item, threads, fn);
}

}  // namespace

Isa quantize(const QuantizeArgs& a, Isa isa, int num_threads) {
  check(a.bits, a.block, a.numel);
  isa = resolve_isa(isa);
  const auto fn = paths(isa).quantize;
  const int64_t nb = (a.numel + a.block - 1) / a.block;
  over_blocks(nb, a.block, a.numel, 1, num_threads,
              [&](int64_t b0, int64_t b1) { fn(a, b0, b1); });
  return isa;
}

Isa dequantize(const DequantizeArgs& a, Isa isa, int num_threads) {
  check(a.bits, a.block, a.numel);
  if (a.chunks < 1 || (!a.sum && a.chunks != 1)) {
    throw std::invalid_argument("chunks must be >= 1 (1 without sum), got " +
                                std::to_string(a.chunks));
  }
  isa = resolve_isa(isa);
  const auto fn = paths(isa).dequantize;
  const int64_t nb = (a.numel + a.block - 1) / a.block;
  over_blocks(nb, a.block, a.numel, a.chunks, num_threads,
              [&](int64_t b0, int64_t b1) { fn(a, b0, b1); });
  return isa;
}

}  // namespace zk::cpu
