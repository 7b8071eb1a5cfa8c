// config.cpp — TransformerConfig::validate().
#include "actmem/config.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <sstream>

namespace actmem {

namespace {
void check_positive(int64_t value, const char* name) {
  TORCH_CHECK(value > 0, "actmem::TransformerConfig: ", name, " must be positive, got ", value);
}
void check_dropout(double p, const char* name) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, "actmem::TransformerConfig: ", name,
              " must be in [0, 1), got ", p);
}
std::string join_set(const std::vector<std::string>& items) {
  std::ostringstream os;
  os << "{";
  for (size_t i = 0; i < items.size(); ++i) os << (i ? ", " : "") << "'" << items[i] << "'";
  os << "}";
  return os.str();
}

// Megatron's recompute rules for a dense model (the recompute checks of TransformerConfig's
// __post_init__ in megatron/core/transformer/transformer_config.py, then those of validate_args in
// megatron/training/arguments.py), in its order and with its conditions; deliberate differences
// are marked "fixed".
void validate_recompute(const TransformerConfig& c) {
  const std::string& g = c.recompute_granularity;
  if (!g.empty()) {
    TORCH_CHECK(g == "full" || g == "selective", "actmem::TransformerConfig: recompute_granularity: ",
                g, " must be \"full\" or \"selective\".");
    TORCH_CHECK(c.recompute_method.empty() || c.recompute_method == "block" ||
                    c.recompute_method == "uniform",
                "actmem::TransformerConfig: recompute_method: ", c.recompute_method,
                " must be \"block\" or \"uniform\".");
    const int64_t per_stage = c.num_layers / c.pipeline_model_parallel_size;
    if (g == "full") {
      TORCH_CHECK(!c.recompute_method.empty(), "actmem::TransformerConfig: Using "
                  "recompute_granularity: full so recompute_method must be \"block\" or "
                  "\"uniform\"");
      // Megatron only checks for None; the range is checked here too (fixed).
      TORCH_CHECK(c.recompute_num_layers.has_value() && *c.recompute_num_layers >= 1 &&
                      *c.recompute_num_layers <= per_stage,
                  "actmem::TransformerConfig: When using recompute_granularity: full, "
                  "recompute_num_layers must be between 1 and num_layers_per_pipeline_rank: ",
                  per_stage, (c.recompute_num_layers ? ", got " + std::to_string(*c.recompute_num_layers)
                                                     : std::string(", got none")));
    } else {
      TORCH_CHECK(!c.recompute_num_layers.has_value(), "actmem::TransformerConfig: When using "
                  "recompute_granularity: selective, recompute_num_layers must be None.");
      TORCH_CHECK(c.recompute_method.empty(), "actmem::TransformerConfig: recompute method is not "
                  "yet supported for selective recomputing granularity");
    }
    TORCH_CHECK(!(c.distribute_saved_activations && c.sequence_parallel),
                "actmem::TransformerConfig: distribute_saved_activations: ",
                c.distribute_saved_activations, " must be false when sequence parallel is enabled: ",
                c.sequence_parallel);
  }
  if (c.distribute_saved_activations) {
    TORCH_CHECK(c.tensor_model_parallel_size > 1, "actmem::TransformerConfig: "
                "distribute_saved_activations requires tensor_model_parallel_size > 1, got ",
                c.tensor_model_parallel_size);
    TORCH_CHECK(g == "full" && !c.recompute_method.empty(), "actmem::TransformerConfig: "
                "distribute_saved_activations requires recompute_granularity full with a "
                "recompute_method");
  }
  if (g == "selective") {
    static const std::vector<std::string> allowed = {"core_attn", "moe_act", "layernorm",
                                                     "mla_up_proj", "mlp", "moe",
                                                     "shared_experts", "gdn_norm_out"};
    const auto modules = c.resolved_recompute_modules();
    std::vector<std::string> invalid;
    for (const auto& m : modules) {
      if (std::find(allowed.begin(), allowed.end(), m) == allowed.end()) invalid.push_back(m);
    }
    TORCH_CHECK(invalid.empty(), "actmem::TransformerConfig: Invalid choices for "
                "recompute_modules: ", join_set(invalid), ". Allowed modules are: ",
                join_set(allowed));
    auto has = [&](const char* m) {
      return std::find(modules.begin(), modules.end(), m) != modules.end();
    };
    TORCH_CHECK(!has("moe_act"), "actmem::TransformerConfig: moe_act in recompute_modules is only "
                "supported with moe_grouped_gemm.");
    TORCH_CHECK(!has("mla_up_proj"), "actmem::TransformerConfig: mla_up_proj in recompute_modules "
                "is only supported with multi_latent_attention.");
    TORCH_CHECK(!has("gdn_norm_out"), "actmem::TransformerConfig: gdn_norm_out in "
                "recompute_modules is only supported with the gated_delta_net attention variant.");
    // Megatron silently ignores these on a dense model; a user asking for them expects an effect.
    TORCH_CHECK(!has("moe") && !has("shared_experts"), "actmem::TransformerConfig: moe and "
                "shared_experts in recompute_modules need MoE layers, and this model is dense");
  } else {
    TORCH_CHECK(!c.recompute_modules.has_value(), "actmem::TransformerConfig: recompute_modules "
                "only applies to recompute_granularity selective (got granularity \"", g, "\")");
  }
}
}  // namespace

bool TransformerConfig::offloads(const std::string& module) const {
  return fine_grained_activation_offloading &&
         std::find(offload_modules.begin(), offload_modules.end(), module) != offload_modules.end();
}

namespace {
// Megatron's fine-grained offload rules (the fine_grained_activation_offloading checks of
// TransformerConfig.__post_init__, megatron/core/transformer/transformer_config.py) and the
// exclusions with recompute; deliberate differences are marked.
void validate_offload(const TransformerConfig& c) {
  if (!c.fine_grained_activation_offloading) {
    TORCH_CHECK(c.offload_modules.empty(), "actmem::TransformerConfig: offload_modules only applies "
                "with fine_grained_activation_offloading");
    return;
  }
  TORCH_CHECK(!c.cpu_offloading(), "actmem::TransformerConfig: fine_grained_activation_offloading "
              "cannot be enabled with cpu_offloading.");
  TORCH_CHECK(!c.offload_modules.empty(), "actmem::TransformerConfig: offload_modules must name at "
              "least one module when fine_grained_activation_offloading is on");
  static const std::vector<std::string> allowed = {"core_attn", "attn_proj", "expert_fc1", "moe_act",
                                                   "attn_norm", "mlp_norm", "qkv_linear"};
  std::vector<std::string> invalid;
  for (const auto& m : c.offload_modules) {
    if (std::find(allowed.begin(), allowed.end(), m) == allowed.end()) invalid.push_back(m);
  }
  TORCH_CHECK(invalid.empty(), "actmem::TransformerConfig: Invalid choices for offload_modules: ",
              join_set(invalid), ". Allowed modules are: ", join_set(allowed));
  TORCH_CHECK(!c.offloads("expert_fc1") && !c.offloads("moe_act"), "actmem::TransformerConfig: "
              "expert_fc1 and moe_act in offload_modules need MoE layers, and this model is dense");
  TORCH_CHECK(!c.offloads("attn_proj") || c.offloads("core_attn"), "actmem::TransformerConfig: "
              "attn_proj cannot be set to offload_modules alone without core_attn because the input "
              "of attn_proj is the output of core_attn, which is needed in core_attn.backward().");
  // Megatron silently skips core_attn offload when core_attn is recomputed; refused here.
  TORCH_CHECK(!(c.offloads("core_attn") && c.recomputes("core_attn")),
              "actmem::TransformerConfig: core_attn cannot be both offloaded and recomputed: "
              "remove it from offload_modules or from recompute_modules");
  // Our restriction: whole-layer checkpoints and module offload groups do not compose here.
  TORCH_CHECK(!c.full_recompute(), "actmem::TransformerConfig: fine_grained_activation_offloading "
              "works with selective recompute only, not with recompute_granularity full");
  TORCH_CHECK(c.fine_grained_offloading_max_inflight_offloads >= -1,
              "actmem::TransformerConfig: fine_grained_offloading_max_inflight_offloads must be "
              ">= 0 (or -1 for no cap), got ", c.fine_grained_offloading_max_inflight_offloads);
}
}  // namespace

bool TransformerConfig::recomputes(const std::string& module) const {
  if (recompute_granularity != "selective") return false;
  const auto modules = resolved_recompute_modules();
  return std::find(modules.begin(), modules.end(), module) != modules.end();
}

void TransformerConfig::validate() const {
  check_positive(num_layers, "num_layers");
  check_positive(hidden_size, "hidden_size");
  check_positive(num_attention_heads, "num_attention_heads");
  TORCH_CHECK(hidden_size % num_attention_heads == 0,
              "actmem::TransformerConfig: num_attention_heads (", num_attention_heads,
              ") must divide hidden_size (", hidden_size, ")");
  TORCH_CHECK(ffn_hidden_size >= 0, "actmem::TransformerConfig: ffn_hidden_size must be positive "
              "(or 0 for 4 * hidden_size), got ", ffn_hidden_size);
  check_positive(seq_length, "seq_length");
  TORCH_CHECK(max_position_embeddings >= 0, "actmem::TransformerConfig: max_position_embeddings "
              "must be positive (or 0 for seq_length), got ", max_position_embeddings);
  TORCH_CHECK(max_positions() >= seq_length, "actmem::TransformerConfig: max_position_embeddings (",
              max_positions(), ") must be at least seq_length (", seq_length, ")");
  check_positive(micro_batch_size, "micro_batch_size");
  check_positive(vocab_size, "vocab_size");
  check_dropout(attention_dropout, "attention_dropout");
  check_dropout(hidden_dropout, "hidden_dropout");
  TORCH_CHECK(normalization == "LayerNorm" || normalization == "RMSNorm",
              "actmem::TransformerConfig: normalization must be \"LayerNorm\" or \"RMSNorm\", got \"",
              normalization, "\"");
  TORCH_CHECK(layernorm_epsilon > 0.0, "actmem::TransformerConfig: layernorm_epsilon must be "
              "positive, got ", layernorm_epsilon);
  TORCH_CHECK(position_embedding_type == "learned_absolute" || position_embedding_type == "rope",
              "actmem::TransformerConfig: position_embedding_type must be \"learned_absolute\" or "
              "\"rope\", got \"", position_embedding_type, "\"");
  TORCH_CHECK(!use_rope() || kv_channels() % 2 == 0, "actmem::TransformerConfig: rope needs an even "
              "head dimension (hidden_size / num_attention_heads), got ", kv_channels());
  TORCH_CHECK(rotary_base > 0.0, "actmem::TransformerConfig: rotary_base must be positive, got ",
              rotary_base);
  TORCH_CHECK(init_method_std > 0.0, "actmem::TransformerConfig: init_method_std must be "
              "positive, got ", init_method_std);
  TORCH_CHECK(seed >= 1 && seed <= kMaxSeed, "actmem::TransformerConfig: seed must be in [1, ",
              kMaxSeed, "] (Megatron requires seed > 0), got ", seed);
  // Tensor and sequence parallelism (docs/parallelism.md): heads, the MLP's columns and, with
  // sequence parallelism, the sequence are split evenly across the t ranks.
  const int64_t t = tensor_model_parallel_size;
  check_positive(t, "tensor_model_parallel_size");
  TORCH_CHECK(num_attention_heads % t == 0, "actmem::TransformerConfig: num_attention_heads (",
              num_attention_heads, ") must be divisible by tensor_model_parallel_size (", t, ")");
  TORCH_CHECK(ffn() % t == 0, "actmem::TransformerConfig: ffn_hidden_size (", ffn(),
              ") must be divisible by tensor_model_parallel_size (", t, ")");
  TORCH_CHECK(pipeline_model_parallel_size == 1, "actmem::TransformerConfig: "
              "pipeline_model_parallel_size must be 1 (pipeline parallelism is not implemented), "
              "got ", pipeline_model_parallel_size);
  TORCH_CHECK(!sequence_parallel || t > 1, "actmem::TransformerConfig: "
              "sequence_parallel requires tensor_model_parallel_size > 1");
  TORCH_CHECK(!sequence_parallel || seq_length % t == 0, "actmem::TransformerConfig: "
              "sequence_parallel needs seq_length (", seq_length, ") divisible by "
              "tensor_model_parallel_size (", t, ")");
  // Megatron's layer-level offload rules (the cpu_offloading checks of TransformerConfig's
  // __post_init__, megatron/core/transformer/transformer_config.py; as in validate_args,
  // megatron/training/arguments.py, cpu_offloading_num_layers K > 0 turns offloading on).
  if (cpu_offloading()) {
    TORCH_CHECK(cpu_offloading_num_layers > 0 && cpu_offloading_num_layers < num_layers,
                "actmem::TransformerConfig: CPU offloading can be done only for layers less than ",
                num_layers, " (cpu_offloading_num_layers = ", cpu_offloading_num_layers, ")");
    TORCH_CHECK(pipeline_model_parallel_size == 1, "actmem::TransformerConfig: Currently there is "
                "no support for Pipeline parallelism with CPU offloading");
    TORCH_CHECK(recompute_granularity.empty(), "actmem::TransformerConfig: CPU offloading does not "
                "work when activation recomputation is enabled");
  }
  TORCH_CHECK(min_offloaded_tensor_size >= 0, "actmem::TransformerConfig: "
              "min_offloaded_tensor_size must be >= 0, got ", min_offloaded_tensor_size);
  validate_recompute(*this);
  validate_offload(*this);
}

nlohmann::json to_json(const TransformerConfig& c) {
  nlohmann::json j = {
      {"num_layers", c.num_layers},
      {"hidden_size", c.hidden_size},
      {"num_attention_heads", c.num_attention_heads},
      {"ffn_hidden_size", c.ffn()},
      {"seq_length", c.seq_length},
      {"max_position_embeddings", c.max_positions()},
      {"micro_batch_size", c.micro_batch_size},
      {"vocab_size", c.vocab_size},
      {"attention_dropout", c.attention_dropout},
      {"hidden_dropout", c.hidden_dropout},
      {"normalization", c.normalization},
      {"layernorm_epsilon", c.layernorm_epsilon},
      {"gated_linear_unit", c.gated_linear_unit},
      {"add_bias_linear", c.add_bias_linear},
      {"position_embedding_type", c.position_embedding_type},
      {"rotary_base", c.rotary_base},
      {"untie_embeddings_and_output_weights", c.untie_embeddings_and_output_weights},
      {"init_method_std", c.init_method_std},
      {"seed", c.seed},
      {"tensor_model_parallel_size", c.tensor_model_parallel_size},
      {"pipeline_model_parallel_size", c.pipeline_model_parallel_size},
      {"sequence_parallel", c.sequence_parallel},
      {"recompute_granularity", c.recompute_granularity.empty()
                                    ? nlohmann::json(nullptr)
                                    : nlohmann::json(c.recompute_granularity)},
      {"recompute_method", c.recompute_method.empty() ? nlohmann::json(nullptr)
                                                      : nlohmann::json(c.recompute_method)},
      {"recompute_num_layers", c.recompute_num_layers ? nlohmann::json(*c.recompute_num_layers)
                                                      : nlohmann::json(nullptr)},
      {"recompute_modules", c.recompute_granularity == "selective"
                                ? nlohmann::json(c.resolved_recompute_modules())
                                : nlohmann::json(nullptr)},
      {"distribute_saved_activations", c.distribute_saved_activations},
      {"cpu_offloading_num_layers", c.cpu_offloading_num_layers},
      {"fine_grained_activation_offloading", c.fine_grained_activation_offloading},
      {"offload_modules", c.offload_modules},
      {"fine_grained_offloading_max_inflight_offloads",
       c.fine_grained_offloading_max_inflight_offloads},
      {"min_offloaded_tensor_size", c.min_offloaded_tensor_size},
  };
  return j;
}

}  // namespace actmem
