// C++ tests of csrc/cpu_ops: every SIMD path the CPU supports, forced in turn, against the
// scalar path bit for bit (copies and casts over random bit patterns, the unscale and its
// non-finite flag, the sum of squares), every size class of a vector loop (full vectors,
// pairs, a ragged end, several tiles on two threads); the fp32 -> bf16 / fp16 casts on edge
// values against independent roundings; the sum of squares against its [Note: sum_squares
// order] computed here. Exit status 0 iff every check passed.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "check.h"
#include "cpu_ops/cpu_ops.h"

using zk::DType;
using namespace zk::cpu;
using namespace zk_test;

namespace {

const DType kDtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
const int64_t kSizes[] = {0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 63, 64, 65, 1000,
                          2 * 16384 + 13};

// n elements of dtype dt as raw bytes: random bit patterns (NaNs, infs, subnormals included).
std::vector<uint8_t> random_bytes(int64_t n, DType dt, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> b(static_cast<size_t>(n * zk::dtype_bytes(dt)));
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  return b;
}

// The values that decide a rounding: ties to even and odd, the largest finite values, the
// subnormal range, infinities, quiet and signalling NaNs of both signs, and zeros.
const uint32_t kEdges[] = {
    0x00000000, 0x80000000, 0x00000001, 0x00008000, 0x00018000, 0x0000FFFF, 0x807FFFFF,
    0x00800000, 0x3F800000, 0x3F808000, 0x3F818000, 0x3F808001, 0x3F80FFFF, 0xBF818000,
    0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000,
    0xFFC00000, 0x7F800001, 0xFF800001, 0x7FA00000, 0xFFFFFFFF, 0x477FE000, 0x477FEFFF,
    0x477FF000, 0x477FF001, 0x38800000, 0x387FFFFF, 0x33000000, 0x33000001, 0x33800000};

Isa copy(const std::vector<uint8_t>& src, std::vector<uint8_t>& dst, int64_t n,
         const CopySpec& spec, Isa isa) {
  const Segment seg{src.data(), dst.data(), n};
  return copy_segments(&seg, 1, spec, isa, n > 16384 ? 2 : 1);
}

void test_cast_edges(Isa isa) {
  // Every edge value at every lane of a vector and of a ragged end: 3 copies of the list.
  std::vector<uint32_t> x;
  for (int r = 0; r < 3; ++r) x.insert(x.end(), std::begin(kEdges), std::end(kEdges));
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<uint8_t> src(reinterpret_cast<uint8_t*>(x.data()),
                           reinterpret_cast<uint8_t*>(x.data()) + 4 * n);
  for (uint16_t nan : {uint16_t{0xFFFF}, uint16_t{0x7FC0}}) {
    std::vector<uint8_t> dst(2 * n, 0xAB);
    copy(src, dst, n, CopySpec{DType::kFloat32, DType::kBFloat16, false, 1.0f, nan}, isa);
    const uint16_t* h = reinterpret_cast<const uint16_t*>(dst.data());
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t want = exact_bf16(from_bits(x[i]), nan);
      CHECK(h[i] == want, "%s bf16 of 0x%08x (lane %lld): 0x%04x want 0x%04x", isa_name(isa),
            x[i], static_cast<long long>(i), h[i], want);
    }
  }
  if (!have_f16c()) return;
  std::vector<uint8_t> dst(2 * n, 0xAB);
  copy(src, dst, n, CopySpec{DType::kFloat32, DType::kFloat16}, isa);
  const uint16_t* h = reinterpret_cast<const uint16_t*>(dst.data());
  for (int64_t i = 0; i < n; ++i) {
    CHECK(h[i] == hw_fp16(from_bits(x[i])), "%s fp16 of 0x%08x: 0x%04x want 0x%04x",
          isa_name(isa), x[i], h[i], hw_fp16(from_bits(x[i])));
  }
}

void test_copies(Isa isa) {
  for (DType s : kDtypes) {
    for (DType d : kDtypes) {
      for (int scaled = 0; scaled < 2; ++scaled) {
        for (int64_t n : kSizes) {
          const CopySpec spec{s, d, scaled != 0, 0.37f,
                              n % 2 ? uint16_t{0x7FC0} : uint16_t{0xFFFF}};
          const auto src = random_bytes(n, s, static_cast<uint32_t>(n * 9 + scaled));
          std::vector<uint8_t> want(n * zk::dtype_bytes(d), 0xAB), got = want;
          copy(src, want, n, spec, Isa::kScalar);
          CHECK(copy(src, got, n, spec, isa) == isa, "%s: ran another path", isa_name(isa));
          CHECK(got == want, "%s copy %s -> %s scaled=%d n=%lld differs from scalar",
                isa_name(isa), zk::dtype_name(s), zk::dtype_name(d), scaled,
                static_cast<long long>(n));
        }
      }
    }
  }
}

void test_unscale(Isa isa) {
  for (DType dt : kDtypes) {
    for (int64_t n : kSizes) {
      if (n == 0) continue;
      auto want = random_bytes(n, dt, static_cast<uint32_t>(n * 5 + 1));
      // finite values only, then one inf at a chosen place: the flag must see each place
      for (int64_t where : {int64_t{-1}, int64_t{0}, n / 2, n - 1}) {
        std::vector<uint8_t> x = want;
        for (int64_t i = 0; i < n; ++i) {  // clear the top exponent bit: always finite
          uint8_t* top = &x[(i + 1) * zk::dtype_bytes(dt) - 1];
          *top &= 0xBF;
        }
        if (where >= 0) {
          if (dt == DType::kFloat32) {
            reinterpret_cast<uint32_t*>(x.data())[where] = 0x7F800000;
          } else {
            reinterpret_cast<uint16_t*>(x.data())[where] =
                dt == DType::kBFloat16 ? 0xFF80 : 0x7C00;
          }
        }
        std::vector<uint8_t> ref = x;
        const bool bad_ref = unscale_and_check(ref.data(), dt, n, 0.125f, Isa::kScalar, 1);
        Isa ran = Isa::kAuto;
        const bool bad = unscale_and_check(x.data(), dt, n, 0.125f, isa, n > 16384 ? 2 : 1, &ran);
        CHECK(ran == isa && bad == bad_ref && bad == (where >= 0),
              "%s unscale %s n=%lld inf at %lld: flag %d (scalar %d)", isa_name(isa),
              zk::dtype_name(dt), static_cast<long long>(n), static_cast<long long>(where), bad,
              bad_ref);
        CHECK(x == ref, "%s unscale %s n=%lld differs from scalar", isa_name(isa),
              zk::dtype_name(dt), static_cast<long long>(n));
      }
      // random patterns: NaNs and infs among them, values compared bit for bit
      std::vector<uint8_t> got = want;
      const bool bad_ref = unscale_and_check(want.data(), dt, n, 3.0f, Isa::kScalar, 1);
      const bool bad = unscale_and_check(got.data(), dt, n, 3.0f, isa, 1);
      CHECK(bad == bad_ref && got == want, "%s unscale %s n=%lld (random bits)", isa_name(isa),
            zk::dtype_name(dt), static_cast<long long>(n));
    }
  }
}

float as_float(const std::vector<uint8_t>& b, DType dt, int64_t i) {
  if (dt == DType::kFloat32) return reinterpret_cast<const float*>(b.data())[i];
  const uint16_t h = reinterpret_cast<const uint16_t*>(b.data())[i];
  return dt == DType::kBFloat16 ? from_bits(uint32_t{h} << 16) : hw_from_fp16(h);
}

// [Note: sum_squares order], spelled out: chunks of 16384, 16 lanes, folded 8, 4, 2, 1.
double sumsq_in_note_order(const std::vector<std::vector<uint8_t>>& t, DType dt,
                           const std::vector<int64_t>& n) {
  double total = 0.0;
  for (size_t k = 0; k < t.size(); ++k) {
    for (int64_t c = 0; c < n[k]; c += 16384) {
      double lane[16] = {};
      for (int64_t i = c; i < std::min(n[k], c + 16384); ++i) {
        const double x = as_float(t[k], dt, i);
        lane[(i - c) % 16] += x * x;
      }
      for (int s = 8; s >= 1; s /= 2) {
        for (int j = 0; j < s; ++j) lane[j] += lane[j + s];
      }
      total += lane[0];
    }
  }
  return total;
}

void test_sum_squares(Isa isa) {
  for (DType dt : kDtypes) {
    if (dt == DType::kFloat16 && !have_f16c()) continue;  // the reference widens with F16C
    std::mt19937 rng(static_cast<uint32_t>(dt) + 11);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    std::vector<std::vector<uint8_t>> tensors;
    std::vector<int64_t> sizes;
    std::vector<Span> spans;
    for (int64_t n : kSizes) {
      std::vector<uint8_t> b(n * zk::dtype_bytes(dt));
      for (int64_t i = 0; i < n; ++i) {
        const float v = normal(rng);
        if (dt == DType::kFloat32) {
          reinterpret_cast<float*>(b.data())[i] = v;
        } else {
          reinterpret_cast<uint16_t*>(b.data())[i] =
              dt == DType::kBFloat16 ? exact_bf16(v) : hw_fp16(v);
        }
      }
      tensors.push_back(std::move(b));
      sizes.push_back(n);
    }
    for (size_t k = 0; k < tensors.size(); ++k) spans.push_back({tensors[k].data(), dt, sizes[k]});
    const double want = sumsq_in_note_order(tensors, dt, sizes);
    for (int threads : {1, 2}) {
      const int64_t count = static_cast<int64_t>(spans.size());
      const double got = sum_squares(spans.data(), count, isa, threads);
      CHECK(got == want, "%s sum_squares %s threads=%d: %.17g want %.17g", isa_name(isa),
            zk::dtype_name(dt), threads, got, want);
      for (size_t k = 0; k < spans.size(); ++k) {  // each size alone: every ragged end
        const double one = sum_squares(&spans[k], 1, isa, 1);
        const double ref = sum_squares(&spans[k], 1, Isa::kScalar, 1);
        CHECK(one == ref, "%s sum_squares %s n=%lld: %.17g scalar %.17g", isa_name(isa),
              zk::dtype_name(dt), static_cast<long long>(sizes[k]), one, ref);
      }
    }
  }
}

void test_path(Isa isa) {
  test_cast_edges(isa);
  test_copies(isa);
  test_unscale(isa);
  test_sum_squares(isa);
}

}  // namespace

int main() { return run_paths(test_path); }
