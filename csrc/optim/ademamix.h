// AdEMAMix's tile body (Pagliardini, Ablin, Grangier 2024; zkernels/reference/ademamix.py,
// operation for operation, each rounded once, no contraction, IEEE sqrt and divisions):
//   m1 = m1*b1 + g*(1-b1);  m2 = m2*b3 + g*(1-b3);  v = v*b2 + (g*g)*(1-b2)
//   d = sqrt(v)/sqrt(1-b2^t) + eps;  u = (m1/(1-b1^t) + m2*alpha)/d;  u = u + p*wd
//   p = p - u*lr
// States: exp_avg_fast (m1), exp_avg_slow (m2), exp_avg_sq (v).
#pragma once

#include "optim/tile.h"

namespace zk::cpu::optim {

template <class V>
struct AdEMAMixBody {
  using F = typename V::F;
  F b1, omb1, b2, omb2, b3, omb3, alpha, bc1, sqrt_bc2, eps, wd, lr;
  // c: beta1, 1-beta1, beta2, 1-beta2, beta3_t, 1-beta3_t, alpha_t, 1-beta1^t,
  // sqrt(1-beta2^t), eps, weight_decay, lr (zkernels/optimizers/ademamix.py)
  ZK_SIMD_INLINE explicit AdEMAMixBody(const float* c)
      : b1(V::set1(c[0])), omb1(V::set1(c[1])), b2(V::set1(c[2])), omb2(V::set1(c[3])),
        b3(V::set1(c[4])), omb3(V::set1(c[5])), alpha(V::set1(c[6])), bc1(V::set1(c[7])),
        sqrt_bc2(V::set1(c[8])), eps(V::set1(c[9])), wd(V::set1(c[10])), lr(V::set1(c[11])) {}
  template <class S>
  ZK_SIMD_INLINE void operator()(F g, F& p, const S& s) const {
    const F m1 = V::add(V::mul(s.load(0), b1), V::mul(g, omb1));
    const F m2 = V::add(V::mul(s.load(1), b3), V::mul(g, omb3));
    const F v = V::add(V::mul(s.load(2), b2), V::mul(V::mul(g, g), omb2));
    const F d = V::add(V::div(V::sqrt(v), sqrt_bc2), eps);
    F u = V::div(V::add(V::div(m1, bc1), V::mul(m2, alpha)), d);
    u = V::add(u, V::mul(p, wd));
    p = V::sub(p, V::mul(u, lr));
    s.store(0, m1);
    s.store(1, m2);
    s.store(2, v);
  }
};

struct AdEMAMix : OneBody<AdEMAMixBody>, KindDefaults {
  static constexpr const char* kName = "ademamix";
  static constexpr const char* kStates[] = {"exp_avg_fast", "exp_avg_slow", "exp_avg_sq"};
  static constexpr int kNumCoeffs = 12;
};

}  // namespace zk::cpu::optim
