// The vector tiles of csrc/cpu_adam_lowbit, written once over the vector traits V of the
// including path (csrc/simd/path.cpp): the operations of lowbit::update and of
// the block requantization in kernel.h, in their order, on kWidth elements at a time, so every
// path gives the scalar path's bits. A block's ragged end loads code 0 (and grad, param 0)
// in its missing lanes: their m and sqrt(v) are 0 (NaN only where the block's scale is
// non-finite, which makes every element of the block NaN anyway), so they change no block
// max, and they are never stored.
#pragma once

#include "kernel.h"
#include "simd/vec.h"

namespace zk::cpu::lowbit {

// [Note: dividing by a constant without the divider]
// Per element the int8 format divides four times and takes one square root, and the divider
// (which also runs the root: vdivps/vsqrtps, one per several cycles) is one limit of the tile,
// beside the vector ports' other work (the codes' integer arithmetic above all). Three of the
// divisors are constant over many elements: sqrt(v) / sqrt(1 - beta2^t) (one per step) and the
// requantization's |m| / absmax and sqrt(v) / absmax (one per block). Those quotients are
// computed with one product and two FMAs instead, and are the IEEE quotient bit for bit: with
// inv = RN(1 / b), q = RN(x * inv) is within an ulp of x / b, the remainder q * b - x is exact
// in one FMA, and RN(q - (q * b - x) * inv) = RN(x / b) (Markstein's theorem, IBM J. Res.
// Dev. 34(1), 1990; tests/native/cpp/test_cpu_adam_lowbit.cpp checks every significand of x
// over the two octaves around b for 206 divisors, among them 1 - 2^-24, 1 + 2^-23 and the
// largest significand; 3,000 more random ones passed the same check when this was written).
// Signed zeros come out as the division gives them (-0 / b = -0). The theorem needs no
// underflow or overflow on the way, so:
// - sqrt(v) / sqrt_bc2: sqrt_bc2 is in (0, 1], so inv >= 1, and a nonzero root is >= 2^-75 (the
//   root of the least float): no underflow. A vector with some |r| >= r_lim (r * inv could
//   reach 2^126, and inf, NaN) divides instead.
// - x / absmax (x in [0, absmax]): a block whose absmax is outside [2^-60, 2^126) divides.
//   In the others every element with x / absmax >= 2^-40 has x >= 2^-100 (an exact
//   remainder) and gets the IEEE quotient; a smaller ratio may differ in its last bits but
//   both stay below 2^-39, which codes as 0 either way (the codes' smallest step is 2^-18).
// The remaining division, by the denominator sqrt(v) / sqrt_bc2 + eps, varies per element and
// stays an IEEE division, as does every division of the scalar path (the tests compare each
// path with the reference and with the scalar path, bit for bit, blocks from 2^-136 to 2^126
// included). Only the AVX-512 path does this (V::kFmaQuotient): there, on the 2-core Xeon VM
// of benchmarks/README.md, it cut the int8 tile's time by ~15% in L2 and at 16M elements,
// bf16's by ~13% in L2; the AVX2 path, with 8 lanes per division, ran 5-10% slower with it in
// L2, so it keeps the divider.
template <class V>
ZK_SIMD_INLINE typename V::F quotient(typename V::F x, typename V::F b, typename V::F inv) {
  const typename V::F q = V::mul(x, inv);
  return V::fnmadd(V::fmsub(q, b, x), inv, q);
}

// The bits of |x| below which (from which) a block's absmax takes quotient() (see above).
constexpr uint32_t kQuotientScaleLo = (127u - 60u) << 23, kQuotientScaleHi = (127u + 126u) << 23;

inline bool quotient_ok(float absmax) {
  const uint32_t u = detail::bits_of(absmax);
  return u >= kQuotientScaleLo && u < kQuotientScaleHi;
}

// The bits of the least |r| for which r * inv might reach 2^126 (inv = RN(1 / b), b in (0, 1]):
// with inv < 2^(e + 1), any r < 2^(125 - e) is safe. 0 (every vector divides) for any other b.
inline uint32_t quotient_limit(float b) {
  if (!(b > 0.0f && b <= 1.0f)) return 0;
  const int e = static_cast<int>((detail::bits_of(1.0f / b) >> 23) & 0xFF) - 127;
  return e >= 0 && e <= 120 ? static_cast<uint32_t>(127 + 125 - e) << 23 : 0;
}

template <class V>
struct Update {
  using F = typename V::F;
  Coeffs c;
  F grad_scale, decay, wd, w, w_minus_one, beta2, omb2, sqrt_bc2, inv_bc2, eps, nss;
  typename V::I abs_mask, r_lim;

  ZK_SIMD_INLINE explicit Update(const Coeffs& co)
      : c(co), grad_scale(V::set1(co.grad_scale)), decay(V::set1(co.decay)),
        wd(V::set1(co.wd)), w(V::set1(co.w)), w_minus_one(V::set1(co.w_minus_one)),
        beta2(V::set1(co.beta2)), omb2(V::set1(co.one_minus_beta2)),
        sqrt_bc2(V::set1(co.sqrt_bc2)), inv_bc2(V::set1(1.0f / co.sqrt_bc2)),
        eps(V::set1(co.eps)), nss(V::set1(co.neg_step_size)), abs_mask(V::set1i(0x7FFFFFFFu)),
        r_lim(V::set1i(quotient_limit(co.sqrt_bc2))) {}

  // lowbit::update on kWidth lanes; returns sqrt(v).
  ZK_SIMD_INLINE F operator()(F g, F& p, F& m, F& v) const {
    if (c.unscale) g = V::div(g, grad_scale);
    if (c.decoupled) {
      p = V::mul(p, decay);
    } else if (c.l2) {
      g = V::fmadd(wd, p, g);
    }
    const F diff = V::sub(g, m);
    m = c.w_small ? V::fmadd(w, diff, m) : V::fmadd(w_minus_one, diff, g);
    v = V::fmadd(V::mul(omb2, g), g, V::mul(v, beta2));
    const F r = V::sqrt(v);
    F root;  // r / sqrt_bc2 ([Note: dividing by a constant without the divider])
    if constexpr (V::kFmaQuotient) {
      root = quotient<V>(r, sqrt_bc2, inv_bc2);
      if (V::any_ge_u32(V::and_i(V::bits(r), abs_mask), r_lim)) root = V::div(r, sqrt_bc2);
    } else {
      root = V::div(r, sqrt_bc2);
    }
    const F denom = V::add(root, eps);
    p = V::add(p, V::div(V::mul(nss, m), denom));
    return r;
  }
};

// encode<M> / decode<M> of kernel.h on kWidth lanes (the same integer and IEEE operations).
template <class V, int M>
ZK_SIMD_INLINE typename V::I encode_v(typename V::F y) {
  using I = typename V::I;
  constexpr int S = 23 - M;
  const I d = V::sub_i(V::bits(y), V::set1i(static_cast<uint32_t>(kCodeBase)));
  const I odd = V::and_i(V::template srai<S>(d), V::set1i(1));
  const I normal = V::add_i(
      V::template srai<S>(V::add_i(V::add_i(d, V::set1i((1u << (S - 1)) - 1u)), odd)),
      V::set1i(1u << M));
  const I sub = V::rint_i32(V::mul(y, V::set1(pow2(M - kEmin))));
  return V::select_neg_i(d, sub, normal);
}

template <class V, int M>
ZK_SIMD_INLINE typename V::F decode_v(typename V::I c) {
  using I = typename V::I;
  constexpr int S = 23 - M;
  const I d = V::sub_i(c, V::set1i(1u << M));
  const typename V::F normal =
      V::from_bits(V::add_i(V::template slli<S>(d), V::set1i(static_cast<uint32_t>(kCodeBase))));
  const typename V::F sub = V::mul(V::to_f32(c), V::set1(pow2(kEmin - M)));
  return V::select_neg_f(d, sub, normal);
}

// The grad as fp32 lanes (its dtype a run-time switch: a loop-invariant, predicted branch).
template <class V, class M>
ZK_SIMD_INLINE typename V::F load_grad(const Kernel& k, int64_t i, M mask) {
  return simd::load_as<V>(k.grad, k.grad_dtype, i, mask);
}

// [Note: software prefetch in the lowbit tiles]
// One thread's streams of param, grad and moments outrun the hardware prefetchers here, the
// int8 tile's most: it alternates a loop that loads (the update) with loops that touch only
// L1 (the block's requantization), and the L2 streamer, which runs ahead of demand loads,
// idles while no loads come. Each vector of the update loops therefore asks for the lines
// kPrefetchAhead elements ahead (param and grad, and each moment stream once per line).
// Measured on the 2-core Xeon VM of benchmarks/README.md (one thread, 16M elements, a C++
// loop over the library, interleaved): int8 1.64 -> 1.24 ns per element, bf16 1.17 -> 0.91;
// 1024 and 4096 ahead did no better than 2048 (int8); no change when everything is in L2.
constexpr int64_t kPrefetchAhead = 2048;

// Asks for the line that starts among the bytes of elements [a, a + W), a = j +
// kPrefetchAhead, of a buffer of `numel` elements of `bytes` bytes, if one does (so a stream
// narrower than a line is asked for once per line). ZK_SIMD_INLINE, not plain inline: as a
// plain inline function inlined into the ZK_SIMD bodies, GCC 12 emitted no prefetch at all.
template <int W>
ZK_SIMD_INLINE void prefetch_ahead(const void* p, int64_t bytes, int64_t j, int64_t numel) {
  const int64_t a = j + kPrefetchAhead, off = a * bytes, to_line = -off & 63;
  if (a < numel && to_line < W * bytes) {
    __builtin_prefetch(static_cast<const char*>(p) + off + to_line);
  }
}

template <class V, DType P, int O>  // P: the param's dtype; O: -1 no copy, else out's DType
ZK_SIMD void bf16_tile(const Kernel& k, int64_t begin, int64_t end) {
  using F = typename V::F;
  const Update<V> up(k.c);
  const typename V::I nan_hi = simd::bf16_nan_high<V>(0xFFFF);
  const int64_t gs = dtype_bytes(k.grad_dtype);
  simd::for_vectors<V>(begin, end, [&](int64_t i, auto mask) ZK_SIMD_LAMBDA {
    prefetch_ahead<V::kWidth>(k.param, dtype_bytes(P), i, k.numel);
    prefetch_ahead<V::kWidth>(k.grad, gs, i, k.numel);
    prefetch_ahead<V::kWidth>(k.exp_avg, 2, i, k.numel);
    prefetch_ahead<V::kWidth>(k.exp_avg_sq, 2, i, k.numel);
    F g = load_grad<V>(k, i, mask);
    F p = simd::load_as<V, P>(k.param, i, mask);
    F m = simd::load_as<V, DType::kBFloat16>(k.exp_avg, i, mask);
    F v = simd::load_as<V, DType::kBFloat16>(k.exp_avg_sq, i, mask);
    up(g, p, m, v);
    simd::store_as<V, P>(k.param, i, p, mask, nan_hi);
    simd::store_as<V, DType::kBFloat16>(k.exp_avg, i, m, mask, nan_hi);
    simd::store_as<V, DType::kBFloat16>(k.exp_avg_sq, i, v, mask, nan_hi);
    if constexpr (O >= 0) simd::store_as<V, static_cast<DType>(O)>(k.out, i, p, mask, nan_hi);
  });
}

// The codes of staged values xs[0, n) of a block with finite, nonzero absmax `amax`: m's
// (kMantM: sign and magnitude, int8) or sqrt(v)'s (kMantR: uint8); Q: quotient() for the
// ratio |x| / amax, else the division ([Note: dividing by a constant without the divider]).
template <class V, int M, bool Q, class C>
ZK_SIMD_INLINE void encode_codes(C* q, const float* xs, int64_t n, float amax) {
  using I = typename V::I;
  const typename V::F a = V::set1(amax), inv = V::set1(1.0f / amax);
  const I abs_mask = V::set1i(0x7FFFFFFFu), zero_i = V::set1i(0);
  simd::for_vectors<V>(0, n, [&](int64_t i, auto mask) ZK_SIMD_LAMBDA {
    const I xb = V::bits(V::load(xs + i, mask));
    const typename V::F x = V::from_bits(M == kMantM ? V::and_i(xb, abs_mask) : xb);
    const I mag = encode_v<V, M>(Q ? quotient<V>(x, a, inv) : V::div(x, a));
    if constexpr (M == kMantM) {
      V::store_i8(q + i, V::select_neg_i(xb, V::sub_i(zero_i, mag), mag), mask);
    } else {
      V::store_u8(q + i, mag, mask);
    }
  });
}

template <class V, int M, class C>
ZK_SIMD_INLINE void encode_block(C* q, const float* xs, int64_t n, float amax) {
  if constexpr (V::kFmaQuotient) {
    if (quotient_ok(amax)) return encode_codes<V, M, true>(q, xs, n, amax);
  }
  encode_codes<V, M, false>(q, xs, n, amax);
}

template <class V, DType P, int O>
ZK_SIMD void int8_tile(const Kernel& k, int64_t begin, int64_t end) {
  using F = typename V::F;
  using I = typename V::I;
  alignas(64) float ms[kMaxBlock], rs[kMaxBlock];
  const Update<V> up(k.c);
  const I nan_hi = simd::bf16_nan_high<V>(0xFFFF), abs_mask = V::set1i(0x7FFFFFFFu);
  const I sign_bit = V::set1i(0x80000000u);
  int8_t* qm = static_cast<int8_t*>(k.exp_avg);
  uint8_t* qv = static_cast<uint8_t*>(k.exp_avg_sq);
  const int64_t gs = dtype_bytes(k.grad_dtype);
  const int64_t b1 = (end + k.block - 1) / k.block;
  for (int64_t b = begin / k.block; b < b1; ++b) {
    const int64_t base = b * k.block;
    const int64_t n = k.numel - base < k.block ? k.numel - base : k.block;
    const F sm = V::set1(k.m_scales[b]), sv = V::set1(k.v_scales[b]);
    I tm = V::set1i(0), tr = V::set1i(0);
    simd::for_vectors<V>(0, n, [&](int64_t i, auto mask) ZK_SIMD_LAMBDA {
      const int64_t j = base + i;
      prefetch_ahead<V::kWidth>(k.param, dtype_bytes(P), j, k.numel);
      prefetch_ahead<V::kWidth>(k.grad, gs, j, k.numel);
      prefetch_ahead<V::kWidth>(qm, 1, j, k.numel);
      prefetch_ahead<V::kWidth>(qv, 1, j, k.numel);
      F g = load_grad<V>(k, j, mask);
      F p = simd::load_as<V, P>(k.param, j, mask);
      const I cm = V::load_i8(qm + j, mask);
      const F m_abs = V::mul(decode_v<V, kMantM>(V::abs_i(cm)), sm);
      F m = V::from_bits(V::xor_i(V::bits(m_abs), V::and_i(cm, sign_bit)));
      const F r0 = V::mul(decode_v<V, kMantR>(V::load_u8(qv + j, mask)), sv);
      F v = V::mul(r0, r0);
      const F r = up(g, p, m, v);
      simd::store_as<V, P>(k.param, j, p, mask, nan_hi);
      if constexpr (O >= 0) simd::store_as<V, static_cast<DType>(O)>(k.out, j, p, mask, nan_hi);
      V::store(ms + i, m, mask);
      V::store(rs + i, r, mask);
      tm = V::max_u32(tm, V::and_i(V::bits(m), abs_mask));
      tr = V::max_u32(tr, V::and_i(V::bits(r), abs_mask));
    });
    const quant::BlockScale s_m = quant::block_scale(V::reduce_max_u32(tm), 1.0f);
    const quant::BlockScale s_r = quant::block_scale(V::reduce_max_u32(tr), 1.0f);
    k.m_scales[b] = s_m.scale;
    k.v_scales[b] = s_r.scale;
    if (s_m.ok) {
      encode_block<V, kMantM>(qm + base, ms, n, s_m.amax);
    } else {
      std::memset(qm + base, 0, static_cast<size_t>(n));
    }
    if (s_r.ok) {
      encode_block<V, kMantR>(qv + base, rs, n, s_r.amax);
    } else {
      std::memset(qv + base, 0, static_cast<size_t>(n));
    }
  }
}

template <class V, DType P, int O>
ZK_SIMD void format_tile(const Kernel& k, int64_t begin, int64_t end) {
  if (k.format == MomentFormat::kBf16) return bf16_tile<V, P, O>(k, begin, end);
  return int8_tile<V, P, O>(k, begin, end);
}

template <class V, DType P>
ZK_SIMD void tile_for_out(const Kernel& k, int64_t begin, int64_t end) {
  constexpr int kBf16 = static_cast<int>(DType::kBFloat16);
  constexpr int kFp16 = static_cast<int>(DType::kFloat16);
  constexpr int kFp32 = static_cast<int>(DType::kFloat32);
  if (!k.out) return format_tile<V, P, -1>(k, begin, end);
  switch (k.out_dtype) {
    case DType::kBFloat16: return format_tile<V, P, kBf16>(k, begin, end);
    case DType::kFloat16: return format_tile<V, P, kFp16>(k, begin, end);
    default: return format_tile<V, P, kFp32>(k, begin, end);
  }
}

// Elements [begin, end) on path V.
template <class V>
ZK_SIMD void lowbit_range(const Kernel& k, int64_t begin, int64_t end) {
  if (k.param_dtype == DType::kBFloat16) {
    return tile_for_out<V, DType::kBFloat16>(k, begin, end);
  }
  return tile_for_out<V, DType::kFloat32>(k, begin, end);
}

}  // namespace zk::cpu::lowbit
