// activation_plan.cpp — make_activation_plan(): Megatron's recompute and offload rules, then the
// per-layer decisions (Note [One plan] in activation_plan.h).
#include "actmem/config/activation_plan.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <iomanip>
#include <ostream>
#include <sstream>

namespace actmem {

namespace {

template <typename Table>
std::string join_names(const Table& table) {
  std::ostringstream os;
  os << "{";
  for (size_t i = 0; i < table.size(); ++i) os << (i ? ", " : "") << "'" << table[i].second << "'";
  os << "}";
  return os.str();
}

// The names `keep` accepts, joined by `sep` (help texts: "core_attn mlp ...").
template <typename Table, typename Keep>
std::string names_joined(const Table& table, std::string_view sep, Keep keep) {
  std::string out;
  for (const auto& [value, name] : table) {
    if (!keep(value)) continue;
    if (!out.empty()) out += sep;
    out += name;
  }
  return out;
}

std::string join_set(const std::vector<std::string>& items) {
  std::ostringstream os;
  os << "{";
  for (size_t i = 0; i < items.size(); ++i) os << (i ? ", " : "") << "'" << items[i] << "'";
  os << "}";
  return os.str();
}

// Resolves `names` through `table` into `out` (in order, each once); returns the unknown ones.
template <typename Table, typename Enum>
std::vector<std::string> resolve_names(const std::vector<std::string>& names, const Table& table,
                                       std::vector<Enum>& out) {
  std::vector<std::string> unknown;
  for (const auto& n : names) {
    bool found = false;
    for (const auto& [e, name] : table) {
      if (name != n) continue;
      found = true;
      if (std::find(out.begin(), out.end(), e) == out.end()) out.push_back(e);
    }
    if (!found) unknown.push_back(n);
  }
  return unknown;
}

template <typename Table, typename Enum>
const char* name_in(const Table& table, Enum value) {
  for (const auto& [e, name] : table) {
    if (e == value) return name.data();
  }
  return "?";
}

template <typename Table>
auto parse_in(const Table& table, std::string_view name)
    -> std::optional<typename Table::value_type::first_type> {
  for (const auto& [e, n] : table) {
    if (n == name) return e;
  }
  return std::nullopt;
}

// The model's pieces in layer order: every pipeline stage's layers, or with the interleaved
// schedule every model chunk's (p v of them).
std::vector<TransformerConfig::StageLayers> model_pieces(const TransformerConfig& c) {
  std::vector<TransformerConfig::StageLayers> pieces;
  const int64_t v = c.virtual_pipeline_size();
  for (int64_t chunk = 0; chunk < v; ++chunk) {
    for (int64_t stage = 0; stage < c.pipeline_model_parallel_size; ++stage) {
      pieces.push_back(c.model_chunk_layers(stage, chunk));
    }
  }
  return pieces;
}

// Megatron silently ignores a module the model does not have (mlp on an all-MoE model, moe on a
// dense one); a user asking for one expects an effect, so it is refused here (fixed).
void check_modules_the_model_has(const TransformerConfig& c, const ActivationPlan& plan) {
  const std::vector<bool> moe = c.moe_layers();
  const bool any_moe = std::find(moe.begin(), moe.end(), true) != moe.end();
  const bool any_dense = std::find(moe.begin(), moe.end(), false) != moe.end();
  TORCH_CHECK(any_moe || (!plan.recomputes(RecomputeModule::kMoe) &&
                          !plan.recomputes(RecomputeModule::kMoeAct) &&
                          !plan.recomputes(RecomputeModule::kSharedExperts)),
              "actmem::TransformerConfig: moe, moe_act and shared_experts in recompute_modules "
              "need MoE layers, and this model is dense");
  TORCH_CHECK(!plan.recomputes(RecomputeModule::kSharedExperts) ||
                  c.moe_shared_expert_intermediate_size.has_value(),
              "actmem::TransformerConfig: shared_experts in recompute_modules needs shared experts "
              "(moe_shared_expert_intermediate_size)");
  TORCH_CHECK(any_dense || !plan.recomputes(RecomputeModule::kMlp),
              "actmem::TransformerConfig: "
              "mlp in recompute_modules applies to dense layers and every layer of this model is "
              "MoE; recompute the MoE layer with moe (or its parts with moe_act, shared_experts)");
  // Likewise a hybrid model whose every layer is GatedDeltaNet has no core attention (fixed).
  const std::vector<bool> gdn = c.gdn_layers();
  TORCH_CHECK(!c.gated_delta_net() || std::find(gdn.begin(), gdn.end(), true) != gdn.end() ||
                  !plan.recomputes(RecomputeModule::kGdnNormOut),
              "actmem::TransformerConfig: gdn_norm_out in recompute_modules applies to "
              "GatedDeltaNet layers and this model has none (linear_attention_freq ",
              c.linear_attention_freq, ")");
  TORCH_CHECK(std::find(gdn.begin(), gdn.end(), false) != gdn.end() ||
                  !plan.recomputes(RecomputeModule::kCoreAttn),
              "actmem::TransformerConfig: core_attn in recompute_modules applies to standard "
              "attention layers and every layer of this model is GatedDeltaNet; recompute its "
              "output norm with gdn_norm_out");
}

// Megatron's recompute rules for a dense model (the recompute checks of TransformerConfig's
// __post_init__ in megatron/core/transformer/transformer_config.py, then those of validate_args in
// megatron/training/arguments.py), in its order and with its conditions; deliberate differences
// are marked "fixed" or "refused". Fills the recompute half of `plan`.
void resolve_recompute(const TransformerConfig& c, ActivationPlan& plan) {
  const std::string& g = c.recompute_granularity;
  if (!g.empty()) {
    TORCH_CHECK(g == "full" || g == "selective",
                "actmem::TransformerConfig: recompute_granularity: ", g,
                " must be \"full\" or \"selective\".");
    TORCH_CHECK(c.recompute_method.empty() || c.recompute_method == "block" ||
                    c.recompute_method == "uniform",
                "actmem::TransformerConfig: recompute_method: ", c.recompute_method,
                " must be \"block\" or \"uniform\".");
    plan.granularity = g == "full" ? RecomputeGranularity::kFull : RecomputeGranularity::kSelective;
    // A model chunk's layers (a stage's without interleaving): Megatron's TransformerBlock counts
    // len(self.layers), one chunk's, as num_layers_per_pipeline_rank. With an uneven split the
    // largest chunk's (n is clamped to a smaller chunk's layers there).
    int64_t per_stage = 0;
    for (const auto& piece : model_pieces(c)) per_stage = std::max(per_stage, piece.count);
    if (plan.granularity == RecomputeGranularity::kFull) {
      TORCH_CHECK(!c.recompute_method.empty(),
                  "actmem::TransformerConfig: Using "
                  "recompute_granularity: full so recompute_method must be \"block\" or "
                  "\"uniform\"");
      // Megatron only checks for None; the range is checked here too (fixed).
      TORCH_CHECK(c.recompute_num_layers.has_value() && *c.recompute_num_layers >= 1 &&
                      *c.recompute_num_layers <= per_stage,
                  "actmem::TransformerConfig: When using recompute_granularity: full, "
                  "recompute_num_layers must be between 1 and num_layers_per_pipeline_rank: ",
                  per_stage,
                  (c.recompute_num_layers ? ", got " + std::to_string(*c.recompute_num_layers)
                                          : std::string(", got none")));
      plan.method =
          c.recompute_method == "uniform" ? RecomputeMethod::kUniform : RecomputeMethod::kBlock;
      plan.recompute_num_layers = *c.recompute_num_layers;
    } else {
      TORCH_CHECK(!c.recompute_num_layers.has_value(),
                  "actmem::TransformerConfig: When using "
                  "recompute_granularity: selective, recompute_num_layers must be None.");
      TORCH_CHECK(c.recompute_method.empty(),
                  "actmem::TransformerConfig: recompute method is not "
                  "yet supported for selective recomputing granularity");
    }
    TORCH_CHECK(
        !(c.distribute_saved_activations && c.sequence_parallel),
        "actmem::TransformerConfig: distribute_saved_activations: ", c.distribute_saved_activations,
        " must be false when sequence parallel is enabled: ", c.sequence_parallel);
  }
  if (c.distribute_saved_activations) {
    TORCH_CHECK(c.tensor_model_parallel_size > 1,
                "actmem::TransformerConfig: "
                "distribute_saved_activations requires tensor_model_parallel_size > 1, got ",
                c.tensor_model_parallel_size);
    TORCH_CHECK(plan.full_recompute() && !c.recompute_method.empty(),
                "actmem::TransformerConfig: "
                "distribute_saved_activations requires recompute_granularity full with a "
                "recompute_method");
    plan.distribute_saved_activations = true;
  }
  if (plan.granularity == RecomputeGranularity::kSelective) {
    const std::vector<std::string> names =
        c.recompute_modules.value_or(std::vector<std::string>{"core_attn"});  // Megatron's default
    const auto invalid = resolve_names(names, kRecomputeModuleNames, plan.recompute_modules);
    TORCH_CHECK(invalid.empty(),
                "actmem::TransformerConfig: Invalid choices for "
                "recompute_modules: ",
                join_set(invalid), ". Allowed modules are: ", join_names(kRecomputeModuleNames));
    TORCH_CHECK(!plan.recomputes(RecomputeModule::kMoeAct) || c.moe_grouped_gemm,
                "actmem::TransformerConfig: moe_act in recompute_modules is only supported with "
                "moe_grouped_gemm.");
    TORCH_CHECK(!plan.recomputes(RecomputeModule::kMlaUpProj) || c.multi_latent_attention,
                "actmem::TransformerConfig: mla_up_proj in recompute_modules is only supported "
                "with multi_latent_attention.");
    TORCH_CHECK(!plan.recomputes(RecomputeModule::kGdnNormOut) || c.gated_delta_net(),
                "actmem::TransformerConfig: gdn_norm_out in recompute_modules is only supported "
                "with experimental_attention_variant='gdn' or 'gdn2'.");
    // TransformerConfig.__post_init__: an output-discarding recompute feeding an FP8 GEMM makes
    // the GEMM keep its 16-bit input and quantize it again in the backward, which only a
    // current-scaling recipe reproduces (docs/fp8.md).
    TORCH_CHECK(c.fp8.empty() || c.fp8_recipe != "delayed" ||
                    !(plan.recomputes(RecomputeModule::kMoeAct) ||
                      plan.recomputes(RecomputeModule::kLayernorm)),
                "actmem::TransformerConfig: Delayed scaling does not support moe_act and "
                "layernorm recompute for fp8.");
  } else {
    TORCH_CHECK(!c.recompute_modules.has_value(),
                "actmem::TransformerConfig: recompute_modules "
                "only applies to recompute_granularity selective (got granularity \"",
                g, "\")");
  }
  // Rule 18 of validate_args (after the others, so the appended "moe" is not re-validated): the
  // deprecated --moe-layer-recompute forces selective granularity and adds "moe" to the modules,
  // which default to core_attn as always (so it recomputes core_attn and moe, as in Megatron).
  if (c.moe_layer_recompute) {
    TORCH_CHECK(plan.granularity != RecomputeGranularity::kFull,
                "actmem::TransformerConfig: Do "
                "not set --moe-layer-recompute with full recompute granularity.");
    if (plan.granularity == RecomputeGranularity::kNone) {
      plan.granularity = RecomputeGranularity::kSelective;
      plan.recompute_modules = {RecomputeModule::kCoreAttn};
    }
    if (!plan.recomputes(RecomputeModule::kMoe))
      plan.recompute_modules.push_back(RecomputeModule::kMoe);
  }
  check_modules_the_model_has(c, plan);
}

// The in-flight cap of offload copies (Megatron's fine_grained_offloading_max_inflight_offloads),
// checked for either kind of offload.
int64_t inflight_cap(const TransformerConfig& c) {
  TORCH_CHECK(c.fine_grained_offloading_max_inflight_offloads >= -1,
              "actmem::TransformerConfig: fine_grained_offloading_max_inflight_offloads must be "
              ">= 0 (or -1 for no cap), got ",
              c.fine_grained_offloading_max_inflight_offloads);
  return c.fine_grained_offloading_max_inflight_offloads;
}

// Megatron's layer-level offload rules (the cpu_offloading checks of TransformerConfig's
// __post_init__, megatron/core/transformer/transformer_config.py; as in validate_args,
// megatron/training/arguments.py, cpu_offloading_num_layers K > 0 turns offloading on).
void resolve_layer_offload(const TransformerConfig& c, ActivationPlan& plan) {
  if (c.cpu_offloading_num_layers != 0) {
    TORCH_CHECK(c.cpu_offloading_num_layers > 0 && c.cpu_offloading_num_layers < c.num_layers,
                "actmem::TransformerConfig: CPU offloading can be done only for layers less than ",
                c.num_layers, " (cpu_offloading_num_layers = ", c.cpu_offloading_num_layers, ")");
    TORCH_CHECK(c.pipeline_model_parallel_size == 1,
                "actmem::TransformerConfig: Currently there "
                "is no support for Pipeline parallelism with CPU offloading");
    TORCH_CHECK(c.recompute_granularity.empty(),
                "actmem::TransformerConfig: CPU offloading does "
                "not work when activation recomputation is enabled");
    plan.cpu_offloading_num_layers = c.cpu_offloading_num_layers;
    // Our extension: Megatron's in-flight cap is a fine-grained setting (Transformer Engine's
    // CPU offload context has none), and with no cap a layer's device copy is released whenever
    // the copy thread finishes it, so the step's peak depends on thread timing. With the cap each
    // layer's commit waits for the copies beyond it (0: its own), and the peak is deterministic,
    // which is what `actmem plan` predicts (docs/offload.md, docs/planner.md).
    plan.max_inflight_offloads = inflight_cap(c);
  }
  TORCH_CHECK(c.min_offloaded_tensor_size >= 0,
              "actmem::TransformerConfig: "
              "min_offloaded_tensor_size must be >= 0, got ",
              c.min_offloaded_tensor_size);
  plan.min_offloaded_tensor_size = c.min_offloaded_tensor_size;
}

// Megatron's fine-grained offload rules (the fine-grained offloading checks of validate_args in
// megatron/training/arguments.py) and the exclusions with recompute; deliberate differences are
// marked. Runs after resolve_recompute (it reads the recompute decisions).
void resolve_fine_grained_offload(const TransformerConfig& c, ActivationPlan& plan) {
  if (!c.fine_grained_activation_offloading) {
    TORCH_CHECK(c.offload_modules.empty(),
                "actmem::TransformerConfig: offload_modules only "
                "applies with fine_grained_activation_offloading");
    return;
  }
  TORCH_CHECK(c.cpu_offloading_num_layers == 0,
              "actmem::TransformerConfig: "
              "fine_grained_activation_offloading cannot be enabled with cpu_offloading.");
  TORCH_CHECK(!c.offload_modules.empty(),
              "actmem::TransformerConfig: offload_modules must name "
              "at least one module when fine_grained_activation_offloading is on");
  const auto invalid = resolve_names(c.offload_modules, kOffloadModuleNames, plan.offload_modules);
  TORCH_CHECK(invalid.empty(),
              "actmem::TransformerConfig: Invalid choices for offload_modules: ", join_set(invalid),
              ". Allowed modules are: ", join_names(kOffloadModuleNames));
  const bool expert_groups =
      plan.offloads(OffloadModule::kExpertFc1) || plan.offloads(OffloadModule::kMoeAct);
  if (expert_groups) {
    const std::vector<bool> moe = c.moe_layers();
    TORCH_CHECK(std::find(moe.begin(), moe.end(), true) != moe.end(),
                "actmem::TransformerConfig: "
                "expert_fc1 and moe_act in offload_modules need MoE layers, and this model is "
                "dense");
    // Megatron places both groups in TEGroupedMLP's forward (megatron/core/transformer/moe/
    // experts.py); one MLP per expert has no single fc1 input or activation to offload.
    TORCH_CHECK(c.moe_grouped_gemm,
                "actmem::TransformerConfig: expert_fc1 and moe_act in "
                "offload_modules need the grouped experts (--moe-grouped-gemm)");
    // Inside a recomputed MoE layer nothing is kept until backward, so there is nothing to move.
    TORCH_CHECK(!plan.recomputes(RecomputeModule::kMoe),
                "actmem::TransformerConfig: expert_fc1 "
                "and moe_act cannot be offloaded when moe recomputes the whole MoE layer: remove "
                "them from offload_modules or moe from recompute_modules");
  }
  TORCH_CHECK(!plan.offloads(OffloadModule::kAttnProj) || plan.offloads(OffloadModule::kCoreAttn),
              "actmem::TransformerConfig: attn_proj cannot be set to offload_modules alone "
              "without core_attn because the input of attn_proj is the output of core_attn, which "
              "is needed in core_attn.backward().");
  // Megatron silently skips core_attn offload when core_attn is recomputed; refused here.
  TORCH_CHECK(
      !(plan.offloads(OffloadModule::kCoreAttn) && plan.recomputes(RecomputeModule::kCoreAttn)),
      "actmem::TransformerConfig: core_attn cannot be both offloaded and recomputed: "
      "remove it from offload_modules or from recompute_modules");
  // Our restriction: whole-layer checkpoints and module offload groups do not compose here.
  TORCH_CHECK(!plan.full_recompute(),
              "actmem::TransformerConfig: "
              "fine_grained_activation_offloading works with selective recompute only, not with "
              "recompute_granularity full");
  plan.max_inflight_offloads = inflight_cap(c);
}

// Megatron's _checkpointed_forward (megatron/core/transformer/transformer_block.py): uniform =
// chunks of n layers, the last clamped; block = the first n layers, one checkpoint each. It runs
// on each pipeline stage's own layers, so with pipeline parallelism n counts the stage's layers
// (uniform chunks restart at every stage, block takes the first n of every stage); with the
// interleaved schedule each model chunk is a TransformerBlock of its own and n counts its layers.
std::vector<CheckpointChunk> checkpoint_chunks(const ActivationPlan& plan,
                                               const TransformerConfig& c) {
  std::vector<CheckpointChunk> chunks;
  const int64_t n = plan.recompute_num_layers;
  for (const auto& [first, count] : model_pieces(c)) {
    const int64_t end = first + count;
    if (plan.method == RecomputeMethod::kUniform) {
      for (int64_t i = first; i < end; i += n) chunks.push_back({i, std::min(i + n, end)});
    } else if (plan.method == RecomputeMethod::kBlock) {
      for (int64_t i = first; i < std::min(first + n, end); ++i) chunks.push_back({i, i + 1});
    }
  }
  return chunks;
}

}  // namespace

const char* to_string(RecomputeModule m) {
  return name_in(kRecomputeModuleNames, m);
}

std::string recompute_module_list(std::string_view sep) {
  return names_joined(kRecomputeModuleNames, sep, [](RecomputeModule) { return true; });
}
std::string offload_module_list(std::string_view sep) {
  return names_joined(kOffloadModuleNames, sep, [](OffloadModule) { return true; });
}
const char* to_string(OffloadModule m) {
  return name_in(kOffloadModuleNames, m);
}
std::optional<RecomputeModule> parse_recompute_module(std::string_view name) {
  return parse_in(kRecomputeModuleNames, name);
}
std::optional<OffloadModule> parse_offload_module(std::string_view name) {
  return parse_in(kOffloadModuleNames, name);
}

const char* to_string(RecomputeGranularity g) {
  switch (g) {
    case RecomputeGranularity::kNone:
      return "none";
    case RecomputeGranularity::kFull:
      return "full";
    case RecomputeGranularity::kSelective:
      return "selective";
  }
  return "?";
}

const char* to_string(RecomputeMethod m) {
  switch (m) {
    case RecomputeMethod::kNone:
      return "none";
    case RecomputeMethod::kUniform:
      return "uniform";
    case RecomputeMethod::kBlock:
      return "block";
  }
  return "?";
}

bool ActivationPlan::recomputes(RecomputeModule m) const {
  return std::find(recompute_modules.begin(), recompute_modules.end(), m) !=
         recompute_modules.end();
}

bool LayerPlan::recomputes_any() const {
  return std::any_of(recompute_module.begin(), recompute_module.end(), [](bool on) { return on; });
}

bool ActivationPlan::offloads(OffloadModule m) const {
  return std::find(offload_modules.begin(), offload_modules.end(), m) != offload_modules.end();
}

ActivationPlan keep_everything_plan(const TransformerConfig& c) {
  c.validate_shape();
  ActivationPlan plan;
  const std::vector<bool> moe = c.moe_layers(), gdn = c.gdn_layers();
  plan.layers.resize(static_cast<size_t>(c.num_layers));
  for (size_t i = 0; i < plan.layers.size(); ++i) {
    plan.layers[i].moe = moe[i];
    plan.layers[i].gdn = gdn[i];
  }
  return plan;
}

ActivationPlan make_activation_plan(const TransformerConfig& c) {
  c.validate_shape();
  ActivationPlan plan;
  resolve_layer_offload(c, plan);
  resolve_recompute(c, plan);
  resolve_fine_grained_offload(c, plan);
  plan.chunks = checkpoint_chunks(plan, c);
  plan.layers.resize(static_cast<size_t>(c.num_layers));
  for (size_t k = 0; k < plan.chunks.size(); ++k) {
    for (int64_t i = plan.chunks[k].start; i < plan.chunks[k].end; ++i) {
      plan.layers[static_cast<size_t>(i)].chunk = static_cast<int>(k);
    }
    plan.layers[static_cast<size_t>(plan.chunks[k].start)].starts_chunk = true;
  }
  const std::vector<bool> moe = c.moe_layers(), gdn = c.gdn_layers();
  for (size_t i = 0; i < plan.layers.size(); ++i) {
    LayerPlan& layer = plan.layers[i];
    layer.moe = moe[i];
    layer.gdn = gdn[i];
    for (const RecomputeModule m : plan.recompute_modules) {
      layer.recompute_module[static_cast<size_t>(m)] =
          scope_includes(recompute_scope(m), layer.moe, layer.gdn);
    }
    for (const auto m : plan.offload_modules) {
      const bool expert = m == OffloadModule::kExpertFc1 || m == OffloadModule::kMoeAct;
      // qkv_linear, core_attn and attn_proj are self-attention's groups (Megatron's
      // attention.py); a GatedDeltaNet layer has only the norms' groups.
      const bool attention = m == OffloadModule::kQkvLinear || m == OffloadModule::kCoreAttn ||
                             m == OffloadModule::kAttnProj;
      layer.offload_module[static_cast<size_t>(m)] =
          (!expert || layer.moe) && (!attention || !layer.gdn);
    }
    layer.layer_group = plan.layer_offload();
    layer.offload_layer = static_cast<int64_t>(i) < plan.cpu_offloading_num_layers;
  }
  check_activation_plan(c, plan);
  return plan;
}

void check_activation_plan(const TransformerConfig& c, const ActivationPlan& plan) {
  const char* api = "actmem::check_activation_plan: ";
  TORCH_CHECK(plan.layers.size() == static_cast<size_t>(c.num_layers), api, "the plan has ",
              plan.layers.size(), " layers, the model ", c.num_layers);
  int64_t next = 0;
  for (size_t k = 0; k < plan.chunks.size(); ++k) {
    const CheckpointChunk& chunk = plan.chunks[k];
    TORCH_CHECK(chunk.start >= next && chunk.start < chunk.end && chunk.end <= c.num_layers, api,
                "chunk ", k, " [", chunk.start, ", ", chunk.end,
                ") is empty, overlaps the one "
                "before or runs past layer ",
                c.num_layers);
    for (int64_t i = chunk.start; i < chunk.end; ++i) {
      const LayerPlan& l = plan.layers[static_cast<size_t>(i)];
      TORCH_CHECK(l.chunk == static_cast<int>(k) && l.starts_chunk == (i == chunk.start), api,
                  "layer ", i, " does not say it runs in chunk ", k);
    }
    for (const auto& layers : model_pieces(c)) {
      TORCH_CHECK(layers.contains(chunk.start) == layers.contains(chunk.end - 1), api, "chunk ", k,
                  " [", chunk.start, ", ", chunk.end,
                  ") crosses the boundary of the pipeline "
                  "stage (or model chunk) of layers ",
                  layers.offset, "..", layers.offset + layers.count - 1);
    }
    next = chunk.end;
  }
  const std::vector<bool> moe = c.moe_layers(), gdn = c.gdn_layers();
  for (size_t i = 0; i < plan.layers.size(); ++i) {
    const LayerPlan& l = plan.layers[i];
    const bool selective = l.recomputes_any();
    TORCH_CHECK(l.gdn == gdn[i], api, "layer ", i, " is ",
                gdn[i] ? "a GatedDeltaNet"
                       : "an "
                         "attention",
                " layer but its plan says otherwise");
    TORCH_CHECK(
        !l.gdn ||
            (!l.recomputes(RecomputeModule::kCoreAttn) && !l.offloads(OffloadModule::kQkvLinear) &&
             !l.offloads(OffloadModule::kCoreAttn) && !l.offloads(OffloadModule::kAttnProj)),
        api, "layer ", i,
        " is a GatedDeltaNet layer: it has no core_attn, qkv_linear or "
        "attn_proj");
    TORCH_CHECK(l.gdn || !l.recomputes(RecomputeModule::kGdnNormOut), api, "layer ", i,
                " is an attention layer and cannot recompute gdn_norm_out");
    TORCH_CHECK(!l.recomputes(RecomputeModule::kMlaUpProj) || c.multi_latent_attention, api,
                "layer ", i, ": mla_up_proj recompute needs multi_latent_attention");
    TORCH_CHECK(l.moe == moe[i], api, "layer ", i, " is ", moe[i] ? "an MoE" : "a dense",
                " layer but its plan says otherwise");
    for (const auto& [m, name] : kRecomputeModuleNames) {
      if (!l.recomputes(m)) continue;
      const RecomputeScope scope = recompute_scope(m);
      TORCH_CHECK(scope != RecomputeScope::kMoELayers || l.moe, api, "layer ", i,
                  " is dense and cannot recompute ", name);
      TORCH_CHECK(scope != RecomputeScope::kDenseLayers || !l.moe, api, "layer ", i,
                  " is an MoE layer: recompute it with moe, not ", name);
    }
    TORCH_CHECK(
        l.moe || (!l.offloads(OffloadModule::kExpertFc1) && !l.offloads(OffloadModule::kMoeAct)),
        api, "layer ", i, " is dense and cannot offload MoE modules");
    TORCH_CHECK(!l.recomputes(RecomputeModule::kMoeAct) || c.moe_grouped_gemm, api, "layer ", i,
                ": moe_act recompute needs moe_grouped_gemm");
    TORCH_CHECK(
        !l.recomputes(RecomputeModule::kSharedExperts) || c.moe_shared_expert_intermediate_size,
        api, "layer ", i, " has no shared experts to recompute");
    TORCH_CHECK(!(l.recomputes(RecomputeModule::kMoe) &&
                  (l.offloads(OffloadModule::kExpertFc1) || l.offloads(OffloadModule::kMoeAct))),
                api, "layer ", i,
                ": expert groups cannot be offloaded inside a recomputed MoE layer");
    TORCH_CHECK(c.moe_grouped_gemm ||
                    (!l.offloads(OffloadModule::kExpertFc1) && !l.offloads(OffloadModule::kMoeAct)),
                api, "layer ", i, ": the expert offload groups need moe_grouped_gemm");
    const bool module_offload =
        std::any_of(l.offload_module.begin(), l.offload_module.end(), [](bool b) { return b; });
    TORCH_CHECK(l.chunk < static_cast<int>(plan.chunks.size()), api, "layer ", i, " names chunk ",
                l.chunk, " of ", plan.chunks.size());
    TORCH_CHECK(!l.in_chunk() || (!selective && !module_offload && !l.layer_group), api, "layer ",
                i,
                " runs in a full-recompute chunk and cannot also recompute or "
                "offload its modules");
    TORCH_CHECK(!(l.offload_layer && module_offload), api, "layer ", i,
                " offloads the whole layer and module groups at once");
    TORCH_CHECK(!l.offload_layer || l.layer_group, api, "layer ", i,
                " offloads the whole layer but opens no layer group");
    TORCH_CHECK(!(l.offloads(OffloadModule::kCoreAttn) && l.recomputes(RecomputeModule::kCoreAttn)),
                api, "layer ", i, ": core_attn cannot be both offloaded and recomputed");
  }
  TORCH_CHECK(!plan.distribute_saved_activations ||
                  (!plan.chunks.empty() && c.tensor_model_parallel_size > 1),
              api,
              "distribute_saved_activations needs full-recompute chunks and "
              "tensor_model_parallel_size > 1");
}

std::string ActivationPlan::summary() const {
  std::ostringstream os;
  os << "recompute ";
  switch (granularity) {
    case RecomputeGranularity::kNone:
      os << "none";
      break;
    case RecomputeGranularity::kFull:
      os << "full, " << to_string(method) << " " << recompute_num_layers
         << (distribute_saved_activations ? ", inputs distributed over the tensor-parallel ranks"
                                          : "");
      break;
    case RecomputeGranularity::kSelective:
      os << "selective:";
      for (const auto m : recompute_modules) os << " " << to_string(m);
      break;
  }
  os << " | offload ";
  if (layer_offload()) {
    os << "the first " << cpu_offloading_num_layers << " layer(s)";
  } else if (fine_grained_offload()) {
    os << "modules:";
    for (const auto m : offload_modules) os << " " << to_string(m);
  } else {
    os << "none";
  }
  if (offloads() && max_inflight_offloads >= 0) {
    os << ", at most " << max_inflight_offloads << " in flight";
  }
  if (offloads()) os << ", tensors of at least " << min_offloaded_tensor_size << " elements";
  return os.str();
}

nlohmann::json ActivationPlan::to_json() const {
  nlohmann::json j;
  j["recompute_granularity"] = to_string(granularity);
  j["recompute_method"] = to_string(method);
  j["recompute_num_layers"] = recompute_num_layers;
  j["recompute_modules"] = nlohmann::json::array();
  for (const auto m : recompute_modules) j["recompute_modules"].push_back(to_string(m));
  j["distribute_saved_activations"] = distribute_saved_activations;
  j["cpu_offloading_num_layers"] = cpu_offloading_num_layers;
  j["offload_modules"] = nlohmann::json::array();
  for (const auto m : offload_modules) j["offload_modules"].push_back(to_string(m));
  j["min_offloaded_tensor_size"] = min_offloaded_tensor_size;
  j["max_inflight_offloads"] = max_inflight_offloads;
  j["chunks"] = nlohmann::json::array();
  for (const auto& c : chunks) j["chunks"].push_back({c.start, c.end});
  j["layers"] = nlohmann::json::array();
  for (const auto& l : layers) {
    nlohmann::json lj = {{"chunk", l.chunk},
                         {"moe", l.moe},
                         {"recompute_modules", nlohmann::json::array()},
                         {"offload_layer", l.offload_layer},
                         {"offload_modules", nlohmann::json::array()}};
    for (const auto& [m, name] : kRecomputeModuleNames) {
      if (l.recomputes(m)) lj["recompute_modules"].push_back(std::string(name));
    }
    for (const auto& [m, name] : kOffloadModuleNames) {
      if (l.offloads(m)) lj["offload_modules"].push_back(std::string(name));
    }
    j["layers"].push_back(std::move(lj));
  }
  return j;
}

void print_activation_plan(std::ostream& os, const ActivationPlan& plan) {
  os << plan.summary() << "\n\n"
     << std::left << std::setw(8) << "layer" << std::setw(44) << "recompute"
     << "offload\n";
  for (size_t i = 0; i < plan.layers.size(); ++i) {
    const LayerPlan& l = plan.layers[i];
    std::string recompute;
    if (l.in_chunk()) {
      const CheckpointChunk& c = plan.chunks[static_cast<size_t>(l.chunk)];
      recompute = "full, chunk " + std::to_string(l.chunk) + " (layers " + std::to_string(c.start) +
                  "-" + std::to_string(c.end - 1) + ")" +
                  (l.starts_chunk ? (plan.distribute_saved_activations ? ": keeps 1/t of its input"
                                                                       : ": keeps its input")
                                  : "");
    } else {
      for (const auto& [m, name] : kRecomputeModuleNames) {
        if (l.recomputes(m)) recompute += std::string(name) + " ";
      }
      if (recompute.empty()) recompute = "keep";
    }
    std::string offload;
    if (l.offload_layer) offload = "whole layer ";
    for (const auto& [m, name] : kOffloadModuleNames) {
      if (l.offloads(m)) offload += std::string(name) + " ";
    }
    if (offload.empty()) offload = "-";
    while (!recompute.empty() && recompute.back() == ' ') recompute.pop_back();
    while (!offload.empty() && offload.back() == ' ') offload.pop_back();
    os << std::left << std::setw(8) << (std::to_string(i) + (l.moe ? " moe" : "")) << std::setw(44)
       << recompute << offload << "\n";
  }
}

}  // namespace actmem
