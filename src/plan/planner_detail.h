// planner_detail.h — what the planner's search (planner.cpp) and its measurements
// (plan_costs.cpp) share. Private to the plan layer.
#pragma once

#include "actmem/config/activation_plan.h"
#include "actmem/config/config.h"
#include "actmem/config/strategy.h"
#include "actmem/plan/planner.h"

#include <cstdint>
#include <string>
#include <vector>

namespace actmem::plan_detail {

/// Timed steps of the plain step alone (Note [Machine speed check] in plan_costs.cpp).
constexpr int kSpeedCheckSteps = 5;

/// Whether make_activation_plan() accepts `c`.
bool accepted(const TransformerConfig& c);

/// The model a strategy's backward transient is measured on, and the key of that measurement
/// (Note [Planner]): the last layers with the same per-layer plan, at most three of them.
struct Tail {
  std::string key;
  TransformerConfig probe;
};
Tail tail_of(const TransformerConfig& base, const Strategy& s);

/// The costs' keys of what an offload group moves under a selective set, and of layer-level
/// offload of K layers (Note [Offloaded bytes] in planner.cpp).
std::string offload_key(const std::vector<RecomputeModule>& recompute, const std::string& group);
std::string offload_key(const std::vector<RecomputeModule>& recompute, OffloadModule group);
std::string layer_offload_key(int64_t k);

/// `s` without the offload groups that move nothing under its selective set: the same memory as
/// `s`, so its tail is measured once for both (where dropping them leaves a legal strategy).
Strategy moving_groups(const TransformerConfig& base, const Strategy& s, const PlanCosts& costs);

/// Training settings of one measured step: one micro-batch, no validation.
TrainingConfig probe_training(TrainingConfig t, const TransformerConfig& model, int64_t steps);

}  // namespace actmem::plan_detail
