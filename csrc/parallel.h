// The one OpenMP tile driver of the CPU core: how a call's work is cut into items and spread
// over threads. Every CPU op (the optimizer steps, the copies, the quantization) runs through
// it, so the rules below hold everywhere.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace zk::cpu {

// Elements per OpenMP work item: 64 KiB of each fp32 stream, a multiple of every vector width
// and block size (<= 8192), so only the last item has a ragged end. Below two items a call
// stays on the calling thread: waking the pool costs more than the work.
constexpr int64_t kTileNumel = 16384;

// Threads for `work_items` items: num_threads > 0 asks for that many, 0 for OpenMP's default;
// never more than the items, never fewer than 1. Throws std::invalid_argument naming
// num_threads when it is negative.
inline int thread_count(int num_threads, int64_t work_items) {
  if (num_threads < 0) {
    throw std::invalid_argument("num_threads must be >= 0, got " + std::to_string(num_threads));
  }
  const int64_t wanted = num_threads > 0 ? num_threads : omp_get_max_threads();
  return static_cast<int>(std::max<int64_t>(1, std::min(wanted, work_items)));
}

// fn(t) for every item t in [0, items): in order on the calling thread when threads == 1,
// else over `threads` OpenMP threads (static schedule).
template <class Fn>
void for_items(int64_t items, int threads, Fn&& fn) {
  if (threads == 1) {
    for (int64_t t = 0; t < items; ++t) fn(t);
    return;
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < items; ++t) fn(t);
}

// fn(u0, u1) over [0, units) cut into items of `per_item` units: one call over everything on
// the calling thread when threads == 1, else one per item (for_items).
template <class Fn>
void for_ranges(int64_t units, int64_t per_item, int threads, Fn&& fn) {
  if (threads == 1) {
    fn(int64_t{0}, units);
    return;
  }
  for_items((units + per_item - 1) / per_item, threads, [&](int64_t t) {
    fn(t * per_item, std::min(units, (t + 1) * per_item));
  });
}

// Threads for an element-wise pass over `numel` elements in kTileNumel items.
inline int tile_threads(int num_threads, int64_t numel) {
  return thread_count(num_threads, (numel + kTileNumel - 1) / kTileNumel);
}

}  // namespace zk::cpu
