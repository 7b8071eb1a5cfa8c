// plan_analytic.h — planning a model that cannot run here (`actmem plan --preset 7b`): the
// planner's search (planner.h) over the same Megatron flags, with the device peak from the
// paper's per-module activation terms and Megatron's weight and optimizer terms, and the step
// time from a stated roofline cost (docs/planner.md, "Paper presets").
//
// Note [Analytic plan]
// Per GPU of the first pipeline stage (the one holding the most micro-batches under 1F1B):
//   peak = weights, gradients and optimizer state (megatron_weight_and_optimizer_memory)
//        + the activations of the micro-batches in flight under the strategy, less what offload
//          moves to the host
//        + the backward transient (the largest rebuild or reload the backward adds at once).
// Activations are the paper's 16-bit terms per module of a layer (Korthikanti et al. 2022, §4.1,
// split as Megatron's modules save them), so plain, selective core_attn and full recompute sum
// to the paper's eqs. (1), (2), (4) and Megatron's compute_activation_memory. The step time of
// one micro-batch is a roofline: every GEMM at the device's achieved matmul rate, every
// element-wise op (norms, softmax, dropout, GeLU, bias-dropout-add) at its achieved memory
// bandwidth, the backward twice the forward; recompute adds the forward of what it rebuilds and
// offload adds the copy time its layer's compute cannot hide (max(0, bytes / link - window)).
// Tensor- and pipeline-parallel communication and the pipeline bubble are not counted: the
// ratio is against the plain step of the same layout, which pays them too (full recompute with
// t > 1 repeats the forward's collectives, which this under-counts: Korthikanti Table 4 measured
// 39% where the FLOPs say 33%).
#pragma once

#include "actmem/memory/memory_model.h"
#include "actmem/model/activation_bytes.h"
#include "actmem/plan/planner.h"

#include <nlohmann/json_fwd.hpp>

#include <string>
#include <vector>

namespace actmem {

/// A GPU's rates as the analytic cost uses them: achieved, not peak.
struct DeviceSpec {
  std::string name;
  double memory_bytes = 0;      // device memory (the default budget)
  double matmul_flops = 0;      // achieved 16-bit GEMM rate, FLOP/s
  double memory_bandwidth = 0;  // achieved device-memory bandwidth, bytes/s
  double d2h_bandwidth = 0;     // achieved host link, device to host, bytes/s
  double h2d_bandwidth = 0;     // host to device
  std::string source;           // where the numbers come from
  nlohmann::json to_json() const;
};

/// "a100", "h100", "h200", "gh200" (docs/planner.md lists the numbers and their sources).
/// Throws for another name, listing the known ones.
DeviceSpec device_spec(const std::string& name);
std::vector<std::string> device_spec_names();

/// `m` as a TransformerConfig (bf16, its parallel layout), for Megatron's validation rules:
/// throws with the configuration's message for a shape Megatron refuses.
TransformerConfig analytic_config(const PaperShape& m);

/// Every strategy make_activation_plan() accepts for `m` (planner.h's set, full recompute's N up
/// to one model chunk's layers, plus layer-level offload of K layers where Megatron allows it:
/// no pipeline parallelism). MoE and MLA shapes need the configuration paper_shape() keeps
/// (PaperShape::config): their modules (moe, moe_act, shared_experts, mla_up_proj, the expert
/// offload groups) apply as the configuration allows.
std::vector<Strategy> analytic_strategies(const PaperShape& m);

/// Weights, gradients and optimizer state of `m`'s most loaded rank: Megatron's terms from the
/// paper's shape (megatron_weight_and_optimizer_memory), or for a model the paper does not
/// describe from its configuration (config_weight_and_optimizer_memory).
WeightMemory analytic_weight_memory(const PaperShape& m);

/// What every strategy's prediction for `m` on `gpu` shares (Note [Analytic plan]).
struct AnalyticBasis {
  double static_bytes = 0;            // weights, gradients, optimizer state on the rank
  double microbatches_in_flight = 0;  // on the first stage (Megatron's interleave factor x p)
  double layers_per_stage = 0;
  double layer_forward_s = 0;  // one layer's forward, one micro-batch
  double plain_step_s = 0;     // one micro-batch's forward and backward on the stage
  nlohmann::json to_json() const;
};
AnalyticBasis analytic_basis(const PaperShape& m, const DeviceSpec& gpu);

/// The prediction for each strategy (analytic_strategies() of `m`) on `gpu`.
std::vector<PlanEstimate> estimate_plans_analytic(const PaperShape& m,
                                                  const std::vector<Strategy>& strategies,
                                                  const DeviceSpec& gpu);

}  // namespace actmem
