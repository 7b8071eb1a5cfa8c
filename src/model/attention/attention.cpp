// attention.cpp — core attention, rotary embeddings, SelfAttention and generation's key/value
// cache (attention.h).
#include "actmem/model/attention/attention.h"

#include "actmem/model/fp8.h"

#include "actmem/model/weight_init.h"

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
    const at::Tensor dx =
        at::_softmax_backward_data(grads[0].to(at::kFloat), y.to(at::kFloat), -1, at::kFloat);
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
  const at::Tensor freqs = at::outer(t, inv_freq);     // [s, d/2]
  const at::Tensor emb = at::cat({freqs, freqs}, -1);  // [s, d]
  cos = emb.cos().to(dtype).view({emb.size(0), 1, 1, d});
  sin = emb.sin().to(dtype).view({emb.size(0), 1, 1, d});
}

at::Tensor RotaryEmbedding::apply(const at::Tensor& x_in, int64_t offset) const {
  const int64_t s = x_in.size(0);
  TORCH_CHECK(offset >= 0 && offset + s <= cos.size(0), "actmem::RotaryEmbedding: positions [",
              offset, ", ", offset + s, ") beyond the table of ", cos.size(0));
  // Note [MLA's RoPE]: even features first, then odd ones.
  const at::Tensor x =
      mla_interleaved_
          ? at::cat({x_in.slice(-1, 0, c10::nullopt, 2), x_in.slice(-1, 1, c10::nullopt, 2)}, -1)
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

// q, k and v are not read again in forward after the core attention: at the core_attn group's
// commit their storage goes once copied (attention.h).
at::Tensor run_core_attention(const std::shared_ptr<CoreAttention>& core, bool recompute,
                              ActivationOffloader* offload_group, const at::Tensor& q,
                              const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                              const std::vector<at::Tensor>& kept_elsewhere) {
  ModuleScope scope("core_attention");
  if (recompute) {
    return checkpoint(
        [core, mask](const TensorList& in) {
          return TensorList{core->forward(in[0], in[1], in[2], mask)};
        },
        /*distribute_saved_activations=*/false, {q, k, v})[0];
  }
  OffloadRegion region(offload_group, OffloadModule::kCoreAttn);
  const at::Tensor qs = region.enter(q);
  std::vector<at::Tensor> forced;
  for (const at::Tensor& x : {q, k, v}) {
    const bool shared = std::any_of(kept_elsewhere.begin(), kept_elsewhere.end(),
                                    [&x](const at::Tensor& y) { return y.is_alias_of(x); });
    if (!shared) forced.push_back(x);
  }
  return region.commit(core->forward(qs, k, v, mask), forced);
}

std::pair<at::Tensor, at::Tensor> run_linear_proj(Linear& proj, ActivationOffloader* offload_group,
                                                  const at::Tensor& context) {
  ModuleScope scope("linear_proj");
  OffloadRegion region(offload_group, OffloadModule::kAttnProj);
  auto [out, bias] = proj.forward(region.enter(context));
  return {region.commit(out, {context}), bias};
}

SelfAttention::SelfAttention(const TransformerConfig& config, const LayerPlan& plan,
                             at::ScalarType dtype)
    : heads_(config.num_attention_heads / config.tensor_model_parallel_size),
      groups_(config.query_groups() / config.tensor_model_parallel_size),
      head_dim_(config.kv_channels()),
      output_gate_(config.attention_output_gate),
      fp32_softmax_(config.attention_softmax_in_fp32),
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
    OffloadRegion region(qkv_group, OffloadModule::kQkvLinear);
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

AttentionFp8Inputs attention_fp8_keeps_original(bool delayed_scaling, const LayerPlan& plan) {
  return {fp8_keeps_recomputed_norm_output(delayed_scaling, plan), !delayed_scaling};
}

void SelfAttention::use_fp8(const std::shared_ptr<Fp8Registry>& registry) {
  PartModule::use_fp8(registry);
  const AttentionFp8Inputs keep = attention_fp8_keeps_original(registry->recipe().delayed, plan_);
  linear_qkv->fp8_save_original_input = keep.qkv_original;
  linear_proj->fp8_save_original_input = keep.proj_original;
}

void SelfAttention::init_weights(WeightInit& init) {
  const int64_t t = init.tp_size();
  const int64_t h = linear_qkv->weight.size(1);
  linear_qkv->weight.copy_(init.rows(init.normal({linear_qkv->weight.size(0) * t, h}, init.std())));
  linear_proj->weight.copy_(
      init.cols(init.normal({h, linear_proj->weight.size(1) * t}, init.scaled_std())));
}

// ---- generation -------------------------------------------------------------------------------

KVCacheState::KVCacheState(int64_t capacity, int64_t kv_heads, int64_t key_dim, int64_t value_dim,
                           const at::TensorOptions& options)
    : keys(at::empty({capacity, kv_heads, key_dim}, options)),
      values(at::empty({capacity, kv_heads, value_dim}, options)) {}

int64_t KVCacheState::bytes() const {
  return static_cast<int64_t>(keys.nbytes() + values.nbytes());
}

at::Tensor KVCacheState::attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                int64_t offset, double scale, bool fp32_softmax) {
  const int64_t n = q.size(0), heads = q.size(2), value_dim = values.size(2);
  const int64_t total = offset + n;
  keys.narrow(0, offset, n).copy_(k.squeeze(1));
  values.narrow(0, offset, n).copy_(v.squeeze(1));
  // Query i (position offset + i) sees keys 0..offset + i: mask the keys after it.
  const auto positions = at::TensorOptions().dtype(at::kLong).device(q.device());
  const at::Tensor masked =
      at::arange(total, positions).unsqueeze(0) > at::arange(offset, total, positions).unsqueeze(1);
  // The cache keeps G key/value heads; each serves its group's a/G query heads.
  const at::Tensor kk = expand_kv_heads(keys.narrow(0, 0, total).unsqueeze(1), heads)
                            .squeeze(1)
                            .permute({1, 2, 0});  // [a, d, T]
  const at::Tensor vv = expand_kv_heads(values.narrow(0, 0, total).unsqueeze(1), heads)
                            .squeeze(1)
                            .transpose(0, 1);                     // [a, T, d]
  at::Tensor scores = at::bmm(q.squeeze(1).transpose(0, 1), kk);  // [a, n, T]
  scores.mul_(scale);
  scores.masked_fill_(masked.unsqueeze(0), -10000.0);  // Megatron's attention_mask_func value
  const at::Tensor probs = fp32_softmax
                               ? at::softmax(scores.to(at::kFloat), -1).to(scores.scalar_type())
                               : at::softmax(scores, -1);
  return at::bmm(probs, vv).transpose(0, 1).reshape({n, 1, heads * value_dim});  // [n, 1, a*dv]
}

std::unique_ptr<DecodeState> SelfAttention::make_decode_state(
    int64_t capacity, const at::TensorOptions& options) const {
  return std::make_unique<KVCacheState>(capacity, groups_, head_dim_, head_dim_, options);
}

std::pair<at::Tensor, at::Tensor> SelfAttention::decode(const at::Tensor& x, DecodeState* state,
                                                        int64_t offset, const LayerContext& ctx) {
  // Megatron's layout, q/k norms, RoPE from position `offset`.
  const Projected p = project(x, ctx.rope, offset);
  const bool fp32 = fp32_softmax_ && is_16bit(x.scalar_type());
  at::Tensor context = static_cast<KVCacheState*>(state)->attend(
      p.q, p.k, p.v, offset, 1.0 / std::sqrt(static_cast<double>(head_dim_)), fp32);
  if (p.gate.defined()) context = apply_output_gate(context, p.gate);
  return linear_proj->forward(context);
}

}  // namespace actmem
