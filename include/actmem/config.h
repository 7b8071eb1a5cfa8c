// config.h — TransformerConfig: the model's shape and regularisation, with Megatron's field names.
//
// validate() rejects every inconsistent value with a TORCH_CHECK naming the field and what was
// expected.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace actmem {

/// The largest seed accepted: the named RNG streams add offsets to it (rng.h), which must not
/// wrap around.
constexpr uint64_t kMaxSeed = uint64_t{1} << 62;

/// Shape and numerics of a GPT model, named as in Megatron-LM's TransformerConfig.
struct TransformerConfig {
  int64_t num_layers = 2;
  int64_t hidden_size = 128;
  int64_t num_attention_heads = 4;
  /// 0 means 4 * hidden_size (Megatron's default).
  int64_t ffn_hidden_size = 0;
  int64_t seq_length = 128;
  /// 0 means seq_length.
  int64_t max_position_embeddings = 0;
  int64_t micro_batch_size = 8;
  /// Byte-level tokenizer: 256 symbols.
  int64_t vocab_size = 256;

  double attention_dropout = 0.1;
  double hidden_dropout = 0.1;

  /// "LayerNorm" or "RMSNorm".
  std::string normalization = "LayerNorm";
  double layernorm_epsilon = 1e-5;
  /// SwiGLU when true (fc1 produces 2 * ffn_hidden_size, activation silu(x1) * x2); GeLU otherwise.
  bool gated_linear_unit = false;
  bool add_bias_linear = true;
  /// "learned_absolute" or "rope".
  std::string position_embedding_type = "learned_absolute";
  double rotary_base = 10000.0;
  bool untie_embeddings_and_output_weights = false;
  double init_method_std = 0.02;
  /// In [1, kMaxSeed] (Megatron requires seed > 0).
  uint64_t seed = 1234;

  // ---- parallelism (docs/parallelism.md; pipeline parallelism is not implemented) ----
  int64_t tensor_model_parallel_size = 1;
  int64_t pipeline_model_parallel_size = 1;
  bool sequence_parallel = false;

  // ---- activation recompute (Megatron's fields; see docs/recompute.md) ----
  /// "" (none), "full" or "selective".
  std::string recompute_granularity;
  /// "" (none), "uniform" or "block"; full recompute only.
  std::string recompute_method;
  /// uniform: layers per checkpointed chunk; block: how many of the first layers are
  /// checkpointed. Required for full, must be unset for selective.
  std::optional<int64_t> recompute_num_layers;
  /// Keep each full-recompute checkpoint input as a 1/t shard per tensor-parallel rank.
  bool distribute_saved_activations = false;
  /// Selective targets: core_attn, mlp, layernorm (moe, moe_act, shared_experts, mla_up_proj and
  /// gdn_norm_out name Megatron modules this model does not have). Unset means {"core_attn"}.
  std::optional<std::vector<std::string>> recompute_modules;

  // ---- CPU offload (docs/offload.md) ----
  /// Layer-level offload (Megatron's cpu_offloading_num_layers): the saved activations of the
  /// first K layers go to host memory after their forward and come back ahead of their backward.
  /// 0 = off; needs K < num_layers and no recompute.
  int64_t cpu_offloading_num_layers = 0;
  /// Saved tensors with fewer elements stay on the device (Megatron's default 1024 * 1024).
  int64_t min_offloaded_tensor_size = 1024 * 1024;
  bool cpu_offloading() const { return cpu_offloading_num_layers != 0; }
  /// Fine-grained (module-level) offload, as Megatron's fine_grained_activation_offload.py:
  /// the groups named in offload_modules (attn_norm, qkv_linear, core_attn, attn_proj,
  /// mlp_norm) offload what they save.
  bool fine_grained_activation_offloading = false;
  std::vector<std::string> offload_modules;
  /// Groups of one name whose copies may be in flight before compute waits (-1 = no cap).
  int64_t fine_grained_offloading_max_inflight_offloads = -1;
  /// True when fine-grained offload is on and `module` is among offload_modules.
  bool offloads(const std::string& module) const;

  /// recompute_modules with Megatron's default resolved.
  std::vector<std::string> resolved_recompute_modules() const {
    return recompute_modules.value_or(std::vector<std::string>{"core_attn"});
  }
  /// True when selective recompute is on and `module` is among its targets.
  bool recomputes(const std::string& module) const;
  bool full_recompute() const { return recompute_granularity == "full"; }

  /// ffn_hidden_size with the 0 default resolved.
  int64_t ffn() const { return ffn_hidden_size > 0 ? ffn_hidden_size : 4 * hidden_size; }
  /// max_position_embeddings with the 0 default resolved.
  int64_t max_positions() const {
    return max_position_embeddings > 0 ? max_position_embeddings : seq_length;
  }
  int64_t kv_channels() const { return hidden_size / num_attention_heads; }
  bool use_rope() const { return position_embedding_type == "rope"; }
  bool use_rmsnorm() const { return normalization == "RMSNorm"; }

  /// Throws c10::Error ("actmem::TransformerConfig: ...") for the first inconsistent field.
  void validate() const;
};

/// Every field, with the defaults resolved (ffn_hidden_size, max_position_embeddings,
/// recompute_modules), under Megatron's names.
nlohmann::json to_json(const TransformerConfig& config);

}  // namespace actmem
