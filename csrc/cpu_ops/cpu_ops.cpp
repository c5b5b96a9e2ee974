// CPU copy / unscale / sum-of-squares: run-time path choice, the scalar path and OpenMP tiling.
#include "cpu_ops.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernel.h"

namespace zk::cpu {
namespace {

// Elements per OpenMP work item (64 KiB of fp32): below two of them a call stays on the
// calling thread, where waking the pool would cost more than the copy.
constexpr int64_t kTileNumel = 16384;

Isa resolve(Isa isa) {
  if (isa == Isa::kAuto) isa = best_isa();
  if (!isa_supported(isa)) {
    throw std::invalid_argument(std::string("isa '") + isa_name(isa) +
                                "' was forced but this CPU does not support it");
  }
  return isa;
}

int thread_count(int num_threads, int64_t work_items) {
  if (num_threads < 0) {
    throw std::invalid_argument("num_threads must be >= 0, got " + std::to_string(num_threads));
  }
  const int64_t wanted = num_threads > 0 ? num_threads : omp_get_max_threads();
  return static_cast<int>(std::max<int64_t>(1, std::min(wanted, work_items)));
}

using CopyFn = void (*)(const CopySpec&, const void*, void*, int64_t, int64_t);

void copy_bytes(const CopySpec& s, const void* src, void* dst, int64_t begin, int64_t end) {
  const int64_t e = dtype_bytes(s.src);
  std::memcpy(static_cast<char*>(dst) + begin * e, static_cast<const char*>(src) + begin * e,
              static_cast<size_t>((end - begin) * e));
}

CopyFn copy_function(const CopySpec& s, Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return detail::copy_range_avx512;
    case Isa::kAvx2: return detail::copy_range_avx2;
    default:  // a bit copy is libc's memcpy on the scalar path
      return !s.scaled && s.src == s.dst ? copy_bytes : detail::copy_range_scalar;
  }
}

struct Tile {
  int64_t item;  // segment / span index
  int64_t begin;
  int64_t end;
};

// Cuts items of the given sizes into tiles of at most `tile` elements, in order.
template <typename SizeOf>
std::vector<Tile> tiles(int64_t count, int64_t tile, SizeOf size_of) {
  std::vector<Tile> out;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = size_of(i);
    for (int64_t b = 0; b < n; b += tile) out.push_back({i, b, std::min(n, b + tile)});
  }
  return out;
}

}  // namespace

Isa copy_segments(const Segment* segments, int64_t count, const CopySpec& spec, Isa isa,
                  int num_threads) {
  isa = resolve(isa);
  const CopyFn fn = copy_function(spec, isa);
  int64_t total = 0;
  for (int64_t i = 0; i < count; ++i) total += segments[i].numel;
  const int threads = thread_count(num_threads, total / kTileNumel);
  if (threads == 1) {
    for (int64_t i = 0; i < count; ++i) {
      fn(spec, segments[i].src, segments[i].dst, 0, segments[i].numel);
    }
    return isa;
  }
  const std::vector<Tile> work =
      tiles(count, kTileNumel, [&](int64_t i) { return segments[i].numel; });
  const int64_t num_tiles = static_cast<int64_t>(work.size());
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < num_tiles; ++t) {
    const Segment& s = segments[work[t].item];
    fn(spec, s.src, s.dst, work[t].begin, work[t].end);
  }
  return isa;
}

bool unscale_and_check(void* x, DType dtype, int64_t numel, float inv_scale, Isa isa,
                       int num_threads, Isa* ran) {
  isa = resolve(isa);
  if (ran) *ran = isa;
  using Fn = bool (*)(void*, DType, int64_t, int64_t, float);
  const Fn fn = isa == Isa::kAvx512 ? detail::unscale_range_avx512
                : isa == Isa::kAvx2 ? detail::unscale_range_avx2
                                    : detail::unscale_range_scalar;
  const int64_t num_tiles = (numel + kTileNumel - 1) / kTileNumel;
  const int threads = thread_count(num_threads, numel / kTileNumel);
  if (threads == 1) return fn(x, dtype, 0, numel, inv_scale);
  int bad = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(| : bad)
  for (int64_t t = 0; t < num_tiles; ++t) {
    bad |= fn(x, dtype, t * kTileNumel, std::min(numel, (t + 1) * kTileNumel), inv_scale) ? 1 : 0;
  }
  return bad != 0;
}

double sum_squares(const Span* spans, int64_t count, Isa isa, int num_threads, Isa* ran) {
  isa = resolve(isa);
  if (ran) *ran = isa;
  using Fn = double (*)(const void*, DType, int64_t);
  const Fn fn = isa == Isa::kAvx512 ? detail::sumsq_chunk_avx512
                : isa == Isa::kAvx2 ? detail::sumsq_chunk_avx2
                                    : detail::sumsq_chunk_scalar;
  auto chunk = [&](const Tile& t) {
    const Span& s = spans[t.item];
    const char* base = static_cast<const char*>(s.data) + t.begin * dtype_bytes(s.dtype);
    return fn(base, s.dtype, t.end - t.begin);
  };
  const std::vector<Tile> work =
      tiles(count, detail::kSumChunk, [&](int64_t i) { return spans[i].numel; });
  const int64_t num_chunks = static_cast<int64_t>(work.size());
  const int threads = thread_count(num_threads, num_chunks / 2);
  double total = 0.0;
  if (threads == 1) {
    for (const Tile& t : work) total += chunk(t);
    return total;
  }
  std::vector<double> partial(static_cast<size_t>(num_chunks));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t c = 0; c < num_chunks; ++c) partial[c] = chunk(work[c]);
  for (double p : partial) total += p;  // (tensor, chunk) order, whatever the thread count
  return total;
}

}  // namespace zk::cpu
