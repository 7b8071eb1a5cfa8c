// activation_plan.h — the one resolved decision of what happens to every layer's activations:
// kept, recomputed (a full-recompute chunk, a selective module, an output-discarding norm),
// offloaded (a fine-grained module group, a whole layer) or distributed over tensor-parallel
// ranks.
//
// Note [One plan]
// TransformerConfig carries Megatron's flags as the user gave them (strings, optionals, lists).
// make_activation_plan() turns them into typed decisions once, applying Megatron's validation
// rules on the way; the model executes the plan, the exact memory predictor walks the same plan,
// and inspect, compare, train and the trainer print or read it. None of them re-derives a
// decision from the config, so the predictor cannot drift from the model (llm.c sizes its buffers
// and its memory model from one function for the same reason). Module names are spelled in the
// two tables below and nowhere else.
#pragma once

#include "actmem/config/config.h"

#include <nlohmann/json_fwd.hpp>

#include <array>
#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace actmem {

/// Megatron's --recompute-modules. mla_up_proj and gdn_norm_out are accepted by name so that
/// Megatron's messages for them can be given.
enum class RecomputeModule : uint8_t {
  kCoreAttn,
  kMlp,
  kLayernorm,
  kMoe,
  kMoeAct,
  kSharedExperts,
  kMlaUpProj,
  kGdnNormOut,
};
inline constexpr std::array<std::pair<RecomputeModule, std::string_view>, 8> kRecomputeModuleNames =
    {{
        {RecomputeModule::kCoreAttn, "core_attn"},
        {RecomputeModule::kMoeAct, "moe_act"},
        {RecomputeModule::kLayernorm, "layernorm"},
        {RecomputeModule::kMlaUpProj, "mla_up_proj"},
        {RecomputeModule::kMlp, "mlp"},
        {RecomputeModule::kMoe, "moe"},
        {RecomputeModule::kSharedExperts, "shared_experts"},
        {RecomputeModule::kGdnNormOut, "gdn_norm_out"},
    }};  // in Megatron's order (its error message lists them so)

/// Megatron's --offload-modules: the fine-grained offload groups. expert_fc1 and moe_act need
/// MoE layers.
enum class OffloadModule : uint8_t {
  kAttnNorm,
  kQkvLinear,
  kCoreAttn,
  kAttnProj,
  kMlpNorm,
  kExpertFc1,
  kMoeAct,
};
inline constexpr std::array<std::pair<OffloadModule, std::string_view>, 7> kOffloadModuleNames = {{
    {OffloadModule::kCoreAttn, "core_attn"},
    {OffloadModule::kAttnProj, "attn_proj"},
    {OffloadModule::kExpertFc1, "expert_fc1"},
    {OffloadModule::kMoeAct, "moe_act"},
    {OffloadModule::kAttnNorm, "attn_norm"},
    {OffloadModule::kMlpNorm, "mlp_norm"},
    {OffloadModule::kQkvLinear, "qkv_linear"},
}};  // in Megatron's order

/// The layers a selective module applies to (Megatron's: "mlp" recomputes dense layers' MLPs
/// only; "moe", "moe_act" and "shared_experts" MoE layers only — transformer_layer.py,
/// moe/moe_layer.py, moe/experts.py; core_attn and mla_up_proj live in the self-attention
/// modules, so a GatedDeltaNet layer has neither; gdn_norm_out lives in GatedDeltaNet —
/// ssm/gated_delta_net/common.py).
enum class RecomputeScope : uint8_t {
  kEveryLayer,
  kDenseLayers,
  kMoELayers,
  kAttentionLayers,
  kGdnLayers
};
constexpr RecomputeScope recompute_scope(RecomputeModule m) {
  switch (m) {
    case RecomputeModule::kMlp:
      return RecomputeScope::kDenseLayers;
    case RecomputeModule::kMoe:
    case RecomputeModule::kMoeAct:
    case RecomputeModule::kSharedExperts:
      return RecomputeScope::kMoELayers;
    case RecomputeModule::kCoreAttn:
    case RecomputeModule::kMlaUpProj:
      return RecomputeScope::kAttentionLayers;
    case RecomputeModule::kGdnNormOut:
      return RecomputeScope::kGdnLayers;
    default:
      return RecomputeScope::kEveryLayer;
  }
}
/// Whether `scope` includes a layer that is MoE (or dense) and GatedDeltaNet (or attention).
constexpr bool scope_includes(RecomputeScope scope, bool moe_layer, bool gdn_layer) {
  switch (scope) {
    case RecomputeScope::kDenseLayers:
      return !moe_layer;
    case RecomputeScope::kMoELayers:
      return moe_layer;
    case RecomputeScope::kAttentionLayers:
      return !gdn_layer;
    case RecomputeScope::kGdnLayers:
      return gdn_layer;
    default:
      return true;
  }
}

const char* to_string(RecomputeModule m);
const char* to_string(OffloadModule m);
/// The module names, from the tables above, joined by `sep` (help texts and error messages).
std::string recompute_module_list(std::string_view sep);
std::string offload_module_list(std::string_view sep);
std::optional<RecomputeModule> parse_recompute_module(std::string_view name);
std::optional<OffloadModule> parse_offload_module(std::string_view name);

enum class RecomputeGranularity : uint8_t { kNone, kFull, kSelective };
enum class RecomputeMethod : uint8_t { kNone, kUniform, kBlock };
const char* to_string(RecomputeGranularity g);
const char* to_string(RecomputeMethod m);

/// Layers [start, end) run inside one full-recompute checkpoint, which keeps only its input.
struct CheckpointChunk {
  int64_t start = 0, end = 0;
  bool operator==(const CheckpointChunk& o) const { return start == o.start && end == o.end; }
};

/// What one transformer layer does with the activations it saves.
struct LayerPlan {
  /// Index into ActivationPlan::chunks of the full-recompute chunk this layer runs in; -1 when
  /// it runs outside any checkpoint.
  int chunk = -1;
  bool starts_chunk = false;  // the chunk's first layer: the chunk's kept input is attributed here
  /// An MoE layer (config.moe_layers()): its MLP is a router, experts and shared experts.
  bool moe = false;
  /// A GatedDeltaNet layer (config.gdn_layers()): its self_attention is a GatedDeltaNet, which
  /// has no core_attn, qkv_linear or attn_proj to recompute or offload.
  bool gdn = false;
  /// Selective recompute inside the layer (never together with a chunk), per module of
  /// kRecomputeModuleNames where its scope (recompute_scope) includes this layer: core_attn
  /// keeps q, k, v; mlp, moe and shared_experts keep their input; layernorm frees both norms'
  /// outputs and rebuilds them in backward; moe_act, mla_up_proj and gdn_norm_out free their
  /// outputs and rebuild them from the next module's hook.
  std::array<bool, kRecomputeModuleNames.size()> recompute_module{};
  bool recomputes(RecomputeModule m) const { return recompute_module[static_cast<size_t>(m)]; }
  bool recomputes_any() const;
  // Offload.
  bool offload_layer = false;  // layer-level: everything the layer saves goes to the host
  /// Layer-level offload is on for the model: the layer opens a layer group even when it does
  /// not offload, so the backward reaching it can prefetch the layer before (Transformer
  /// Engine's CPU offload context wraps every layer the same way).
  bool layer_group = false;
  std::array<bool, kOffloadModuleNames.size()> offload_module{};  // fine-grained groups
  bool offloads(OffloadModule m) const { return offload_module[static_cast<size_t>(m)]; }
  bool in_chunk() const { return chunk >= 0; }
};

/// The resolved activation policy of a model (Note [One plan]).
struct ActivationPlan {
  RecomputeGranularity granularity = RecomputeGranularity::kNone;
  RecomputeMethod method = RecomputeMethod::kNone;
  int64_t recompute_num_layers = 0;                // 0 without full recompute
  std::vector<RecomputeModule> recompute_modules;  // selective targets, defaults resolved
  /// Full recompute: each chunk's kept input is this rank's 1/t share (tensor_parallel.h).
  bool distribute_saved_activations = false;
  int64_t cpu_offloading_num_layers = 0;       // layer-level offload of the first K layers
  std::vector<OffloadModule> offload_modules;  // fine-grained groups
  int64_t min_offloaded_tensor_size = 0;
  int64_t max_inflight_offloads = -1;
  std::vector<CheckpointChunk> chunks;  // full recompute, in forward order
  std::vector<LayerPlan> layers;        // one per transformer layer

  bool full_recompute() const { return granularity == RecomputeGranularity::kFull; }
  bool recomputes(RecomputeModule m) const;
  bool offloads(OffloadModule m) const;
  bool layer_offload() const { return cpu_offloading_num_layers > 0; }
  bool fine_grained_offload() const { return !offload_modules.empty(); }
  /// Any offload at all: the trainer needs an offloader.
  bool offloads() const { return layer_offload() || fine_grained_offload(); }
  /// One line: "recompute selective: core_attn mlp | offload none".
  std::string summary() const;
  nlohmann::json to_json() const;
};

/// Resolves `config`'s recompute and offload flags into a plan, applying Megatron's rules
/// (TransformerConfig.__post_init__ in megatron/core/transformer/transformer_config.py and
/// validate_args in megatron/training/arguments.py) in its order and with its messages; throws
/// c10::Error ("actmem::TransformerConfig: ...") for the first violation. Deliberate differences
/// are marked "fixed" or "refused" in activation_plan.cpp.
ActivationPlan make_activation_plan(const TransformerConfig& config);

/// The plan that keeps every activation of `config`'s model: its layers' kinds, no recompute or
/// offload (what the memory pre-check bounds a step by). Checks the shape only.
ActivationPlan keep_everything_plan(const TransformerConfig& config);

/// Throws unless `plan` can run on `config`'s model: one LayerPlan per layer, chunks in order
/// and matching the layers' chunk indices, no selective recompute or offload inside a chunk,
/// distribute_saved_activations only with chunks and t > 1. A plan need not come from
/// make_activation_plan(): a per-layer plan (a different selective module in each layer, say)
/// that no flag can express runs and is predicted alike.
void check_activation_plan(const TransformerConfig& config, const ActivationPlan& plan);

/// The plan per layer, as `actmem inspect --plan` prints it.
void print_activation_plan(std::ostream& os, const ActivationPlan& plan);

}  // namespace actmem
