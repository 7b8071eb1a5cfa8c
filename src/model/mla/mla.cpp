// mla.cpp — multi-latent attention (mla.h): Megatron's MLASelfAttention and its decoupled RoPE.
#include "actmem/model/mla/mla.h"

#include "actmem/memory/ledger.h"
#include "actmem/model/weight_init.h"
#include "actmem/offload/activation_offloader.h"
#include "actmem/parallel/tensor_parallel.h"
#include "actmem/recompute/recompute.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

namespace actmem {

// Note [MLA's RoPE]
// Multi-latent attention rotates only a qk_pos_emb_head_dim-wide part of each query head and one
// such part per token shared by all key heads (decoupled RoPE: the latent's up-projection cannot
// carry position). Megatron builds the tables with YarnRotaryEmbedding by default (rope_type
// yarn; megatron/core/models/common/embeddings/yarn_rotary_pos_embedding.py): the frequencies
// blend the plain ones with ones divided by rotary_scaling_factor over a ramp between the
// correction dims of beta_fast = 32 and beta_slow = 1 rotations at
// original_max_position_embeddings = 4096 (MLATransformerConfig's defaults), and cos and sin are
// multiplied by the concentration factor get_mscale(factor, mscale) / get_mscale(factor,
// mscale_all_dim). With a factor of 1 (the CLI default) YaRN equals plain RoPE. Before rotating,
// apply_rotary_pos_emb(mla_rotary_interleaved=True) de-interleaves the part (even features, then
// odd ones); the dot product is invariant to that permutation, Megatron keeps it for checkpoint
// compatibility with DeepSeek's weights, and so does actmem.
namespace {
double yarn_get_mscale(double scale, double mscale) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}
}  // namespace

RotaryEmbedding RotaryEmbedding::for_mla(const TransformerConfig& config, at::ScalarType dtype) {
  const int64_t d = config.qk_pos_emb_head_dim;
  const double base = config.rotary_base;
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor extra = 1.0 / at::pow(base, at::arange(0, d, 2, f64) / static_cast<double>(d));
  at::Tensor inv_freq = extra;
  double concentration = 1.0;
  if (config.resolved_rope_type() == "yarn") {
    const double factor = config.rotary_scaling_factor;
    constexpr double kBetaFast = 32.0, kBetaSlow = 1.0, kOriginalMaxPositions = 4096.0;
    auto correction_dim = [&](double rotations) {
      return static_cast<double>(d) * std::log(kOriginalMaxPositions / (rotations * 2.0 * M_PI)) /
             (2.0 * std::log(base));
    };
    const double low = std::max(std::floor(correction_dim(kBetaFast)), 0.0);
    double high = std::min(std::ceil(correction_dim(kBetaSlow)), static_cast<double>(d - 1));
    if (low == high) high += 0.001;  // Megatron's guard against a zero-width ramp
    const at::Tensor ramp = ((at::arange(d / 2, f64) - low) / (high - low)).clamp(0.0, 1.0);
    const at::Tensor mask = 1.0 - ramp;
    inv_freq = (extra / factor) * (1.0 - mask) + extra * mask;
    concentration =
        yarn_get_mscale(factor, config.mscale) / yarn_get_mscale(factor, config.mscale_all_dim);
  }
  const at::Tensor t = at::arange(config.max_positions(), f64);
  const at::Tensor freqs = at::outer(t, inv_freq);     // [s, d/2]
  const at::Tensor emb = at::cat({freqs, freqs}, -1);  // [s, d]
  RotaryEmbedding r;
  r.cos = (emb.cos() * concentration).to(dtype).view({emb.size(0), 1, 1, d});
  r.sin = (emb.sin() * concentration).to(dtype).view({emb.size(0), 1, 1, d});
  r.mla_interleaved_ = true;
  return r;
}

// ---- MLASelfAttention -------------------------------------------------------------------------

MLASelfAttention::MLASelfAttention(const TransformerConfig& c, const LayerPlan& plan,
                                   at::ScalarType dtype)
    : heads_(c.num_attention_heads / c.tensor_model_parallel_size),
      qk_head_dim_(c.qk_head_dim),
      pos_dim_(c.qk_pos_emb_head_dim),
      v_head_dim_(c.v_head_dim),
      kv_lora_rank_(c.kv_lora_rank),
      sequence_parallel_(c.sequence_parallel),
      fp32_softmax_(c.attention_softmax_in_fp32),
      plan_(plan) {
  // Note [MLA under tensor parallelism]
  // As Megatron's MLASelfAttention with its TE spec: the down projections and the latent norms
  // are replicated on every tensor-parallel rank (TELinear parallel_mode "duplicated"; with
  // sequence parallelism each reads its s/t tokens, so their gradients are summed over the ranks
  // like the norms': sequence_parallel set on them), the up projections are column-parallel
  // (a/t heads per rank, gathering the sequence under SP), linear_proj row-parallel. The RoPE key
  // part k_pos, one per token shared by every head, is used by each rank's heads: under SP it is
  // gathered (all-gather forward, reduce-scatter backward, Megatron's
  // gather_from_sequence_parallel_region); without SP its gradient must still be summed over the
  // ranks, which Megatron does not do (its duplicated kv down projection then gets each rank's
  // own partial gradient for the RoPE columns, and the ranks' weights drift apart); actmem copies
  // it into the tensor-parallel region (identity forward, all-reduce backward), on purpose.
  const int64_t h = c.hidden_size, a = c.num_attention_heads, dq = c.mla_q_head_dim();
  const int64_t t = c.tensor_model_parallel_size;
  const bool sp = c.sequence_parallel;
  // MultiLatentAttention.__init__: mscale = get_mscale(rotary_scaling_factor, mscale_all_dim),
  // whatever the rope type.
  const double m = yarn_get_mscale(c.rotary_scaling_factor, c.mscale_all_dim);
  softmax_scale_ = m * m / std::sqrt(static_cast<double>(dq));
  // Megatron's construction order (and so its parameter order): core attention and linear_proj
  // in the base class, then the projections, then the norms. The projections have no bias.
  core_attention =
      register_module("core_attention", std::make_shared<CoreAttention>(c, softmax_scale_));
  linear_proj = register_module(
      "linear_proj", std::make_shared<Linear>(a * c.v_head_dim / t, h, c.add_bias_linear, true,
                                              dtype, LinearParallel::kRow, sp));
  if (c.q_lora_rank) {
    linear_q_down_proj = register_module(
        "linear_q_down_proj", std::make_shared<Linear>(h, *c.q_lora_rank, false, false, dtype,
                                                       LinearParallel::kNone, sp));
    linear_q_up_proj = register_module(
        "linear_q_up_proj", std::make_shared<Linear>(*c.q_lora_rank, a * dq / t, false, false,
                                                     dtype, LinearParallel::kColumn, sp));
  } else {
    linear_q_proj = register_module(
        "linear_q_proj",
        std::make_shared<Linear>(h, a * dq / t, false, false, dtype, LinearParallel::kColumn, sp));
  }
  linear_kv_down_proj =
      register_module("linear_kv_down_proj",
                      std::make_shared<Linear>(h, c.kv_lora_rank + c.qk_pos_emb_head_dim, false,
                                               false, dtype, LinearParallel::kNone, sp));
  linear_kv_up_proj = register_module(
      "linear_kv_up_proj",
      std::make_shared<Linear>(c.kv_lora_rank, a * (c.qk_head_dim + c.v_head_dim) / t, false, false,
                               dtype, LinearParallel::kColumn, sp));
  if (c.qk_layernorm) {
    if (c.q_lora_rank) {
      q_layernorm =
          register_module("q_layernorm", std::make_shared<Norm>(c, dtype, *c.q_lora_rank));
    }
    kv_layernorm =
        register_module("kv_layernorm", std::make_shared<Norm>(c, dtype, c.kv_lora_rank));
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> MLASelfAttention::down(const at::Tensor& x) {
  // Megatron's _qkv_down_projection, then the split and the norms.
  at::Tensor q_c = x;  // without q_lora_rank, linear_q_proj reads the hidden states
  if (linear_q_down_proj) {
    ModuleScope scope("linear_q_down_proj");
    q_c = linear_q_down_proj->forward(x).first;  // [s, b, q_lora_rank]
  }
  at::Tensor kv_combined;
  {
    ModuleScope scope("linear_kv_down_proj");
    kv_combined = linear_kv_down_proj->forward(x).first;  // [s, b, kv_lora_rank + pos]
  }
  const auto parts = kv_combined.split_with_sizes({kv_lora_rank_, pos_dim_}, -1);
  at::Tensor kv_c = parts[0];
  // Note [MLA under tensor parallelism]: every rank's heads use the whole k_pos.
  at::Tensor k_pos = parts[1];
  if (tensor_parallel_group().size > 1) {
    k_pos = sequence_parallel_ ? gather_from_sequence_parallel_region(k_pos)
                               : copy_to_tensor_parallel_region(k_pos);
  }
  if (q_layernorm) {
    ModuleScope scope("q_layernorm");
    q_c = q_layernorm->forward(q_c);
  }
  if (kv_layernorm) {
    ModuleScope scope("kv_layernorm");
    kv_c = kv_layernorm->forward(kv_c);
  }
  return {q_c, kv_c, k_pos};
}

std::vector<at::Tensor> MLASelfAttention::up_and_rope(const std::vector<at::Tensor>& in,
                                                      const RotaryEmbedding& rope, int64_t offset) {
  const at::Tensor &q_c = in[0], &kv_c = in[1], &k_pos = in[2];
  // The whole sequence (the up projections gather it under sequence parallelism, as k_pos is).
  const int64_t s = k_pos.size(0), b = k_pos.size(1);
  at::Tensor q, kv;
  {
    ModuleScope scope(q_up_name());
    q = (linear_q_up_proj ? linear_q_up_proj : linear_q_proj)->forward(q_c).first;
  }
  {
    ModuleScope scope("linear_kv_up_proj");
    kv = linear_kv_up_proj->forward(kv_c).first;
  }
  ModuleScope scope("rotary_pos_emb");
  const auto qs = q.view({s, b, heads_, qk_head_dim_ + pos_dim_})
                      .split_with_sizes({qk_head_dim_, pos_dim_}, -1);
  const auto kvs = kv.view({s, b, heads_, qk_head_dim_ + v_head_dim_})
                       .split_with_sizes({qk_head_dim_, v_head_dim_}, -1);
  const at::Tensor q_pe = rope.apply(qs[1], offset);                // [s, b, a, pos]
  const at::Tensor k_pe = rope.apply(k_pos.unsqueeze(-2), offset);  // [s, b, 1, pos]
  // One RoPE key part per token, shared by every head.
  return {at::cat({qs[0], q_pe}, -1), at::cat({kvs[0], k_pe.expand({s, b, heads_, pos_dim_})}, -1),
          kvs[1].contiguous()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> MLASelfAttention::project(
    const at::Tensor& x, const RotaryEmbedding& rope, int64_t offset) {
  auto [q_c, kv_c, k_pos] = down(x);
  const std::vector<at::Tensor> qkv = up_and_rope({q_c, kv_c, k_pos}, rope, offset);
  return {qkv[0], qkv[1], qkv[2]};
}

std::pair<at::Tensor, at::Tensor> MLASelfAttention::forward(const at::Tensor& x,
                                                            const LayerContext& ctx) {
  TORCH_CHECK(ctx.rope != nullptr,
              "actmem::MLASelfAttention: needs MLA's rotary tables "
              "(LayerContext::rope; GPTModel builds them)");
  const bool train = is_training();
  auto group = [&](OffloadModule m) {
    return plan_.offloads(m) && train ? ctx.offloader : nullptr;
  };
  const RotaryEmbedding* rope = ctx.rope;
  // Selective "mla_up_proj" (Megatron's recompute_up_proj): output-discarding recompute of the
  // up-projections and RoPE; q, k and v are freed once core attention saved them and rebuilt
  // from the gradient hook of the core-attention output.
  const bool recompute_up = plan_.recomputes(RecomputeModule::kMlaUpProj) && train;
  CheckpointWithoutOutput up_ckpt;
  at::Tensor q, k, v;
  {
    // Megatron's qkv_linear group spans get_query_key_value_tensors: it starts at the hidden
    // states and commits on the query, releasing the hidden states.
    OffloadRegion region(group(OffloadModule::kQkvLinear), OffloadModule::kQkvLinear);
    const at::Tensor xs = region.enter(x);
    auto [q_c, kv_c, k_pos] = down(xs);
    std::vector<at::Tensor> qkv;
    if (recompute_up) {
      ModuleScope scope(q_up_name());
      qkv = up_ckpt.checkpoint(
          [this, rope](const TensorList& in) { return up_and_rope(in, *rope, 0); },
          {q_c, kv_c, k_pos});
      // Outputs that output-discarding recompute frees are not worth a copy.
      if (ctx.offloader != nullptr) {
        for (const auto& t : qkv) ctx.offloader->exclude_this_forward(t);
      }
    } else {
      qkv = up_and_rope({q_c, kv_c, k_pos}, *rope, 0);
    }
    q = region.commit(qkv[0], {xs});
    k = qkv[1];
    v = qkv[2];
  }
  const at::Tensor context =  // [s, b, a * v_head_dim]
      run_core_attention(core_attention, plan_.recomputes(RecomputeModule::kCoreAttn) && train,
                         group(OffloadModule::kCoreAttn), q, k, v, ctx.attention_mask);
  if (recompute_up) up_ckpt.discard_output_and_register_recompute(context);
  return run_linear_proj(*linear_proj, group(OffloadModule::kAttnProj), context);
}

void MLASelfAttention::init_weights(WeightInit& init) {
  const int64_t t = init.tp_size();
  auto draw = [&](Linear& l, double sd) { l.weight.copy_(init.normal(l.weight.sizes(), sd)); };
  auto draw_rows = [&](Linear& l, double sd) {
    l.weight.copy_(init.rows(init.normal({l.weight.size(0) * t, l.weight.size(1)}, sd)));
  };
  const int64_t h = linear_proj->weight.size(0);
  linear_proj->weight.copy_(
      init.cols(init.normal({h, linear_proj->weight.size(1) * t}, init.scaled_std())));
  if (linear_q_proj) {
    draw_rows(*linear_q_proj, init.std());
  } else {
    draw(*linear_q_down_proj, init.std());
    draw_rows(*linear_q_up_proj, init.std());
  }
  draw(*linear_kv_down_proj, init.std());
  draw_rows(*linear_kv_up_proj, init.std());
}

std::unique_ptr<DecodeState> MLASelfAttention::make_decode_state(
    int64_t capacity, const at::TensorOptions& options) const {
  return std::make_unique<KVCacheState>(capacity, heads_, qk_head_dim_ + pos_dim_, v_head_dim_,
                                        options);
}

std::pair<at::Tensor, at::Tensor> MLASelfAttention::decode(const at::Tensor& x, DecodeState* state,
                                                           int64_t offset,
                                                           const LayerContext& ctx) {
  TORCH_CHECK(ctx.rope != nullptr, "actmem::MLASelfAttention: needs MLA's rotary tables");
  // MLA rotates its decoupled part inside the projection.
  const auto [q, k, v] = project(x, *ctx.rope, offset);
  const bool fp32 = fp32_softmax_ && is_16bit(x.scalar_type());
  const at::Tensor context =
      static_cast<KVCacheState*>(state)->attend(q, k, v, offset, softmax_scale_, fp32);
  return linear_proj->forward(context);
}

}  // namespace actmem
