// exactness.h — the project's exactness check: a strategy trains bitwise like the plain run.
#pragma once

#include "actmem/base/compat.h"
#include "actmem/memory/ledger.h"
#include "actmem/memory/memory_model.h"
#include "actmem/train/mixed_precision.h"
#include "actmem/train/trainer.h"
#include "fixtures.h"
#include "test_util.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

namespace actmem::testing {

/// Selective recompute of `modules` on `c`.
inline void selective(TransformerConfig& c, std::vector<std::string> modules) {
  c.recompute_granularity = "selective";
  c.recompute_modules = std::move(modules);
}

/// Fine-grained offload of `modules` on `c`, with a threshold low enough for the tests' tiny
/// tensors (64 elements).
inline void offload(TransformerConfig& c, std::vector<std::string> modules) {
  c.fine_grained_activation_offloading = true;
  c.offload_modules = std::move(modules);
  c.min_offloaded_tensor_size = 64;
}

/// Steps `reference` and `candidate` together for `steps` optimizer steps and expects, at every
/// step, bitwise-equal losses, gradient norms, gradient digests and default-generator states,
/// and bitwise-equal parameters at the end. On a digest mismatch it names the parameters whose
/// gradients differ and stops. `per_step` sees the candidate's stats of each step.
inline void expect_bitwise_equal_training(
    Trainer& reference, Trainer& candidate, int steps,
    const std::function<void(const IterationStats&)>& per_step = nullptr) {
  int applied = 0;  // steps the reference did not skip
  for (int step = 1; step <= steps; ++step) {
    const auto a = reference.train_step(), b = candidate.train_step();
    applied += a.skipped ? 0 : 1;
    EXPECT_EQ(a.loss, b.loss) << "step " << step;
    if (!(std::isnan(a.grad_norm) && std::isnan(b.grad_norm))) {  // NaN: both skipped
      EXPECT_EQ(a.grad_norm, b.grad_norm) << "step " << step;
    }
    EXPECT_EQ(a.grad_digest, b.grad_digest) << "step " << step;
    ASSERT_EQ(reference.rng_state().size(), candidate.rng_state().size());
    for (size_t g = 0; g < reference.rng_state().size(); ++g) {
      EXPECT_TRUE(bitwise_equal(reference.rng_state()[g], candidate.rng_state()[g]))
          << "default generator differs after step " << step;
    }
    if (per_step) per_step(b);
    EXPECT_EQ(a.skipped, b.skipped) << "step " << step;
    if (a.grad_digest != b.grad_digest) {
      const auto names = reference.model().named_parameters();
      const auto& ga = reference.gradients();
      const auto& gb = candidate.gradients();
      for (size_t i = 0; i < ga.size(); ++i) {
        if (!bitwise_equal(ga[i], gb[i])) {
          ADD_FAILURE() << "step " << step << ": gradient of " << names[i].key() << " differs";
        }
      }
      return;
    }
  }
  // A comparison of skipped steps only would compare no update (fp16 from too high a scale).
  EXPECT_GT(applied, 0) << "every step was skipped: lower the initial loss scale";
  const auto pa = reference.model().ordered_parameters();
  const auto pb = candidate.model().ordered_parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(bitwise_equal(pa[i], pb[i])) << "param " << i;
  // At 16 bits the fp32 main parameters the optimizer steps must agree as well.
  ASSERT_EQ(reference.mixed_precision() == nullptr, candidate.mixed_precision() == nullptr);
  if (reference.mixed_precision() != nullptr) {
    const auto& ma = reference.mixed_precision()->main_params();
    const auto& mb = candidate.mixed_precision()->main_params();
    for (size_t i = 0; i < ma.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(ma[i], mb[i])) << "main param " << i;
    }
  }
}


/// One training step of `c`: the exact predictor (given the step's MoE routing) equals the
/// tracker's activation bytes to the byte, and the trainer's own prediction; the activation
/// ledger agrees with it module by module (within one random-state snapshot: the ledger does not count them).
inline void expect_predictor_matches_tracker(const TransformerConfig& c, const std::string& what) {
  TrainingConfig t;
  t.eval_interval = 0;
  Trainer trainer(c, t);
  ActivationLedger ledger;
  trainer.set_ledger(&ledger);
  const auto st = trainer.train_step(false);
  const MoERouting routing = trainer.model().moe_stats().routing();
  const auto predicted = predict_activation_bytes(c, 0, true, &routing);
  EXPECT_EQ(st.predicted_activation_bytes, predicted.total) << what;
  EXPECT_EQ(predicted.total, st.activation_bytes) << what;
  for (const auto& [module, bytes] : ledger.bytes_by_module()) {
    if (bytes == 0) continue;
    const auto it = std::find_if(predicted.by_module.begin(), predicted.by_module.end(),
                                 [&](const auto& p) { return p.first == module; });
    ASSERT_NE(it, predicted.by_module.end()) << what << ": ledger module " << module;
    EXPECT_LE(bytes, it->second) << what << " " << module;
    EXPECT_GE(bytes, it->second - checkpoint_snapshot_bytes()) << what << " " << module;
  }
}

}  // namespace actmem::testing
