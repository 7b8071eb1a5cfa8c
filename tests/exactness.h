// exactness.h — the project's exactness check: a strategy trains bitwise like the plain run.
#pragma once

#include "actmem/base/compat.h"
#include "actmem/config/activation_plan.h"
#include "actmem/memory/ledger.h"
#include "actmem/memory/memory_model.h"
#include "actmem/model/activation_bytes.h"
#include "actmem/recompute/recompute.h"
#include "actmem/train/mixed_precision.h"
#include "actmem/train/trainer.h"
#include "fixtures.h"
#include "test_util.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <tuple>
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

/// What expect_bitwise_equal_training compares, recorded from one run: each step's stats,
/// default-generator states and gradients, and the parameters (and fp32 main parameters) after
/// the last step.
struct TrainingRecord {
  struct Step {
    IterationStats stats;
    std::vector<at::Tensor> rng_state, gradients;
  };
  std::vector<Step> steps;
  std::vector<std::string> names;  // the parameters', in the gradients' order
  std::vector<at::Tensor> params, main_params;
  bool mixed_precision = false;
};

inline std::vector<at::Tensor> clones(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) out.push_back(t.defined() ? t.clone() : t);
  return out;
}

/// Trains `trainer` for `steps` optimizer steps and records them.
inline TrainingRecord record_training(Trainer& trainer, int steps) {
  TrainingRecord r;
  for (int step = 1; step <= steps; ++step) {
    TrainingRecord::Step s;
    s.stats = trainer.train_step();
    s.rng_state = clones(trainer.rng_state());
    s.gradients = clones(trainer.gradients());
    r.steps.push_back(std::move(s));
  }
  for (const auto& p : trainer.model().named_parameters()) r.names.push_back(p.key());
  r.params = clones(trainer.model().ordered_parameters());
  r.mixed_precision = trainer.mixed_precision() != nullptr;
  if (r.mixed_precision) r.main_params = clones(trainer.mixed_precision()->main_params());
  return r;
}

/// Steps `candidate` for as many optimizer steps as `reference` recorded and expects, at every
/// step, bitwise-equal losses, gradient norms, gradient digests and default-generator states,
/// and bitwise-equal parameters at the end. On a digest mismatch it names the parameters whose
/// gradients differ and stops. `per_step` sees the candidate's stats of each step.
inline void expect_bitwise_equal_training(
    const TrainingRecord& reference, Trainer& candidate,
    const std::function<void(const IterationStats&)>& per_step = nullptr) {
  int applied = 0;  // steps the reference did not skip
  for (size_t i = 0; i < reference.steps.size(); ++i) {
    const int step = static_cast<int>(i) + 1;
    const TrainingRecord::Step& ref = reference.steps[i];
    const IterationStats& a = ref.stats;
    const auto b = candidate.train_step();
    applied += a.skipped ? 0 : 1;
    EXPECT_EQ(a.loss, b.loss) << "step " << step;
    if (!(std::isnan(a.grad_norm) && std::isnan(b.grad_norm))) {  // NaN: both skipped
      EXPECT_EQ(a.grad_norm, b.grad_norm) << "step " << step;
    }
    EXPECT_EQ(a.grad_digest, b.grad_digest) << "step " << step;
    ASSERT_EQ(ref.rng_state.size(), candidate.rng_state().size());
    for (size_t g = 0; g < ref.rng_state.size(); ++g) {
      EXPECT_TRUE(bitwise_equal(ref.rng_state[g], candidate.rng_state()[g]))
          << "default generator differs after step " << step;
    }
    if (per_step) per_step(b);
    EXPECT_EQ(a.skipped, b.skipped) << "step " << step;
    if (a.grad_digest != b.grad_digest) {
      const auto& gb = candidate.gradients();
      for (size_t p = 0; p < ref.gradients.size() && p < gb.size(); ++p) {
        if (!bitwise_equal(ref.gradients[p], gb[p])) {
          ADD_FAILURE() << "step " << step << ": gradient of " << reference.names[p] << " differs";
        }
      }
      return;
    }
  }
  // A comparison of skipped steps only would compare no update (fp16 from too high a scale).
  EXPECT_GT(applied, 0) << "every step was skipped: lower the initial loss scale";
  const auto pb = candidate.model().ordered_parameters();
  ASSERT_EQ(reference.params.size(), pb.size());
  for (size_t i = 0; i < pb.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(reference.params[i], pb[i])) << "param " << i;
  }
  // At 16 bits the fp32 main parameters the optimizer steps must agree as well.
  ASSERT_EQ(reference.mixed_precision, candidate.mixed_precision() != nullptr);
  if (reference.mixed_precision) {
    const auto& mb = candidate.mixed_precision()->main_params();
    for (size_t i = 0; i < mb.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(reference.main_params[i], mb[i])) << "main param " << i;
    }
  }
}

/// The same with a reference run trained here: `reference` for `steps` steps, then `candidate`.
inline void expect_bitwise_equal_training(
    Trainer& reference, Trainer& candidate, int steps,
    const std::function<void(const IterationStats&)>& per_step = nullptr) {
  expect_bitwise_equal_training(record_training(reference, steps), candidate, per_step);
}

/// Note [One plain run per configuration]
/// The exactness suites compare many strategies against the plain run of the same model,
/// precision and training configuration. That run is recorded once per process and reused: the
/// key is the whole of both configurations (to_json) and the step count, so a strategy is never
/// compared against another model's plain run. A Trainer's randomness is its own (it swaps its
/// generator states in and out), so a record made in an earlier test is the run this test would
/// make.
inline void expect_bitwise_equal_to_plain(
    const TransformerConfig& plain, const TrainingConfig& training, Trainer& candidate, int steps,
    const std::function<void(const IterationStats&)>& per_step = nullptr) {
  static std::map<std::string, std::shared_ptr<const TrainingRecord>> records;
  const std::string key =
      to_json(plain).dump() + to_json(training).dump() + "/" + std::to_string(steps);
  auto it = records.find(key);
  if (it == records.end()) {
    Trainer reference(plain, training);
    it =
        records
            .emplace(key, std::make_shared<const TrainingRecord>(record_training(reference, steps)))
            .first;
  }
  expect_bitwise_equal_training(*it->second, candidate, per_step);
}

/// A named edit of a configuration: a variant of a suite's model, or a strategy.
struct ConfigEdit {
  const char* name;
  void (*apply)(TransformerConfig&);
};
inline void PrintTo(const ConfigEdit& e, std::ostream* os) {
  *os << e.name;
}

/// One case of a layer kind's exactness suite: a variant of its model, a strategy, a precision.
using ExactnessCase = std::tuple<ConfigEdit, ConfigEdit, const char*>;

/// Every variant with every strategy at fp32, and at 16 bits for the variants named in
/// `sixteen_bit` (the others repeat the same paths).
template <typename Variants, typename Strategies>
std::vector<ExactnessCase> exactness_cases(const Variants& variants, const Strategies& strategies,
                                           std::initializer_list<std::string> sixteen_bit) {
  std::vector<ExactnessCase> out;
  for (const ConfigEdit& v : variants) {
    for (const ConfigEdit& s : strategies) {
      for (const char* p : kPrecisions) {
        if (std::string(p) == "fp32" ||
            std::find(sixteen_bit.begin(), sixteen_bit.end(), v.name) != sixteen_bit.end()) {
          out.emplace_back(v, s, p);
        }
      }
    }
  }
  return out;
}

/// The case's test name: variant_strategy_precision.
inline std::string exactness_case_name(const ::testing::TestParamInfo<ExactnessCase>& info) {
  return std::string(std::get<0>(info.param).name) + "_" + std::get<1>(info.param).name + "_" +
         std::get<2>(info.param);
}

/// What a suite adds to the shared case: edits of the plain and the strategy's configuration
/// after the case's (MoE's shared experts, Qwen3-Next's selective set), of the training, and a
/// check of each step's statistics.
struct ExactnessHooks {
  std::function<void(TransformerConfig& plain, TransformerConfig& strategy)> adjust;
  std::function<void(TrainingConfig&)> training;
  std::function<void(const IterationStats&)> per_step;
};

/// Note [One exactness harness]
/// Every layer kind's suite runs the same check: its model edited by the case's variant, at the
/// case's precision, two micro-batches per step, three steps under the case's strategy, bitwise
/// equal to the plain run of the same model (expect_bitwise_equal_to_plain: losses, gradient
/// norms and digests, the generators' states, the parameters); and the strategy must act — it
/// recomputed something, or (a plan without recompute) it offloaded bytes — so a strategy that
/// silently does nothing cannot pass.
inline void expect_strategy_exact(TransformerConfig model, const ExactnessCase& c,
                                  const ExactnessHooks& hooks = {}) {
  const auto& [variant, strategy, precision] = c;
  TrainingConfig t;
  set_precision(model, t, precision);
  variant.apply(model);
  TransformerConfig strat = model;
  strategy.apply(strat);
  if (hooks.adjust) hooks.adjust(model, strat);
  t.global_batch_size = 4;  // two micro-batches per step
  t.eval_interval = 0;
  if (hooks.training) hooks.training(t);
  Trainer other(strat, t);
  recompute_counters().reset();
  int64_t offloaded = 0;
  expect_bitwise_equal_to_plain(model, t, other, 3, [&](const IterationStats& s) {
    offloaded += s.offloaded_bytes;
    if (hooks.per_step) hooks.per_step(s);
  });
  const auto& rc = recompute_counters();
  if (make_activation_plan(strat).granularity == RecomputeGranularity::kNone) {
    EXPECT_GT(offloaded, 0) << "the strategy moved nothing";
  } else {
    EXPECT_GT(rc.recomputes.load() + rc.output_recomputes.load(), 0) << "nothing was recomputed";
  }
}

/// One training step of `c`: the exact predictor (given the step's MoE routing) equals the
/// tracker's activation bytes to the byte, and the trainer's own prediction; the activation
/// ledger agrees with it module by module (within one random-state snapshot: the ledger does not
/// count them).
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
  for (const auto& entry : ledger.bytes_by_module()) {
    const std::string& module = entry.first;  // a name, not a binding: the lambda captures it
    const auto bytes = entry.second;
    if (bytes == 0) continue;
    const auto it = std::find_if(predicted.by_module.begin(), predicted.by_module.end(),
                                 [&](const auto& p) { return p.first == module; });
    ASSERT_NE(it, predicted.by_module.end()) << what << ": ledger module " << module;
    EXPECT_LE(bytes, it->second) << what << " " << module;
    EXPECT_GE(bytes, it->second - checkpoint_snapshot_bytes()) << what << " " << module;
  }
}

}  // namespace actmem::testing
