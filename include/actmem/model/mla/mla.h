// mla.h — multi-latent attention (DeepSeek-V2/V3's MLA, Megatron's MLASelfAttention), the mixer
// part "mla": low-rank query and key/value latents, decoupled RoPE, selective mla_up_proj
// recompute (docs/mla.md). It runs the core attention, the tables and the key/value cache of
// attention/attention.h.
#pragma once

#include "actmem/config/activation_plan.h"
#include "actmem/config/config.h"
#include "actmem/model/attention/attention.h"
#include "actmem/model/layer_part.h"
#include "actmem/model/layers.h"

#include <memory>
#include <tuple>
#include <vector>

namespace actmem {

/// Megatron's MLASelfAttention (megatron/core/transformer/multi_latent_attention.py) with the
/// unfused local spec: hidden -> linear_q_down_proj -> q_layernorm -> linear_q_up_proj (or one
/// linear_q_proj without q_lora_rank) for the queries; hidden -> linear_kv_down_proj ->
/// [kv latent | shared RoPE key part] -> kv_layernorm -> linear_kv_up_proj -> [k | v] per head;
/// the RoPE parts rotated (decoupled RoPE); core attention over a q/k head dim of qk_head_dim +
/// qk_pos_emb_head_dim and a v head dim of v_head_dim; linear_proj back to h. The q/kv norms
/// exist with --qk-layernorm (IdentityOp otherwise, as in Megatron's specs).
class MLASelfAttention : public PartModule {
 public:
  MLASelfAttention(const TransformerConfig& config, const LayerPlan& plan, at::ScalarType dtype);
  /// x: [s, b, h] -> (output [s, b, h], linear_proj bias or undefined); ctx.rope holds MLA's
  /// tables.
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x, const LayerContext& ctx) override;
  /// Megatron's construction order: linear_proj (its columns), the query projection(s), kv down
  /// and up; the whole weights drawn, a rank keeping its heads (Note [MLA under tensor
  /// parallelism] in mla.cpp): rows of the up projections.
  void init_weights(WeightInit& init) override;
  /// Generation caches the up-projected keys and values per head (as Megatron's inference
  /// without absorption).
  std::unique_ptr<DecodeState> make_decode_state(int64_t capacity,
                                                 const at::TensorOptions& options) const override;
  std::pair<at::Tensor, at::Tensor> decode(const at::Tensor& x, DecodeState* state, int64_t offset,
                                           const LayerContext& ctx) override;
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
  std::vector<at::Tensor> up_and_rope(const std::vector<at::Tensor>& in,
                                      const RotaryEmbedding& rope, int64_t offset);
  int64_t heads_, qk_head_dim_, pos_dim_, v_head_dim_, kv_lora_rank_;  // heads_: this rank's
  bool sequence_parallel_;
  double softmax_scale_;
  bool fp32_softmax_;  // --attention-softmax-in-fp32
  LayerPlan plan_;
};

/// One MLA attention module's activation bytes for one micro-batch at 16 bits (the attention
/// half without its input norm and residual dropout mask: everything under self_attention),
/// the terms of Note [What MLA saves] in mla_part.cpp, which the exact predictor checks
/// against the tracker. Heads are split t ways; the latents are replicated on every
/// tensor-parallel rank (Megatron's duplicated down projections), sequence-sharded with SP.
///   latents  the down projections' input 2sbh, the query latent 2sb*q_lora (with qk_layernorm
///            plus its normed copy 2sb*q_lora and fp32 rstd 4sb), the kv latent with the RoPE key
///            part 2sb*(kv_lora + pos) (with qk_layernorm plus 2sb*kv_lora and 4sb)
///   qkv      q, k, v after the up-projections and RoPE: 2sba*(2(qk + pos) + v)
///   scores   softmax output 2as^2b, dropout mask as^2b, dropped probabilities 2as^2b
///   context  linear_proj's input 2sba*v
/// Selective core_attn drops `scores`; mla_up_proj drops `qkv` (output-discarding).
struct MLAAttentionBytes {
  double latents = 0, qkv = 0, scores = 0, context = 0;
  double none() const { return latents + qkv + scores + context; }
  /// What the module keeps with selective core_attn and/or mla_up_proj recompute.
  double kept(bool core_attn, bool mla_up_proj) const {
    return none() - (core_attn ? scores : 0.0) - (mla_up_proj ? qkv : 0.0);
  }
};
MLAAttentionBytes paper_mla_attention_bytes(const PaperShape& m);

/// The mixer part "mla" (Note [A layer part owns its contract] in layer_part.h).
const LayerPart& mla_part();

}  // namespace actmem
