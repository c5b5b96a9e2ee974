// The registered kinds of csrc/optim: each is one tile-body header and one entry of
// ZK_OPTIMIZERS (its struct in zk::cpu::optim: kName, kStates, kNumCoeffs, needs_state, check,
// with_body). Included after one ISA's vector traits (csrc/simd/path.cpp, optimizer.cpp).
#pragma once

#include "optim/ademamix.h"
#include "optim/lion.h"
#include "optim/sgd.h"

#define ZK_OPTIMIZERS(X) X(Lion) X(Sgd) X(AdEMAMix)
