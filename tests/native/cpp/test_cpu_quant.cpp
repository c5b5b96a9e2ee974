// C++ tests of csrc/cpu_quant: every SIMD path the CPU supports, forced in turn, against the
// scalar path bit for bit (quantize, dequantize, dequantize-and-sum, int8 and int4, every
// block size class, ragged last blocks, special blocks), and against values worked out by
// hand (round half to even, a NaN / inf / zero block). Exit status 0 iff every check passed.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "check.h"
#include "cpu_quant/cpu_quant.h"

using zk::DType;
using namespace zk::cpu;
using namespace zk_test;

namespace {

const DType kDtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
const int64_t kBlocks[] = {2, 4, 8, 16, 32, 64, 256, 8192};
const int64_t kSizes[] = {1, 7, 17, 33, 1000, 40000};

// n values of dtype dt: normal values of varied magnitude per block, plus a block of zeros, one
// with an inf, one with a NaN and one with a subnormal maximum.
std::vector<uint8_t> values(int64_t n, int64_t block, DType dt, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(n);
  for (int64_t i = 0; i < n; ++i) x[i] = normal(rng) * std::ldexp(1.0f, (i / block) % 9 - 4);
  const int64_t nb = (n + block - 1) / block;
  if (nb > 4) {
    for (int64_t i = block; i < 2 * block; ++i) x[i] = 0.0f;
    x[2 * block + 1] = -INFINITY;
    x[3 * block] = NAN;
    for (int64_t i = 4 * block; i < std::min(n, 5 * block); ++i) x[i] = from_bits(0x00001234u + i);
  }
  std::vector<uint8_t> b(n * zk::dtype_bytes(dt));
  for (int64_t i = 0; i < n; ++i) {
    if (dt == DType::kFloat32) {
      reinterpret_cast<float*>(b.data())[i] = x[i];
    } else {
      reinterpret_cast<uint16_t*>(b.data())[i] =
          dt == DType::kBFloat16 ? exact_bf16(x[i]) : hw_fp16(x[i]);
    }
  }
  return b;
}

struct Quantized {
  std::vector<uint8_t> q;
  std::vector<float> scales;
  bool operator==(const Quantized& o) const {
    if (q != o.q || scales.size() != o.scales.size()) return false;
    for (size_t i = 0; i < scales.size(); ++i) {
      if (bits(scales[i]) != bits(o.scales[i])) return false;
    }
    return true;
  }
};

Quantized quantize_with(const std::vector<uint8_t>& x, DType dt, int64_t n, int bits_,
                        int64_t block, Isa isa) {
  Quantized r;
  r.q.assign(static_cast<size_t>(bits_ == 8 ? n : (n + 1) / 2), 0xAB);
  r.scales.assign(static_cast<size_t>((n + block - 1) / block), -1.0f);
  QuantizeArgs a;
  a.x = x.data(); a.dtype = dt; a.numel = n; a.bits = bits_; a.block = block;
  a.q = r.q.data(); a.scales = r.scales.data();
  CHECK(quantize(a, isa, n > 16384 ? 2 : 1) == isa, "quantize ran another path");
  return r;
}

// Dequantize (chunks 1) or dequantize-and-sum of `chunks` copies of q (scales varied per row).
std::vector<uint8_t> dequantize_with(const Quantized& qz, int64_t chunks, int64_t n, int bits_,
                                     int64_t block, DType out_dtype, bool sum, bool accumulate,
                                     Isa isa) {
  const int64_t q_row = static_cast<int64_t>(qz.q.size());
  const int64_t s_row = static_cast<int64_t>(qz.scales.size());
  std::vector<uint8_t> q;
  std::vector<float> scales;
  for (int64_t r = 0; r < chunks; ++r) {
    q.insert(q.end(), qz.q.begin(), qz.q.end());
    for (float s : qz.scales) scales.push_back(s * static_cast<float>(r + 1));
  }
  std::vector<uint8_t> out(n * zk::dtype_bytes(out_dtype));
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<uint8_t>(i * 7 % 61);  // finite
  DequantizeArgs a;
  a.q = q.data(); a.q_row = q_row; a.scales = scales.data(); a.s_row = s_row;
  a.chunks = chunks; a.numel = n; a.bits = bits_; a.block = block;
  a.out = out.data(); a.out_dtype = out_dtype; a.sum = sum; a.scale = 0.25f;
  a.accumulate = accumulate;
  CHECK(dequantize(a, isa, n * chunks > 16384 ? 2 : 1) == isa, "dequantize ran another path");
  return out;
}

void test_against_scalar(Isa isa) {
  for (DType dt : kDtypes) {
    for (int b : {8, 4}) {
      for (int64_t block : kBlocks) {
        for (int64_t n : kSizes) {
          if (n > 16384 && block < 256) continue;  // the two-thread size: long blocks suffice
          const auto x = values(n, block, dt, static_cast<uint32_t>(n + block * 3 + b));
          const Quantized want = quantize_with(x, dt, n, b, block, Isa::kScalar);
          const Quantized got = quantize_with(x, dt, n, b, block, isa);
          CHECK(got == want, "%s quantize %s int%d block=%lld n=%lld differs from scalar",
                isa_name(isa), zk::dtype_name(dt), b, static_cast<long long>(block),
                static_cast<long long>(n));
          for (DType od : kDtypes) {
            struct { int64_t chunks; bool sum, acc; } modes[] = {{1, false, false},
                                                                {3, true, false},
                                                                {2, true, true}};
            for (const auto& m : modes) {
              const auto ref =
                  dequantize_with(want, m.chunks, n, b, block, od, m.sum, m.acc, Isa::kScalar);
              const auto out = dequantize_with(want, m.chunks, n, b, block, od, m.sum, m.acc, isa);
              CHECK(out == ref,
                    "%s dequantize int%d block=%lld n=%lld -> %s chunks=%lld sum=%d acc=%d "
                    "differs from scalar", isa_name(isa), b, static_cast<long long>(block),
                    static_cast<long long>(n), zk::dtype_name(od),
                    static_cast<long long>(m.chunks), m.sum, m.acc);
            }
          }
        }
      }
    }
  }
}

// Values worked out by hand: amax 1 gives scale 1/127 and codes rint(x * 127), halves to even.
void test_by_hand(Isa isa) {
  // block 0: 1, -0.5 (-63.5 -> -64), 0.25 (31.75 -> 32), 0.5/127 (0.5 -> 0), 1.5/127 (1.5 -> 2)
  // block 1: zeros; block 2: a NaN; block 3: an inf (17 elements: the last block is ragged)
  std::vector<float> x(5 * 4, 0.0f);
  x[0] = 1.0f; x[1] = -0.5f; x[2] = 0.25f; x[3] = 0.5f / 127.0f;
  x[8] = 1.0f; x[9] = NAN;
  x[12] = INFINITY;
  x[16] = 1.5f / 127.0f;
  const int64_t n = 17;
  std::vector<uint8_t> xb(reinterpret_cast<uint8_t*>(x.data()),
                          reinterpret_cast<uint8_t*>(x.data()) + 4 * n);
  const Quantized q = quantize_with(xb, DType::kFloat32, n, 8, 4, isa);
  const int8_t want_codes[] = {127, -64, 32, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 127};
  const uint32_t want_scales[] = {bits(1.0f / 127.0f), 0u, 0x7FC00000u, 0x7F800000u,
                                  bits((1.5f / 127.0f) / 127.0f)};
  for (int64_t i = 0; i < n; ++i) {
    CHECK(static_cast<int8_t>(q.q[i]) == want_codes[i], "%s code %lld: %d want %d",
          isa_name(isa), static_cast<long long>(i), static_cast<int8_t>(q.q[i]), want_codes[i]);
  }
  for (int b = 0; b < 5; ++b) {
    CHECK(bits(q.scales[b]) == want_scales[b], "%s scale %d: 0x%08x want 0x%08x",
          isa_name(isa), b, bits(q.scales[b]), want_scales[b]);
  }
  // int4: qmax 7; codes pack low nibble first; 0.5 -> 3.5 -> 4, -1 -> -7
  std::vector<float> y = {1.0f, 0.5f, -1.0f, 0.0f, 3.0f};
  std::vector<uint8_t> yb(reinterpret_cast<uint8_t*>(y.data()),
                          reinterpret_cast<uint8_t*>(y.data()) + 4 * y.size());
  const Quantized q4 = quantize_with(yb, DType::kFloat32, 5, 4, 4, isa);
  CHECK(q4.q[0] == 0x47 && q4.q[1] == 0x09 && q4.q[2] == 0x07,
        "%s int4 bytes %02x %02x %02x want 47 09 07", isa_name(isa), q4.q[0], q4.q[1], q4.q[2]);
  // dequantize-and-sum of 2 chunks (scales s, 2s), times 0.25: codes 127 -> 127 * 3s / 4
  const auto out = dequantize_with(q, 2, n, 8, 4, DType::kFloat32, true, false, isa);
  const float* o = reinterpret_cast<const float*>(out.data());
  const float s = 1.0f / 127.0f;
  const float want0 = (127.0f * s + 127.0f * (s * 2.0f)) * 0.25f;
  CHECK(bits(o[0]) == bits(want0), "%s dequantize-and-sum[0]: %a want %a", isa_name(isa), o[0],
        want0);
  CHECK(std::isnan(o[8]) && std::isnan(o[12]), "%s NaN and inf scales give NaN (0 * inf)",
        isa_name(isa));
}

void test_path(Isa isa) {
  if (!have_f16c()) return;  // the inputs are made with F16C
  test_by_hand(isa);
  test_against_scalar(isa);
}

}  // namespace

int main() { return run_paths(test_path); }
