// SGD's tile body (torch.optim.SGD's rule; zkernels/reference/sgd.py, operation for
// operation): g = g + p*wd; with momentum b = g on the first step, else b = b*momentum +
// g*(1-dampening); g = nesterov ? g + b*momentum : b; p = p + g*(-lr). Weight decay, momentum
// (none, first step, later step) and nesterov are compile-time variants of the body, so the
// vector loop carries no per-vector branch.
#pragma once

#include "optim/tile.h"

namespace zk::cpu::optim {

// MOM: 0 no momentum, 1 momentum (first step: b = g), 2 momentum (b = b*momentum + g*(1-d)).
template <class V, int MOM, bool WD, bool NEST>
struct SgdBody {
  using F = typename V::F;
  F wd, mom, omd, nlr;
  // c: weight_decay, momentum, 1-dampening, -lr, first_step, nesterov (zkernels/optimizers)
  ZK_SIMD_INLINE explicit SgdBody(const float* c)
      : wd(V::set1(c[0])), mom(V::set1(c[1])), omd(V::set1(c[2])), nlr(V::set1(c[3])) {}
  template <class S>
  ZK_SIMD_INLINE void operator()(F g, F& p, const S& s) const {
    if constexpr (WD) g = V::add(g, V::mul(p, wd));
    if constexpr (MOM > 0) {
      F b = g;
      if constexpr (MOM == 2) b = V::add(V::mul(s.load(0), mom), V::mul(g, omd));
      s.store(0, b);
      g = NEST ? V::add(g, V::mul(b, mom)) : b;
    }
    p = V::add(p, V::mul(g, nlr));
  }
};

struct Sgd : KindDefaults {
  static constexpr const char* kName = "sgd";
  static constexpr const char* kStates[] = {"momentum_buffer"};
  static constexpr int kNumCoeffs = 6;
  static bool needs_state(int, const double* c) { return c[1] != 0.0; }
  static void check(const double* c) {
    require(c[1] >= 0.0, "momentum must be >= 0, got " + std::to_string(c[1]));
    require(c[5] == 0.0 || (c[1] > 0.0 && c[2] == 1.0),
            "nesterov needs momentum > 0 and dampening == 0");
  }
  template <class V, int MOM, bool WD, class Run>
  static ZK_SIMD_INLINE void with_nesterov(const Kernel& k, Run&& run) {
    if (MOM > 0 && k.cd[5] != 0.0) return run(SgdBody<V, MOM, WD, true>(k.c));
    run(SgdBody<V, MOM, WD, false>(k.c));
  }
  template <class V, bool WD, class Run>
  static ZK_SIMD_INLINE void with_momentum(const Kernel& k, Run&& run) {
    if (k.cd[1] == 0.0) return run(SgdBody<V, 0, WD, false>(k.c));
    if (k.cd[4] != 0.0) return with_nesterov<V, 1, WD>(k, run);
    with_nesterov<V, 2, WD>(k, run);
  }
  template <class V, class Run>
  static ZK_SIMD_INLINE void with_body(const Kernel& k, Run&& run) {
    if (k.cd[0] != 0.0) return with_momentum<V, true>(k, run);
    with_momentum<V, false>(k, run);
  }
};

}  // namespace zk::cpu::optim
