// attention.h — self-attention as Megatron builds it: the unfused core attention (scores,
// causal mask, softmax, dropout, x V), rotary embeddings (standard and MLA's decoupled, YaRN),
// SelfAttention (linear_qkv -> core_attention -> linear_proj) and multi-latent attention.
#pragma once

#include "actmem/config/activation_plan.h"
#include "actmem/config/config.h"
#include "actmem/model/layers.h"

#include <torch/nn/module.h>

#include <string>
#include <tuple>
#include <vector>

namespace actmem {


/// [1, 1, s, s] bool, true above the diagonal (the positions a query may not attend to).
at::Tensor make_causal_mask(int64_t s, const at::Device& device = at::kCPU);

/// Megatron's fused QKV layout (Attention.get_query_key_value_tensors): linear_qkv's output
/// [s, b, G (a/G + 2) d] holds, per key/value group, its a/G query heads, then its key and its
/// value head. Returns q [s, b, a, d] and k, v [s, b, G, d] (a and G: this rank's heads and
/// groups). With one group per head it is the per-head [q, k, v] layout, and q a view.
std::tuple<at::Tensor, at::Tensor, at::Tensor> split_qkv(const at::Tensor& qkv, int64_t heads,
                                                         int64_t groups, int64_t head_dim);

/// The same layout with an output gate (Megatron's --attention-output-gate): per group its a/G
/// query heads, their a/G gate heads, its key and its value head. Returns q and the gate
/// [s, b, a, d], k and v [s, b, G, d].
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> split_gated_qkv(const at::Tensor& qkv,
                                                                           int64_t heads,
                                                                           int64_t groups,
                                                                           int64_t head_dim);

/// Megatron's Attention._apply_output_gate: context [s, b, a d] times sigmoid(gate) computed in
/// fp32, back in the context's type.
at::Tensor apply_output_gate(const at::Tensor& context, const at::Tensor& gate);

/// Keys or values of G heads [s, b, G, d] repeated for the a/G query heads of each group
/// [s, b, a, d] (Megatron's unfused attention: repeat_interleave over the head dimension); x
/// itself when G = a.
at::Tensor expand_kv_heads(const at::Tensor& x, int64_t heads);

/// Causal scaled-dot-product attention: the unfused path (scores, mask, softmax, attention
/// dropout, x V) or the flash kernel, as config.attention_kernel() says (Note [Attention
/// backends] in config.cpp).
class CoreAttention : public torch::nn::Module {
 public:
  /// Attention dropout draws from the model-parallel stream (each tensor-parallel rank drops
  /// its own heads differently); under sequence parallelism the whole block already runs in it.
  /// softmax_scale 0 means 1/sqrt(d) (d = the query's head dim).
  explicit CoreAttention(const TransformerConfig& config, double softmax_scale = 0.0);
  /// q: [s, b, a, d]; k: [s, b, G, d]; v: [s, b, G, dv] (G divides a: grouped-query attention,
  /// the keys and values repeated per group inside, so a checkpoint keeps them at G heads);
  /// mask: [1, 1, >=s, >=s] bool -> context [s, b, a*dv]
  at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& mask);

 private:
  at::Tensor flash_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);
  double softmax_scale_;
  AttentionKernel kernel_;
  double dropout_;
  bool sequence_parallel_;
  bool softmax_in_fp32_;
};

/// Rotary position embedding tables (cos and sin, [s, 1, 1, d]).
class RotaryEmbedding {
 public:
  /// Standard attention's RoPE over the head dimension (--position-embedding-type rope).
  RotaryEmbedding(const TransformerConfig& config, at::ScalarType dtype);
  /// Multi-latent attention's decoupled RoPE over qk_pos_emb_head_dim: Megatron's RotaryEmbedding
  /// or YarnRotaryEmbedding (rope_type), its concentration factor folded into the tables, and
  /// MLA's de-interleaving of the rotated part (Note [MLA's RoPE] in attention.cpp).
  static RotaryEmbedding for_mla(const TransformerConfig& config, at::ScalarType dtype);
  /// Rotates x: [s, b, a, d], whose first position is `offset` (a KV-cached continuation).
  at::Tensor apply(const at::Tensor& x, int64_t offset = 0) const;
  /// The tables; GPTModel registers them as buffers (rotary_pos_emb.cos, .sin), so they move
  /// with the model and are not counted as activations.
  at::Tensor cos, sin;

 private:
  RotaryEmbedding() = default;
  at::Tensor rotate(const at::Tensor& x, int64_t offset) const;  // over the tables' width
  bool mla_interleaved_ = false;  // x[..., 0::2] then x[..., 1::2] before rotating
};

/// What every layer receives besides the hidden states (Megatron passes the same to each layer).
struct LayerContext {
  const RotaryEmbedding* rope = nullptr;  // null with learned positions
  at::Tensor attention_mask;              // [1, 1, S, S] bool, S >= s (see make_causal_mask)
  ActivationOffloader* offloader = nullptr;  // layer-level or fine-grained offload (training)
};

class SelfAttention : public torch::nn::Module {
 public:
  SelfAttention(const TransformerConfig& config, const LayerPlan& plan, at::ScalarType dtype);
  /// x: [s, b, h] -> (output [s, b, h], linear_proj bias or undefined)
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x, const LayerContext& ctx);
  /// What linear_qkv's output becomes before the core attention: q [s, b, a, d], k and v
  /// [s, b, G, d] (the q/k norms and RoPE from position `offset` applied), and the output gate
  /// [s, b, a, d] (undefined without --attention-output-gate). `qkv_group` offloads linear_qkv.
  struct Projected {
    at::Tensor q, k, v, gate;
    std::vector<at::Tensor> kept_elsewhere;  // the q/k norms' saved inputs (not to be freed)
  };
  Projected project(const at::Tensor& x, const RotaryEmbedding* rope, int64_t offset = 0,
                    ActivationOffloader* qkv_group = nullptr);
  std::shared_ptr<Linear> linear_qkv;
  std::shared_ptr<Norm> q_layernorm;  // with --qk-layernorm, over d, shared by every head
  std::shared_ptr<Norm> k_layernorm;
  std::shared_ptr<CoreAttention> core_attention;
  std::shared_ptr<Linear> linear_proj;

 private:
  int64_t heads_, groups_, head_dim_;  // this rank's query heads and key/value groups
  bool output_gate_;
  LayerPlan plan_;
};

/// Megatron's MLASelfAttention (megatron/core/transformer/multi_latent_attention.py) with the
/// unfused local spec: hidden -> linear_q_down_proj -> q_layernorm -> linear_q_up_proj (or one
/// linear_q_proj without q_lora_rank) for the queries; hidden -> linear_kv_down_proj ->
/// [kv latent | shared RoPE key part] -> kv_layernorm -> linear_kv_up_proj -> [k | v] per head;
/// the RoPE parts rotated (decoupled RoPE); core attention over a q/k head dim of qk_head_dim +
/// qk_pos_emb_head_dim and a v head dim of v_head_dim; linear_proj back to h. The q/kv norms
/// exist with --qk-layernorm (IdentityOp otherwise, as in Megatron's specs).
class MLASelfAttention : public torch::nn::Module {
 public:
  MLASelfAttention(const TransformerConfig& config, const LayerPlan& plan, at::ScalarType dtype);
  /// x: [s, b, h] -> (output [s, b, h], linear_proj bias or undefined); ctx.rope holds MLA's
  /// tables.
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x, const LayerContext& ctx);
  /// Query, key and value [s, b, a, d] of x, positions from `offset` (generation's KV cache).
  std::tuple<at::Tensor, at::Tensor, at::Tensor> project(const at::Tensor& x,
                                                        const RotaryEmbedding& rope,
                                                        int64_t offset = 0);
  /// mscale^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim), Megatron's MLA softmax scale.
  double softmax_scale() const { return softmax_scale_; }

  std::shared_ptr<CoreAttention> core_attention;
  std::shared_ptr<Linear> linear_proj;
  std::shared_ptr<Linear> linear_q_proj;       // without q_lora_rank
  std::shared_ptr<Linear> linear_q_down_proj;  // with q_lora_rank
  std::shared_ptr<Linear> linear_q_up_proj;    // with q_lora_rank
  std::shared_ptr<Linear> linear_kv_down_proj;
  std::shared_ptr<Linear> linear_kv_up_proj;
  std::shared_ptr<Norm> q_layernorm;   // with q_lora_rank and qk_layernorm
  std::shared_ptr<Norm> kv_layernorm;  // with qk_layernorm

 private:
  // Down projections and norms: (q_compressed, kv_compressed, k_pos_emb).
  std::tuple<at::Tensor, at::Tensor, at::Tensor> down(const at::Tensor& x);
  // The query's up-projection module: linear_q_up_proj, or linear_q_proj without q_lora_rank.
  const char* q_up_name() const { return linear_q_up_proj ? "linear_q_up_proj" : "linear_q_proj"; }
  // Megatron's qkv_up_proj_and_rope_apply: q, k, v [s, b, a, d] (contiguous).
  std::vector<at::Tensor> up_and_rope(const std::vector<at::Tensor>& in, const RotaryEmbedding& rope, int64_t offset);
  int64_t heads_, qk_head_dim_, pos_dim_, v_head_dim_, kv_lora_rank_;  // heads_: this rank's
  bool sequence_parallel_;
  double softmax_scale_;
  LayerPlan plan_;
};

}  // namespace actmem
