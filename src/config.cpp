// config.cpp — TransformerConfig::validate().
#include "actmem/config.h"

#include <c10/util/Exception.h>

namespace actmem {

namespace {
void check_positive(int64_t value, const char* name) {
  TORCH_CHECK(value > 0, "actmem::TransformerConfig: ", name, " must be positive, got ", value);
}
void check_dropout(double p, const char* name) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, "actmem::TransformerConfig: ", name,
              " must be in [0, 1), got ", p);
}
}  // namespace

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
}

}  // namespace actmem
