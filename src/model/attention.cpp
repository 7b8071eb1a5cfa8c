// attention.cpp — core attention, rotary embeddings, SelfAttention and MLASelfAttention
// (attention.h).
#include "actmem/model/attention.h"

#include "actmem/memory/ledger.h"
#include "actmem/offload/activation_offloader.h"
#include "actmem/parallel/tensor_parallel.h"
#include "actmem/recompute/recompute.h"
#include "actmem/recompute/rng.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cmath>

namespace actmem {

namespace {
// Note [Softmax in fp32]
// --attention-softmax-in-fp32 at 16 bits: the softmax runs in fp32 on the upcast scores and its
// output is rounded back to 16 bits, which is what backward keeps (2as^2b bytes, Korthikanti's
// term), as Megatron's fused scale-mask-softmax kernels do; backward recomputes in fp32 from the
// kept 16-bit output. Composing at::softmax with casts instead would keep the fp32 output
// (twice the bytes).
struct Fp32SoftmaxFunction : torch::autograd::Function<Fp32SoftmaxFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x) {
    const at::Tensor y = at::_softmax(x.to(at::kFloat), -1, false).to(x.scalar_type());
    ctx->save_for_backward({y});
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor y = ctx->get_saved_variables()[0];
    const at::Tensor dx = at::_softmax_backward_data(grads[0].to(at::kFloat), y.to(at::kFloat), -1,
                                                     at::kFloat);
    return {dx.to(y.scalar_type())};
  }
};
}  // namespace

// ---- CoreAttention ----------------------------------------------------------------------------

CoreAttention::CoreAttention(const TransformerConfig& config, double softmax_scale)
    : softmax_scale_(softmax_scale),
      kernel_(config.attention_kernel()),
      dropout_(config.attention_dropout),
      sequence_parallel_(config.sequence_parallel),
      softmax_in_fp32_(config.attention_softmax_in_fp32) {}

at::Tensor make_causal_mask(int64_t s, const at::Device& device) {
  return at::ones({s, s}, at::TensorOptions().dtype(at::kBool).device(device))
      .triu(1)
      .view({1, 1, s, s});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> split_qkv(const at::Tensor& qkv, int64_t heads,
                                                         int64_t groups, int64_t head_dim) {
  const int64_t s = qkv.size(0), b = qkv.size(1), per_group = heads / groups;
  const auto parts = qkv.view({s, b, groups, (per_group + 2) * head_dim})
                         .split_with_sizes({per_group * head_dim, head_dim, head_dim}, -1);
  // [s, b, G, a/G d] -> [s, b, a, d]: a copy with several heads per group, as Megatron's reshape.
  return {parts[0].reshape({s, b, heads, head_dim}), parts[1], parts[2]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> split_gated_qkv(const at::Tensor& qkv,
                                                                           int64_t heads,
                                                                           int64_t groups,
                                                                           int64_t head_dim) {
  const int64_t s = qkv.size(0), b = qkv.size(1), per_group = heads / groups;
  const auto parts =
      qkv.view({s, b, groups, (2 * per_group + 2) * head_dim})
          .split_with_sizes({per_group * head_dim, per_group * head_dim, head_dim, head_dim}, -1);
  return {parts[0].reshape({s, b, heads, head_dim}), parts[1].reshape({s, b, heads, head_dim}),
          parts[2], parts[3]};
}

at::Tensor apply_output_gate(const at::Tensor& context, const at::Tensor& gate) {
  const at::Tensor g = gate.contiguous().view(context.sizes());
  // gate.float() in Megatron; fp64 runs (the reference tests) stay in fp64.
  return (context * at::sigmoid(g.to(compute_dtype(g.scalar_type())))).to(context.scalar_type());
}

at::Tensor expand_kv_heads(const at::Tensor& x, int64_t heads) {
  const int64_t groups = x.size(2);
  if (groups == heads) return x;
  TORCH_CHECK(heads % groups == 0, "actmem::expand_kv_heads: ", groups,
              " key/value heads do not divide ", heads, " query heads");
  const int64_t s = x.size(0), b = x.size(1), d = x.size(3);
  return x.unsqueeze(3).expand({s, b, groups, heads / groups, d}).reshape({s, b, heads, d});
}

at::Tensor CoreAttention::forward(const at::Tensor& q, const at::Tensor& k_in,
                                  const at::Tensor& v_in, const at::Tensor& mask) {
  forward_counters().core_attention.fetch_add(1, std::memory_order_relaxed);
  if (kernel_ == AttentionKernel::kFlash) return flash_forward(q, k_in, v_in);
  const int64_t s = q.size(0), b = q.size(1), a = q.size(2), d = q.size(3), dv = v_in.size(3);
  const at::Tensor k = expand_kv_heads(k_in, a), v = expand_kv_heads(v_in, a);
  // [s, b, a, d] -> [b*a, s, d]; a view when q, k, v are slices of the fused qkv output.
  const at::Tensor q3 = q.reshape({s, b * a, d}).transpose(0, 1);
  const at::Tensor k3t = k.reshape({s, b * a, d}).permute({1, 2, 0});  // [b*a, d, s]
  const at::Tensor v3 = v.reshape({s, b * a, dv}).transpose(0, 1);
  at::Tensor scores = at::bmm(q3, k3t);  // [b*a, s, s]
  scores.mul_(softmax_scale_ > 0.0 ? softmax_scale_ : 1.0 / std::sqrt(static_cast<double>(d)));
  at::Tensor scores4 = scores.view({b, a, s, s});
  // Megatron's attention_mask_func; the mask may be larger than s (a prefix of the model's table).
  scores4.masked_fill_(mask.narrow(2, 0, s).narrow(3, 0, s), -10000.0);
  at::Tensor probs = softmax_in_fp32_ && is_16bit(scores4.scalar_type())
                         ? Fp32SoftmaxFunction::apply(scores4)  // Note [Softmax in fp32]
                         : at::softmax(scores4, -1);
  {
    // As in Megatron (model_parallel_cuda_manual_seed, megatron/core/tensor_parallel/random.py),
    // dropout inside the tensor-parallel region draws from the model-parallel stream
    // (seed + 2718 + tp_rank), so ranks drop their own heads independently. With sequence
    // parallelism the block already runs in that stream (Megatron does not fork twice).
    const std::optional<RngFork> fork =
        is_training() && dropout_ > 0.0 && !sequence_parallel_
            ? fork_model_parallel_rng(tensor_parallel_group().size > 1,
                                      "actmem::CoreAttention: tensor-parallel attention dropout")
            : std::nullopt;
    probs = apply_dropout(probs, dropout_, is_training());
  }
  const at::Tensor context = at::bmm(probs.view({b * a, s, s}), v3);  // [b*a, s, dv]
  return context.view({b, a, s, dv}).permute({2, 0, 1, 3}).reshape({s, b, a * dv});
}

// Note [The flash kernel's layout]
// The kernel takes [b, a, s, d] and accepts any strides, so q, k and v enter as permuted views
// of [s, b, heads, d] (no copy; k and v at their G heads: the kernel maps query head i to
// key/value head i / (a/G), Megatron's grouping). Its output follows the query's memory order,
// [s, b, a, d] in memory, so the context [s, b, a d] that linear_proj reads is a view of the
// output the kernel keeps: one storage, counted once (on core_attention, which saves it first).
// Backward keeps q, k, v, the output and the logsumexp [b, a, s] in fp32 (fp64 for double). The
// mask is the causal one (is_causal): the model's mask is always causal (make_causal_mask).
at::Tensor CoreAttention::flash_forward(const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v) {
  TORCH_CHECK(q.device().is_cpu(),
              "actmem::CoreAttention: the flash kernel runs on CPU here; "
              "CUDA's is not wired yet (use --attention-backend unfused on ",
              q.device(), ")");
  const int64_t s = q.size(0), b = q.size(1), a = q.size(2), dv = v.size(3);
  const std::optional<double> scale =
      softmax_scale_ > 0.0 ? std::optional<double>(softmax_scale_) : std::nullopt;
  auto result = at::_scaled_dot_product_flash_attention_for_cpu(
      q.permute({1, 2, 0, 3}), k.permute({1, 2, 0, 3}), v.permute({1, 2, 0, 3}),
      /*dropout_p=*/0.0, /*is_causal=*/true, /*attn_mask=*/std::nullopt, scale);
  // [b, a, s, dv] -> [s, b, a dv]: a view when the output is [s, b, a, dv] in memory.
  return std::get<0>(result).permute({2, 0, 1, 3}).reshape({s, b, a * dv});
}

// ---- RotaryEmbedding --------------------------------------------------------------------------

RotaryEmbedding::RotaryEmbedding(const TransformerConfig& config, at::ScalarType dtype) {
  // Partial RoPE (--rotary-percent): the tables cover the first rotary_dim() features; apply
  // passes the rest through (Megatron's apply_rotary_pos_emb_bshd: t, t_pass).
  const int64_t d = config.rotary_dim();
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor inv_freq = 1.0 / at::pow(config.rotary_base, at::arange(0, d, 2, f64) / d);
  const at::Tensor t = at::arange(config.max_positions(), f64);
  const at::Tensor freqs = at::outer(t, inv_freq);          // [s, d/2]
  const at::Tensor emb = at::cat({freqs, freqs}, -1);        // [s, d]
  cos = emb.cos().to(dtype).view({emb.size(0), 1, 1, d});
  sin = emb.sin().to(dtype).view({emb.size(0), 1, 1, d});
}

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
    concentration = yarn_get_mscale(factor, config.mscale) /
                    yarn_get_mscale(factor, config.mscale_all_dim);
  }
  const at::Tensor t = at::arange(config.max_positions(), f64);
  const at::Tensor freqs = at::outer(t, inv_freq);    // [s, d/2]
  const at::Tensor emb = at::cat({freqs, freqs}, -1);  // [s, d]
  RotaryEmbedding r;
  r.cos = (emb.cos() * concentration).to(dtype).view({emb.size(0), 1, 1, d});
  r.sin = (emb.sin() * concentration).to(dtype).view({emb.size(0), 1, 1, d});
  r.mla_interleaved_ = true;
  return r;
}

at::Tensor RotaryEmbedding::apply(const at::Tensor& x_in, int64_t offset) const {
  const int64_t s = x_in.size(0);
  TORCH_CHECK(offset >= 0 && offset + s <= cos.size(0), "actmem::RotaryEmbedding: positions [",
              offset, ", ", offset + s, ") beyond the table of ", cos.size(0));
  // Note [MLA's RoPE]: even features first, then odd ones.
  const at::Tensor x = mla_interleaved_ ? at::cat({x_in.slice(-1, 0, c10::nullopt, 2),
                                                  x_in.slice(-1, 1, c10::nullopt, 2)}, -1)
                                        : x_in;
  const int64_t rot = cos.size(-1);
  if (rot < x.size(-1)) {  // partial RoPE: rotate the first rot features, pass the rest
    return at::cat({rotate(x.narrow(-1, 0, rot), offset), x.narrow(-1, rot, x.size(-1) - rot)}, -1);
  }
  return rotate(x, offset);
}

at::Tensor RotaryEmbedding::rotate(const at::Tensor& x, int64_t offset) const {
  const int64_t s = x.size(0);
  const auto halves = x.chunk(2, -1);
  const at::Tensor rotated = at::cat({-halves[1], halves[0]}, -1);
  return x * cos.narrow(0, offset, s) + rotated * sin.narrow(0, offset, s);
}

// ---- SelfAttention ----------------------------------------------------------------------------

namespace {
// What both attentions do after their q, k, v (Megatron's Attention.forward and
// MultiLatentAttention.forward share it): core attention, in a checkpoint under selective
// core_attn — only q, k, v (and the random state) kept, the [b, a, s, s] scores, probabilities
// and dropout mask rebuilt in backward — or inside the core_attn offload group, whose commit
// releases q, k and v (not read again in forward: their storage goes once copied).
// `kept_elsewhere`: tensors saved outside the group (the q/k norms' inputs) whose storage q, k or
// v may share; such a storage is not released at the commit (it is copied, and stays).
at::Tensor run_core_attention(const std::shared_ptr<CoreAttention>& core, bool recompute,
                              ActivationOffloader* offload_group, const at::Tensor& q,
                              const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                              const std::vector<at::Tensor>& kept_elsewhere = {}) {
  ModuleScope scope("core_attention");
  if (recompute) {
    return checkpoint(
        [core, mask](const TensorList& in) {
          return TensorList{core->forward(in[0], in[1], in[2], mask)};
        },
        /*distribute_saved_activations=*/false, {q, k, v})[0];
  }
  OffloadRegion region(offload_group, to_string(OffloadModule::kCoreAttn));
  const at::Tensor qs = region.enter(q);
  std::vector<at::Tensor> forced;
  for (const at::Tensor& x : {q, k, v}) {
    const bool shared = std::any_of(kept_elsewhere.begin(), kept_elsewhere.end(),
                                    [&x](const at::Tensor& y) { return y.is_alias_of(x); });
    if (!shared) forced.push_back(x);
  }
  return region.commit(core->forward(qs, k, v, mask), forced);
}

// linear_proj in the attn_proj offload group, which releases the context at its commit.
std::pair<at::Tensor, at::Tensor> run_linear_proj(Linear& proj, ActivationOffloader* offload_group,
                                                  const at::Tensor& context) {
  ModuleScope scope("linear_proj");
  OffloadRegion region(offload_group, to_string(OffloadModule::kAttnProj));
  auto [out, bias] = proj.forward(region.enter(context));
  return {region.commit(out, {context}), bias};
}
}  // namespace

SelfAttention::SelfAttention(const TransformerConfig& config, const LayerPlan& plan,
                             at::ScalarType dtype)
    : heads_(config.num_attention_heads / config.tensor_model_parallel_size),
      groups_(config.query_groups() / config.tensor_model_parallel_size),
      head_dim_(config.kv_channels()),
      output_gate_(config.attention_output_gate),
      plan_(plan) {
  const int64_t h = config.hidden_size, t = config.tensor_model_parallel_size;
  const bool sp = config.sequence_parallel;
  // Each tensor-parallel rank holds a/t heads in G/t whole groups: (a + 2G) d / t rows of
  // linear_qkv (3h/t without grouping; a d / t more with the output gate), a d / t columns of
  // linear_proj (h/t unless --kv-channels makes a d differ from h).
  const int64_t a = config.num_attention_heads;
  const int64_t qkv_rows = (a * (output_gate_ ? 2 : 1) + 2 * config.query_groups()) * head_dim_;
  linear_qkv = register_module(
      "linear_qkv", std::make_shared<Linear>(h, qkv_rows / t, config.add_bias_linear, false, dtype,
                                             LinearParallel::kColumn, sp));
  if (config.qk_layernorm) {
    // Megatron's q_layernorm / k_layernorm over hidden_size_per_attention_head: one [d] weight
    // shared by every head, each tensor rank normalising its own heads, so its gradient is a
    // partial sum (Megatron sums them over the tensor group in finalize_model_grads).
    q_layernorm = register_module("q_layernorm", std::make_shared<Norm>(config, dtype, head_dim_));
    k_layernorm = register_module("k_layernorm", std::make_shared<Norm>(config, dtype, head_dim_));
    q_layernorm->partial_over_heads = true;
    k_layernorm->partial_over_heads = true;
  }
  core_attention = register_module("core_attention", std::make_shared<CoreAttention>(config));
  linear_proj =
      register_module("linear_proj", std::make_shared<Linear>(config.query_projection_size() / t, h,
                                                              config.add_bias_linear, true, dtype,
                                                              LinearParallel::kRow, sp));
}

SelfAttention::Projected SelfAttention::project(const at::Tensor& x, const RotaryEmbedding* rope,
                                                int64_t offset, ActivationOffloader* qkv_group) {
  Projected p;
  {
    // Megatron's qkv_linear offload group wraps get_query_key_value_tensors: linear_qkv, the
    // split and the q/k norms, so what the norms keep moves with it; its commit carries the
    // fused output (without the norms) or the normed q (the others' backward reaches the reload
    // through their own saved tensors).
    OffloadRegion region(qkv_group, to_string(OffloadModule::kQkvLinear));
    at::Tensor qkv;
    {
      ModuleScope scope("linear_qkv");
      qkv = linear_qkv->forward(region.enter(x)).first;
    }
    if (!q_layernorm) qkv = region.commit(qkv);
    if (output_gate_) {
      std::tie(p.q, p.gate, p.k, p.v) = split_gated_qkv(qkv, heads_, groups_, head_dim_);
    } else {
      std::tie(p.q, p.k, p.v) = split_qkv(qkv, heads_, groups_, head_dim_);
    }
    // Note [Forced release and the q/k norms]: the norms keep their inputs, q's view or copy and
    // k's view of linear_qkv's output, which v (and the gate, when a view) is a view of too. The
    // core_attn offload group must then not free that storage at its commit, or the k norm's
    // backward (and the gate, still to be read) would read freed bytes; Megatron's
    // Attention.forward passes forced_released_tensors = [query, key, value] with or without the
    // norms. Found by GatedExactness's UngroupedFlashLayerNorm_OffloadEveryGroup.
    if (p.gate.defined()) p.kept_elsewhere.push_back(p.gate);
    if (q_layernorm) {
      p.kept_elsewhere.push_back(p.q);
      p.kept_elsewhere.push_back(p.k);
      {
        ModuleScope scope("q_layernorm");
        p.q = q_layernorm->forward(p.q);
      }
      {
        ModuleScope scope("k_layernorm");
        p.k = k_layernorm->forward(p.k);
      }
      p.q = region.commit(p.q);
    }
  }
  if (rope != nullptr) {
    ModuleScope scope("rotary_pos_emb");
    p.q = rope->apply(p.q, offset);
    p.k = rope->apply(p.k, offset);
  }
  return p;
}

std::pair<at::Tensor, at::Tensor> SelfAttention::forward(const at::Tensor& x,
                                                         const LayerContext& ctx) {
  // With sequence parallelism x is the [s/t, b, h] shard; linear_qkv's output covers all s.
  // Fine-grained offload (Megatron's
  // megatron/core/pipeline_parallel/fine_grained_activation_offload.py; docs/offload.md): a
  // module's group starts at its input and commits at its output; what it saves in between goes
  // to the host (activation_offloader.h). A region the plan does not ask for is inert.
  auto group = [&](OffloadModule m) {
    return plan_.offloads(m) && is_training() ? ctx.offloader : nullptr;
  };
  const Projected p = project(x, ctx.rope, 0, group(OffloadModule::kQkvLinear));
  at::Tensor context =  // [s, b, a d]
      run_core_attention(
          core_attention, plan_.recomputes(RecomputeModule::kCoreAttn) && is_training(),
          group(OffloadModule::kCoreAttn), p.q, p.k, p.v, ctx.attention_mask, p.kept_elsewhere);
  if (p.gate.defined()) {
    ModuleScope scope("output_gate");
    context = apply_output_gate(context, p.gate);
  }
  return run_linear_proj(*linear_proj, group(OffloadModule::kAttnProj), context);
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
      q_layernorm = register_module("q_layernorm", std::make_shared<Norm>(c, dtype, *c.q_lora_rank));
    }
    kv_layernorm = register_module("kv_layernorm", std::make_shared<Norm>(c, dtype, c.kv_lora_rank));
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
  const auto qs = q.view({s, b, heads_, qk_head_dim_ + pos_dim_}).split_with_sizes({qk_head_dim_, pos_dim_}, -1);
  const auto kvs = kv.view({s, b, heads_, qk_head_dim_ + v_head_dim_})
                       .split_with_sizes({qk_head_dim_, v_head_dim_}, -1);
  const at::Tensor q_pe = rope.apply(qs[1], offset);                  // [s, b, a, pos]
  const at::Tensor k_pe = rope.apply(k_pos.unsqueeze(-2), offset);    // [s, b, 1, pos]
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
  TORCH_CHECK(ctx.rope != nullptr, "actmem::MLASelfAttention: needs MLA's rotary tables "
              "(LayerContext::rope; GPTModel builds them)");
  const bool train = is_training();
  auto group = [&](OffloadModule m) { return plan_.offloads(m) && train ? ctx.offloader : nullptr; };
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
    OffloadRegion region(group(OffloadModule::kQkvLinear), to_string(OffloadModule::kQkvLinear));
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

}  // namespace actmem
