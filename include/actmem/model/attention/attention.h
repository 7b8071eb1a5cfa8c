// attention.h — self-attention as Megatron builds it: the unfused core attention (scores,
// causal mask, softmax, dropout, x V) or the flash kernel, rotary embeddings (standard and MLA's
// decoupled, YaRN), the key/value cache of generation, and SelfAttention (linear_qkv ->
// core_attention -> linear_proj), the "attention" mixer part: standard and grouped-query
// attention, with Qwen3-Next's output gate and q/k norms. Multi-latent attention (mla/mla.h)
// builds on the core attention, the tables and the cache here.
#pragma once

#include "actmem/config/activation_plan.h"
#include "actmem/config/config.h"
#include "actmem/model/layer_part.h"
#include "actmem/model/layers.h"

#include <torch/nn/module.h>

#include <memory>
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
  /// MLA's de-interleaving of the rotated part (Note [MLA's RoPE] in mla/mla.cpp).
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

/// What both attentions do after their q, k, v (Megatron's Attention.forward and
/// MultiLatentAttention.forward share it): core attention under the ModuleScope
/// "core_attention", in a checkpoint when `recompute` (selective core_attn: only q, k, v and the
/// random state kept, the [b, a, s, s] scores, probabilities and dropout mask rebuilt in
/// backward) or inside the core_attn offload group `offload_group` (null: none), whose commit
/// releases q, k and v. `kept_elsewhere`: tensors saved outside the group (the q/k norms' inputs)
/// whose storage q, k or v may share; such a storage is not released at the commit.
at::Tensor run_core_attention(const std::shared_ptr<CoreAttention>& core, bool recompute,
                              ActivationOffloader* offload_group, const at::Tensor& q,
                              const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                              const std::vector<at::Tensor>& kept_elsewhere = {});
/// linear_proj under the ModuleScope "linear_proj", in the attn_proj offload group
/// `offload_group` (null: none), which releases the context at its commit.
std::pair<at::Tensor, at::Tensor> run_linear_proj(Linear& proj, ActivationOffloader* offload_group,
                                                  const at::Tensor& context);

/// Generation's key/value cache of one attention layer (Megatron's inference key/value memory):
/// keys [capacity, G, dk] and values [capacity, G, dv] of G key/value heads.
class KVCacheState : public DecodeState {
 public:
  KVCacheState(int64_t capacity, int64_t kv_heads, int64_t key_dim, int64_t value_dim,
               const at::TensorOptions& options);
  int64_t bytes() const override;
  /// Appends k [n, 1, G, dk] and v [n, 1, G, dv] at positions [offset, offset + n) and returns
  /// the causal attention of q [n, 1, a, dk] over positions [0, offset + n): the context
  /// [n, 1, a dv] (each of the G cached heads serving its group's a/G query heads; the softmax
  /// in fp32 when `fp32_softmax`).
  at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t offset,
                    double scale, bool fp32_softmax);
  at::Tensor keys, values;
};

/// Megatron's Attention with the local spec: linear_qkv (column-parallel, Megatron's grouped
/// layout), the q/k norms (--qk-layernorm), RoPE, core attention, the output gate
/// (--attention-output-gate), linear_proj (row-parallel). The mixer part "attention".
class SelfAttention : public PartModule {
 public:
  SelfAttention(const TransformerConfig& config, const LayerPlan& plan, at::ScalarType dtype);
  /// x: [s, b, h] -> (output [s, b, h], linear_proj bias or undefined)
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x, const LayerContext& ctx) override;
  /// linear_qkv (its rows: with the output gate each group's rows also hold its gate heads,
  /// ranks taking whole groups), then linear_proj (its columns), Megatron's order.
  void init_weights(WeightInit& init) override;
  std::unique_ptr<DecodeState> make_decode_state(int64_t capacity,
                                                 const at::TensorOptions& options) const override;
  std::pair<at::Tensor, at::Tensor> decode(const at::Tensor& x, DecodeState* state, int64_t offset,
                                           const LayerContext& ctx) override;
  /// What linear_qkv's output becomes before the core attention: q [s, b, a, d], k and v
  /// [s, b, G, d] (the q/k norms and RoPE from position `offset` applied), and the output gate
  /// [s, b, a, d] (undefined without --attention-output-gate). `qkv_group` offloads linear_qkv.
  struct Projected {
    at::Tensor q, k, v, gate;
    std::vector<at::Tensor> kept_elsewhere;  // the q/k norms' saved inputs (not to be freed)
  };
  Projected project(const at::Tensor& x, const RotaryEmbedding* rope, int64_t offset = 0,
                    ActivationOffloader* qkv_group = nullptr);
  /// Under FP8 (attention_fp8_keeps_original), linear_proj keeps the core attention's output
  /// and linear_qkv a norm output that selective layernorm recompute frees, instead of
  /// quantized copies.
  void use_fp8(const std::shared_ptr<Fp8Registry>& registry) override;
  std::shared_ptr<Linear> linear_qkv;
  std::shared_ptr<Norm> q_layernorm;  // with --qk-layernorm, over d, shared by every head
  std::shared_ptr<Norm> k_layernorm;
  std::shared_ptr<CoreAttention> core_attention;
  std::shared_ptr<Linear> linear_proj;

 private:
  int64_t heads_, groups_, head_dim_;  // this rank's query heads and key/value groups
  bool output_gate_;
  bool fp32_softmax_;  // --attention-softmax-in-fp32
  LayerPlan plan_;
};

/// The mixer part "attention" (Note [A layer part owns its contract] in layer_part.h).
const LayerPart& attention_part();

/// Under FP8, which of standard attention's GEMMs keep their 16-bit input (Megatron's
/// set_save_original_input), under a current-scaling recipe only: linear_proj (Megatron's
/// Attention.__init__: the core attention keeps that output itself) and, with selective
/// layernorm recompute, linear_qkv (set_for_recompute_input_layernorm).
struct AttentionFp8Inputs {
  bool qkv_original = false;
  bool proj_original = false;
};
AttentionFp8Inputs attention_fp8_keeps_original(bool delayed_scaling, const LayerPlan& plan);

/// What the core attention keeps beyond q, k and v for the predictor (both attentions' parts):
/// the random-state snapshot under selective core_attn; the flash kernel's output and
/// logsumexp; or the softmax output and, with attention dropout, its mask and output.
int64_t core_attention_scores_bytes(const SavedBytesContext& ctx);

}  // namespace actmem
