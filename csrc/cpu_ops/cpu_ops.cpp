// CPU copy / unscale / sum-of-squares: run-time path choice and OpenMP tiling.
#include "cpu_ops.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernel.h"
#include "parallel.h"
#include "simd/paths.h"

namespace zk::cpu {
namespace {

// [Note: when the list ops go parallel]
// One tensor (a cast, the unscale, a list of one) takes a second thread from two tiles, like
// torch's own copy_ and unscale, its peers, which are parallel there too: a 256K-element
// fp32->bf16 cast went from 19.6 to 13.1 us with two threads here (torch's copy_ 15.4). A list
// of several tensors (flatten, unflatten, bucket pack/unpack, sum of squares) takes one thread
// per kListParallelNumel elements in all, so a 256K list runs on the calling thread, as its
// peers (torch's foreach ops, torch.cat) do. On a quiet moment a second thread would save ~8
// us of a ~27 us 256K pack (27.0 -> 18.8 us, best decile of interleaved calls, 2-core Zen 4
// VM); but a parallel region waits for a descheduled thread for a whole scheduler slice when
// the cores are shared, and on this VM that happened to most calls in whole windows: the
// 2-thread bench's 256K medians were 7-13 ms for bucket_pack in 4 runs of 4, for sum_squares
// in 3 and unflatten in 2, against ~0.03 ms on one thread, while the serial peers never
// stalled. One thread there costs 30% of a call that is already 2-5x its peer; a stall costs
// 300x. From 512K up (a 512K pack: 48 -> 30 us) the second thread pays. Results never depend
// on the thread count (the copies are elementwise; the sum of squares has a fixed order,
// [Note: sum_squares order]).
constexpr int64_t kListParallelNumel = 1 << 18;

// The work items thread_count splits `total` elements of `count` tensors into: the list rule
// above for several tensors, else `single_items`.
int64_t work_items(int64_t total, int64_t count, int64_t single_items) {
  return count > 1 ? total / kListParallelNumel : single_items;
}

using CopyFn = void (*)(const CopySpec&, const void*, void*, int64_t, int64_t);

void copy_bytes(const CopySpec& s, const void* src, void* dst, int64_t begin, int64_t end) {
  const int64_t e = dtype_bytes(s.src);
  std::memcpy(static_cast<char*>(dst) + begin * e, static_cast<const char*>(src) + begin * e,
              static_cast<size_t>((end - begin) * e));
}

const detail::Path& path_of(Isa isa) { return paths(isa).ops; }

CopyFn copy_function(const CopySpec& s, Isa isa) {
  // a bit copy is libc's memcpy on the scalar path
  if (isa == Isa::kScalar && !s.scaled && s.src == s.dst) return copy_bytes;
  return path_of(isa).copy;
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
  isa = resolve_isa(isa);
  const CopyFn fn = copy_function(spec, isa);
  int64_t total = 0;
  for (int64_t i = 0; i < count; ++i) total += segments[i].numel;
  const int threads = thread_count(num_threads, work_items(total, count, total / kTileNumel));
  if (threads == 1) {
    for (int64_t i = 0; i < count; ++i) {
      fn(spec, segments[i].src, segments[i].dst, 0, segments[i].numel);
    }
    return isa;
  }
  const std::vector<Tile> work =
      tiles(count, kTileNumel, [&](int64_t i) { return segments[i].numel; });
  for_items(static_cast<int64_t>(work.size()), threads, [&](int64_t t) {
    const Segment& s = segments[work[t].item];
    fn(spec, s.src, s.dst, work[t].begin, work[t].end);
  });
  return isa;
}

bool unscale_and_check(void* x, DType dtype, int64_t numel, float inv_scale, Isa isa,
                       int num_threads, Isa* ran) {
  isa = resolve_isa(isa);
  if (ran) *ran = isa;
  const auto fn = path_of(isa).unscale;
  const int threads = thread_count(num_threads, numel / kTileNumel);
  std::atomic<bool> bad{false};
  for_ranges(numel, kTileNumel, threads, [&](int64_t b0, int64_t b1) {
    if (fn(x, dtype, b0, b1, inv_scale)) bad.store(true, std::memory_order_relaxed);
  });
  return bad.load(std::memory_order_relaxed);
}

double sum_squares(const Span* spans, int64_t count, Isa isa, int num_threads, Isa* ran) {
  isa = resolve_isa(isa);
  if (ran) *ran = isa;
  const auto fn = path_of(isa).sumsq;
  auto chunk = [&](const Tile& t) {
    const Span& s = spans[t.item];
    const char* base = static_cast<const char*>(s.data) + t.begin * dtype_bytes(s.dtype);
    return fn(base, s.dtype, t.end - t.begin);
  };
  const std::vector<Tile> work =
      tiles(count, detail::kSumChunk, [&](int64_t i) { return spans[i].numel; });
  const int64_t num_chunks = static_cast<int64_t>(work.size());
  int64_t numel = 0;
  for (int64_t i = 0; i < count; ++i) numel += spans[i].numel;
  const int threads = thread_count(num_threads, work_items(numel, count, num_chunks / 2));
  double total = 0.0;
  if (threads == 1) {
    for (const Tile& t : work) total += chunk(t);
    return total;
  }
  std::vector<double> partial(static_cast<size_t>(num_chunks));
  for_items(num_chunks, threads, [&](int64_t c) { partial[c] = chunk(work[c]); });
  for (double p : partial) total += p;  // (tensor, chunk) order, whatever the thread count
  return total;
}

}  // namespace zk::cpu
