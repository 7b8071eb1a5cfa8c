// config.h — TransformerConfig: the model's shape and regularisation, with Megatron's field names.
//
// validate() rejects every inconsistent value with a TORCH_CHECK naming the field and what was
// expected. Recompute and offload fields are added by the issues that implement them.
#pragma once

#include <cstdint>
#include <string>

namespace actmem {

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
  uint64_t seed = 1234;

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

}  // namespace actmem
