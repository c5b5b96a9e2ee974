// Lion's tile body (Chen et al. 2023; zkernels/reference/lion.py, operation for operation):
// u = sign(m*b1 + g*(1-b1)); p = p*(1 - lr*wd); p = p + u*(-lr); m = m*b2 + g*(1-b2).
#pragma once

#include "optim/tile.h"

namespace zk::cpu::optim {

template <class V>
struct LionBody {
  using F = typename V::F;
  F b1, omb1, b2, omb2, decay, nlr;
  // c: beta1, 1-beta1, beta2, 1-beta2, 1-lr*wd, -lr (zkernels/optimizers/lion.py)
  ZK_SIMD_INLINE explicit LionBody(const float* c)
      : b1(V::set1(c[0])), omb1(V::set1(c[1])), b2(V::set1(c[2])), omb2(V::set1(c[3])),
        decay(V::set1(c[4])), nlr(V::set1(c[5])) {}
  template <class S>
  ZK_SIMD_INLINE void operator()(F g, F& p, const S& s) const {
    const F m = s.load(0);
    p = V::mul(p, decay);
    const F u = V::sign(V::add(V::mul(m, b1), V::mul(g, omb1)));
    p = V::add(p, V::mul(u, nlr));
    s.store(0, V::add(V::mul(m, b2), V::mul(g, omb2)));
  }
};

struct Lion : OneBody<LionBody>, KindDefaults {
  static constexpr const char* kName = "lion";
  static constexpr const char* kStates[] = {"exp_avg"};
  static constexpr int kNumCoeffs = 6;
  static void check(const double* c) {
    require(c[0] >= 0.0 && c[0] <= 1.0, "beta1 must be in [0, 1], got " + std::to_string(c[0]));
    require(c[2] >= 0.0 && c[2] <= 1.0, "beta2 must be in [0, 1], got " + std::to_string(c[2]));
  }
};

}  // namespace zk::cpu::optim
