// throughput.cpp — Megatron's model FLOPs (throughput.h).
#include "actmem/train/throughput.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace actmem {

double megatron_model_flops(const TransformerConfig& c, int64_t global_batch) {
  TORCH_CHECK(global_batch > 0, "actmem::megatron_model_flops: expected a positive batch, got ",
              global_batch);
  // transformer_flops, term for term (no multi-token prediction layers in actmem).
  const double E = 3.0;  // forward and the backward's two GEMMs
  const double F = 2.0;  // a multiply-add is two operations
  const double h = static_cast<double>(c.hidden_size);
  const double s = static_cast<double>(c.seq_length);
  const double tokens = static_cast<double>(global_batch) * s;
  const double seqlen_squared_sum = static_cast<double>(global_batch) * s * s;
  const double ffn_factor = c.gated_linear_unit ? 3.0 : 2.0;
  const int64_t L = c.num_layers;
  int64_t moe_layers = 0;
  if (c.is_moe()) {
    const std::vector<bool> pattern = c.moe_layers();
    moe_layers = std::count(pattern.begin(), pattern.end(), true);
  }
  const double dense_layers = static_cast<double>(L - moe_layers);
  const double routed = c.is_moe() ? static_cast<double>(c.moe_router_topk) : 0.0;
  const double heads = static_cast<double>(c.num_attention_heads);
  double attn = 0.0, attn_core = 0.0;
  if (c.multi_latent_attention) {
    const double qk = static_cast<double>(c.qk_head_dim),
                 pos = static_cast<double>(c.qk_pos_emb_head_dim);
    const double v = static_cast<double>(c.v_head_dim),
                 kv_lora = static_cast<double>(c.kv_lora_rank);
    const double q_term = c.q_lora_rank
                              ? static_cast<double>(*c.q_lora_rank) * (h + heads * (qk + pos) + 1.0)
                              : h * heads * (qk + pos);
    attn = E * F * (q_term + kv_lora * (h + heads * (qk + v) + 1.0) + h * pos + heads * v * h);
    attn_core = E * F * (heads * (qk + pos) / 2.0 + heads * v / 2.0);
  } else {
    // Without --group-query-attention Megatron sets num_query_groups to the heads.
    const double q = static_cast<double>(c.kv_channels()) * heads;
    const double kv = static_cast<double>(c.kv_channels() * c.query_groups());
    const double gate = c.attention_output_gate ? q : 0.0;
    attn = E * F * (h * (q + kv + kv + gate) + q * h);
    attn_core = E * F * q / 2.0 * 2.0;  // half the causal scores; QK^T and their product with V
  }
  int64_t linear_layers = 0;
  double linear_attn = 0.0;
  if (c.gated_delta_net()) {
    const std::vector<bool> pattern = c.gdn_layers();
    linear_layers = std::count(pattern.begin(), pattern.end(), true);
    const double qk_dim = static_cast<double>(c.linear_key_head_dim * c.linear_num_key_heads);
    const double v_head = static_cast<double>(c.linear_value_head_dim);
    const double v_heads = static_cast<double>(c.linear_num_value_heads);
    const double v_dim = v_head * v_heads;
    const double in_proj = 2.0 * qk_dim + 2.0 * v_dim + 2.0 * v_heads;
    linear_attn =
        E * F *
        (h * in_proj + static_cast<double>(c.linear_conv_kernel_dim) * (2.0 * qk_dim + v_dim) +
         v_heads * v_head * v_head * 4.0 + h * v_dim);
  }
  const double standard_layers = static_cast<double>(L - linear_layers);
  const double self_attn =
      linear_attn * static_cast<double>(linear_layers) + attn * standard_layers;
  const double shared = static_cast<double>(c.moe_shared_expert_intermediate_size.value_or(0));
  const double mlp =
      static_cast<double>(c.ffn()) * ffn_factor * dense_layers +
      static_cast<double>(c.moe_ffn()) * routed * ffn_factor * static_cast<double>(moe_layers) +
      shared * ffn_factor * static_cast<double>(moe_layers);
  return tokens * (E * F * h * mlp + self_attn + E * F * h * static_cast<double>(c.vocab_size)) +
         seqlen_squared_sum * attn_core * standard_layers;
}

}  // namespace actmem
