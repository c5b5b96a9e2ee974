// csrc/optim's entry point: the registry of kinds, the argument checks, the coefficients
// rounded once, and the step run through the tile driver on the chosen path.
#include "simd/scalar.h"  // the tile-body headers parse over one traits set; only their
                          // metadata is read here (the paths are csrc/simd/path.cpp's)
#include "optim/optimizer.h"

#include <cmath>
#include <iterator>
#include <stdexcept>
#include <string>

#include "optim/registry.h"
#include "parallel.h"
#include "simd/paths.h"

namespace zk::cpu {
namespace {

using optim::require;

struct Entry {
  OptimizerKind kind;
  bool (*needs_state)(int, const double*);
  void (*check)(const double*);
};

#define ZK_ENTRY(K)                                                                        \
  Entry{{optim::K::kName, static_cast<int>(std::size(optim::K::kStates)), optim::K::kStates, \
         optim::K::kNumCoeffs},                                                            \
        optim::K::needs_state, optim::K::check},
const Entry kEntries[] = {ZK_OPTIMIZERS(ZK_ENTRY)};
#undef ZK_ENTRY
constexpr int kNumKinds = static_cast<int>(std::size(kEntries));

#define ZK_KIND(K) OptimizerKind{optim::K::kName, static_cast<int>(std::size(optim::K::kStates)), \
                                 optim::K::kStates, optim::K::kNumCoeffs},
const OptimizerKind kKinds[] = {ZK_OPTIMIZERS(ZK_KIND)};
#undef ZK_KIND

int kind_index(const std::string& kind) {
  std::string names;
  for (int i = 0; i < kNumKinds; ++i) {
    if (kind == kEntries[i].kind.name) return i;
    names += (i ? ", " : "") + std::string(kEntries[i].kind.name);
  }
  throw std::invalid_argument("kind must be one of " + names + "; got '" + kind + "'");
}

}  // namespace

const OptimizerKind* optimizer_kinds(int* count) {
  *count = kNumKinds;
  return kKinds;
}

Isa optimizer_step(const std::string& kind, const StepBuffers& b, const double* coeffs,
                   int num_coeffs, double grad_scale, Isa isa, int num_threads) {
  const int index = kind_index(kind);
  const Entry& e = kEntries[index];
  require(num_coeffs == e.kind.num_coeffs,
          "coeffs must hold " + std::to_string(e.kind.num_coeffs) + " coefficients for " + kind +
              ", got " + std::to_string(num_coeffs));
  require(b.numel >= 0, "numel must be >= 0, got " + std::to_string(b.numel));
  if (b.numel > 0) {
    require(b.param != nullptr, "param must not be null");
    require(b.grad != nullptr, "grad must not be null");
    for (int j = 0; j < e.kind.num_states; ++j) {
      require(b.states[j] != nullptr || !e.needs_state(j, coeffs),
              std::string(e.kind.state_names[j]) + " (state " + std::to_string(j) + " of " +
                  kind + ") must not be null");
    }
  }
  e.check(coeffs);
  require(std::isfinite(grad_scale) && grad_scale > 0.0,
          "grad_scale must be finite and > 0, got " + std::to_string(grad_scale));
  isa = resolve_isa(isa);
  const int threads = tile_threads(num_threads, b.numel);
  if (b.numel == 0 || (b.found_inf != nullptr && *b.found_inf != 0.0f)) return isa;

  optim::Kernel k{};
  for (int i = 0; i < num_coeffs; ++i) {
    k.cd[i] = coeffs[i];
    k.c[i] = static_cast<float>(coeffs[i]);
  }
  k.inv_scale = static_cast<float>(1.0 / grad_scale);
  k.param = b.param;
  k.grad = b.grad;
  k.grad_dtype = b.grad_dtype;
  for (int j = 0; j < kMaxStates; ++j) k.states[j] = b.states[j];
  k.out = b.out;
  k.out_dtype = b.out_dtype;
  const optim::RangeFn fn = paths(isa).optim[index];
  for_ranges(b.numel, kTileNumel, threads, [&](int64_t b0, int64_t b1) { fn(k, b0, b1); });
  return isa;
}

}  // namespace zk::cpu
