// model.cpp — GPTModel and its modules. Shapes: s = sequence, b = micro-batch, h = hidden,
// a = heads, d = head dim, f = ffn hidden, v = vocab.
#include "actmem/model/model.h"

#include "actmem/memory/ledger.h"
#include "actmem/memory/memory_tracker.h"
#include "actmem/offload/activation_offloader.h"
#include "actmem/recompute/recompute.h"
#include "actmem/recompute/rng.h"
#include "actmem/parallel/tensor_parallel.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/record_function.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cmath>
#include <optional>

namespace actmem {

namespace {

// A module whose only parameter is "weight", so names read embedding.word_embeddings.weight.
class WeightHolder : public torch::nn::Module {
 public:
  explicit WeightHolder(at::Tensor w) { weight = register_parameter("weight", std::move(w)); }
  at::Tensor weight;
};

// Initialisation draws from one generator seeded with config.seed, in construction order, so a
// model is a pure function of its config (it does not touch the global RNG that dropout uses).
thread_local at::Generator* t_init_gen = nullptr;

at::Tensor init_normal(at::IntArrayRef shape, double std, at::ScalarType dtype) {
  TORCH_INTERNAL_ASSERT(t_init_gen != nullptr, "init_normal outside GPTModel construction");
  at::NoGradGuard no_grad;
  // A 16-bit model is the fp32 model rounded: the draws are made in fp32 (the same numbers as
  // an fp32 run) and cast, as Megatron initialises in fp32 and converts to params_dtype.
  const at::ScalarType draw = is_16bit(dtype) ? at::kFloat : dtype;
  return at::empty(shape, at::TensorOptions().dtype(draw)).normal_(0.0, std, *t_init_gen).to(dtype);
}

// Forks model-parallel-rng unless it is already the current stream (the tensor-parallel dropout
// stream of Megatron's model_parallel_cuda_manual_seed; docs/parallelism.md). Without that
// stream: an error naming `api` when `required`, else no fork (a bare single-process model).
std::optional<RngFork> fork_model_parallel_rng(bool required, const char* api) {
  auto& tracker = get_rng_tracker();
  if (tracker.current_state_name() == kModelParallelRng) return std::nullopt;
  if (!tracker.has(kModelParallelRng)) {
    TORCH_CHECK(!required, api, " needs the model-parallel random stream (call "
                "model_parallel_manual_seed first)");
    return std::nullopt;
  }
  return tracker.fork(kModelParallelRng);
}

// An MoE layer's weights, in the order router, experts (fc1 then fc2 of each), shared experts
// (fc1, fc2, gate): fc2 layers take the residual projections' scaled std, as Megatron's MLP.
// This tensor rank's slice of a full fc1 weight [fc1_rows, h] (column-parallel: its rows) and
// of a full fc2 weight [h, f] (row-parallel: its columns). SwiGLU's fc1 is [gate; up]: each rank
// keeps its slice of both halves, in that order, so chunk(2) of its local output still splits
// gate from up.
at::Tensor fc1_slice(const at::Tensor& full, bool gated) {
  const TensorParallelGroup& tp = tensor_parallel_group();
  if (tp.size == 1) return full;
  if (!gated) return full.chunk(tp.size, 0)[tp.rank];
  const auto halves = full.chunk(2, 0);
  return at::cat({halves[0].chunk(tp.size, 0)[tp.rank], halves[1].chunk(tp.size, 0)[tp.rank]}, 0);
}
at::Tensor fc2_slice(const at::Tensor& full) {
  const TensorParallelGroup& tp = tensor_parallel_group();
  return tp.size == 1 ? full : full.chunk(tp.size, 1)[tp.rank];
}

void init_moe_layer(MoELayer& moe, const TransformerConfig& c, double std, double scaled_std,
                    at::ScalarType dtype) {
  const int64_t h = c.hidden_size, f = c.moe_ffn(), fc1_rows = c.gated_linear_unit ? 2 * f : f;
  const bool gated = c.gated_linear_unit;
  moe.router->weight.copy_(init_normal({c.num_moe_experts, h}, std, dtype));
  Experts& e = *moe.experts;
  // Every expert-parallel rank draws all E experts in order and keeps its own E/e, and of them
  // its tensor rank's slice (expert tensor parallelism), so the model is the same function of
  // the config for any t and e.
  const int64_t local = c.num_moe_experts / c.expert_model_parallel_size;
  const int64_t first = expert_parallel_group().rank * local;
  for (int64_t g = 0; g < c.num_moe_experts; ++g) {
    const at::Tensor fc1 = init_normal({fc1_rows, h}, std, dtype);
    const at::Tensor fc2 = init_normal({h, f}, scaled_std, dtype);
    if (g < first || g >= first + local) continue;
    const auto j = static_cast<size_t>(g - first);
    if (e.linear_fc1) {
      e.linear_fc1->weights[j].copy_(fc1_slice(fc1, gated));
      e.linear_fc2->weights[j].copy_(fc2_slice(fc2));
    } else {
      e.local_experts[j]->fc1_weight.copy_(fc1_slice(fc1, gated));
      e.local_experts[j]->fc2_weight.copy_(fc2_slice(fc2));
    }
  }
  if (moe.shared_experts) {
    const int64_t fs = *c.moe_shared_expert_intermediate_size;
    moe.shared_experts->linear_fc1->weight.copy_(
        fc1_slice(init_normal({gated ? 2 * fs : fs, h}, std, dtype), gated));
    moe.shared_experts->linear_fc2->weight.copy_(fc2_slice(init_normal({h, fs}, scaled_std, dtype)));
    if (moe.shared_expert_gate.defined()) moe.shared_expert_gate.copy_(init_normal({1, h}, std, dtype));
  }
}

}  // namespace

ForwardCounters& forward_counters() {
  static ForwardCounters counters;
  return counters;
}

// ---- Norm -------------------------------------------------------------------------------------

Norm::Norm(const TransformerConfig& config, at::ScalarType dtype, int64_t size)
    : rms_(config.use_rmsnorm()), eps_(config.layernorm_epsilon) {
  const auto opts = at::TensorOptions().dtype(dtype);
  const int64_t n = size > 0 ? size : config.hidden_size;
  weight = register_parameter("weight", at::ones({n}, opts));
  if (!rms_) bias = register_parameter("bias", at::zeros({n}, opts));
}

namespace {
// Note [Fused RMSNorm]
// RMSNorm written as x * rsqrt(mean(x^2) + eps) * w uses x twice, so x's gradient arrives as two
// contributions that autograd adds to the residual's contribution in whatever order the graph
// produces them. Output-discarding recompute of the norm sums the two norm contributions first,
// which rounds differently. One node with an explicit backward (as fused GPU kernels have) gives
// x a single contribution, so every strategy sums the same two terms and stays bitwise exact.
// At 16 bits the norm computes in fp32 and keeps rstd in fp32 (sb * 4 bytes), as the fused
// kernels Megatron uses do; the input and output stay 16-bit.
struct RMSNormFunction : torch::autograd::Function<RMSNormFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, double eps) {
    const at::ScalarType acc = compute_dtype(x.scalar_type());
    const at::Tensor xa = x.to(acc);
    const at::Tensor rstd = at::rsqrt(xa.pow(2).mean({-1}, /*keepdim=*/true) + eps);  // [..., 1]
    ctx->save_for_backward({x, weight, rstd});
    return (xa * rstd * weight.to(acc)).to(x.scalar_type());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x16 = saved[0], &weight16 = saved[1], &rstd = saved[2];
    const at::ScalarType acc = rstd.scalar_type();
    const at::Tensor x = x16.to(acc), weight = weight16.to(acc), g = grads[0].to(acc);
    const at::Tensor gw = g * weight;
    // d/dx_j: rstd * gw_j - x_j * rstd^3 * mean_i(gw_i * x_i)
    const at::Tensor dx = rstd * gw - x * rstd.pow(3) * (gw * x).mean({-1}, /*keepdim=*/true);
    const at::Tensor dw = (g * x * rstd).reshape({-1, x.size(-1)}).sum(0);
    return {dx.to(x16.scalar_type()), dw.to(weight16.scalar_type()), at::Tensor()};
  }
};

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

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  RECORD_FUNCTION("actmem::rms_norm", std::vector<c10::IValue>());
  return RMSNormFunction::apply(x, weight, eps);
}

at::Tensor Norm::forward(const at::Tensor& x) {
  forward_counters().norm.fetch_add(1, std::memory_order_relaxed);
  if (!rms_) return at::layer_norm(x, {x.size(-1)}, weight, bias, eps_);
  return rms_norm(x, weight, eps_);
}

// ---- Linear -----------------------------------------------------------------------------------

Linear::Linear(int64_t in, int64_t out, bool bias_on, bool skip_bias_add, at::ScalarType dtype,
               LinearParallel parallel, bool sequence_parallel)
    : skip_bias_add_(skip_bias_add), parallel_(parallel), sequence_parallel_(sequence_parallel) {
  // The caller re-initialises weight with the right std; zeros here keep construction cheap.
  weight = register_parameter("weight", at::zeros({out, in}, at::TensorOptions().dtype(dtype)));
  if (bias_on) bias = register_parameter("bias", at::zeros({out}, at::TensorOptions().dtype(dtype)));
}

std::pair<at::Tensor, at::Tensor> Linear::forward(const at::Tensor& x) {
  switch (parallel_) {
    case LinearParallel::kColumn:
      if (skip_bias_add_) return {column_parallel_linear(x, weight, at::Tensor(), sequence_parallel_), bias};
      return {column_parallel_linear(x, weight, bias, sequence_parallel_), at::Tensor()};
    case LinearParallel::kRow: {
      // The bias is added after the reduction (once, not once per rank).
      at::Tensor out = row_parallel_linear(x, weight, sequence_parallel_);
      if (skip_bias_add_) return {out, bias};
      return {bias.defined() ? out + bias : out, at::Tensor()};
    }
    case LinearParallel::kNone:
      break;
  }
  if (skip_bias_add_) return {at::linear(x, weight), bias};
  return {at::linear(x, weight, bias), at::Tensor()};
}

// ---- dropout helpers --------------------------------------------------------------------------

at::Tensor apply_dropout(const at::Tensor& x, double p, bool training) {
  if (!training || p == 0.0) return x;
  // native_dropout saves a bool mask (1 byte per element) like the CUDA kernel; at::dropout on
  // CPU would save a float noise tensor instead.
  return std::get<0>(at::native_dropout(x, p, /*train=*/true));
}

at::Tensor bias_dropout_add(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& residual,
                            double p, bool training) {
  const at::Tensor biased = bias.defined() ? x + bias : x;
  return residual + apply_dropout(biased, p, training);
}

// ---- CoreAttention ----------------------------------------------------------------------------

CoreAttention::CoreAttention(const TransformerConfig& config, double softmax_scale)
    : softmax_scale_(softmax_scale),
      dropout_(config.attention_dropout),
      sequence_parallel_(config.sequence_parallel),
      softmax_in_fp32_(config.attention_softmax_in_fp32) {}

at::Tensor make_causal_mask(int64_t s, const at::Device& device) {
  return at::ones({s, s}, at::TensorOptions().dtype(at::kBool).device(device))
      .triu(1)
      .view({1, 1, s, s});
}

at::Tensor CoreAttention::forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& mask) {
  forward_counters().core_attention.fetch_add(1, std::memory_order_relaxed);
  const int64_t s = q.size(0), b = q.size(1), a = q.size(2), d = q.size(3), dv = v.size(3);
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

// ---- RotaryEmbedding --------------------------------------------------------------------------

RotaryEmbedding::RotaryEmbedding(const TransformerConfig& config, at::ScalarType dtype) {
  const int64_t d = config.kv_channels();
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
at::Tensor run_core_attention(const std::shared_ptr<CoreAttention>& core, bool recompute,
                              ActivationOffloader* offload_group, const at::Tensor& q,
                              const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask) {
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
  return region.commit(core->forward(qs, k, v, mask), {q, k, v});
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
      head_dim_(config.kv_channels()),
      plan_(plan) {
  const int64_t h = config.hidden_size, t = config.tensor_model_parallel_size;
  const bool sp = config.sequence_parallel;
  // Each tensor-parallel rank holds a/t heads: 3h/t rows of linear_qkv, h/t columns of linear_proj.
  linear_qkv = register_module(
      "linear_qkv", std::make_shared<Linear>(h, 3 * h / t, config.add_bias_linear, false, dtype,
                                             LinearParallel::kColumn, sp));
  core_attention = register_module("core_attention", std::make_shared<CoreAttention>(config));
  linear_proj = register_module(
      "linear_proj", std::make_shared<Linear>(h / t, h, config.add_bias_linear, true, dtype,
                                              LinearParallel::kRow, sp));
}

std::pair<at::Tensor, at::Tensor> SelfAttention::forward(const at::Tensor& x,
                                                         const LayerContext& ctx) {
  // With sequence parallelism x is the [s/t, b, h] shard; linear_qkv's output covers all s.
  const int64_t b = x.size(1);
  // Fine-grained offload (Megatron's
  // megatron/core/pipeline_parallel/fine_grained_activation_offload.py; docs/offload.md): a
  // module's group starts at its input and commits at its output; what it saves in between goes
  // to the host (activation_offloader.h). A region the plan does not ask for is inert.
  auto group = [&](OffloadModule m) {
    return plan_.offloads(m) && is_training() ? ctx.offloader : nullptr;
  };
  // Megatron's layout: [s, b, a, 3d], split per head into q, k, v.
  at::Tensor qkv;
  {
    ModuleScope scope("linear_qkv");
    OffloadRegion region(group(OffloadModule::kQkvLinear), to_string(OffloadModule::kQkvLinear));
    qkv = region.commit(linear_qkv->forward(region.enter(x)).first);
    qkv = qkv.view({qkv.size(0), b, heads_, 3 * head_dim_});
  }
  auto parts = qkv.split(head_dim_, -1);
  at::Tensor q = parts[0], k = parts[1], v = parts[2];
  if (ctx.rope != nullptr) {
    ModuleScope scope("rotary_pos_emb");
    q = ctx.rope->apply(q);
    k = ctx.rope->apply(k);
  }
  const at::Tensor context =  // [s, b, h]
      run_core_attention(core_attention, plan_.recompute_core_attn && is_training(),
                         group(OffloadModule::kCoreAttn), q, k, v, ctx.attention_mask);
  return run_linear_proj(*linear_proj, group(OffloadModule::kAttnProj), context);
}

// ---- MLASelfAttention -------------------------------------------------------------------------

MLASelfAttention::MLASelfAttention(const TransformerConfig& c, const LayerPlan& plan,
                                   at::ScalarType dtype)
    : heads_(c.num_attention_heads),
      qk_head_dim_(c.qk_head_dim),
      pos_dim_(c.qk_pos_emb_head_dim),
      v_head_dim_(c.v_head_dim),
      kv_lora_rank_(c.kv_lora_rank),
      plan_(plan) {
  const int64_t h = c.hidden_size, a = c.num_attention_heads, dq = c.mla_q_head_dim();
  // MultiLatentAttention.__init__: mscale = get_mscale(rotary_scaling_factor, mscale_all_dim),
  // whatever the rope type.
  const double m = yarn_get_mscale(c.rotary_scaling_factor, c.mscale_all_dim);
  softmax_scale_ = m * m / std::sqrt(static_cast<double>(dq));
  // Megatron's construction order (and so its parameter order): core attention and linear_proj
  // in the base class, then the projections, then the norms. The projections have no bias.
  core_attention =
      register_module("core_attention", std::make_shared<CoreAttention>(c, softmax_scale_));
  linear_proj = register_module(
      "linear_proj", std::make_shared<Linear>(a * c.v_head_dim, h, c.add_bias_linear, true, dtype,
                                              LinearParallel::kRow));
  if (c.q_lora_rank) {
    linear_q_down_proj = register_module(
        "linear_q_down_proj", std::make_shared<Linear>(h, *c.q_lora_rank, false, false, dtype));
    linear_q_up_proj = register_module(
        "linear_q_up_proj", std::make_shared<Linear>(*c.q_lora_rank, a * dq, false, false, dtype,
                                                     LinearParallel::kColumn));
  } else {
    linear_q_proj = register_module(
        "linear_q_proj",
        std::make_shared<Linear>(h, a * dq, false, false, dtype, LinearParallel::kColumn));
  }
  linear_kv_down_proj = register_module(
      "linear_kv_down_proj",
      std::make_shared<Linear>(h, c.kv_lora_rank + c.qk_pos_emb_head_dim, false, false, dtype));
  linear_kv_up_proj = register_module(
      "linear_kv_up_proj",
      std::make_shared<Linear>(c.kv_lora_rank, a * (c.qk_head_dim + c.v_head_dim), false, false,
                               dtype, LinearParallel::kColumn));
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
  if (q_layernorm) {
    ModuleScope scope("q_layernorm");
    q_c = q_layernorm->forward(q_c);
  }
  if (kv_layernorm) {
    ModuleScope scope("kv_layernorm");
    kv_c = kv_layernorm->forward(kv_c);
  }
  return {q_c, kv_c, parts[1]};
}

std::vector<at::Tensor> MLASelfAttention::up_and_rope(const std::vector<at::Tensor>& in,
                                                      const RotaryEmbedding& rope, int64_t offset) {
  const at::Tensor &q_c = in[0], &kv_c = in[1], &k_pos = in[2];
  const int64_t s = q_c.size(0), b = q_c.size(1);
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
  const bool recompute_up = plan_.recompute_mla_up_proj && train;
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
      run_core_attention(core_attention, plan_.recompute_core_attn && train,
                         group(OffloadModule::kCoreAttn), q, k, v, ctx.attention_mask);
  if (recompute_up) up_ckpt.discard_output_and_register_recompute(context);
  return run_linear_proj(*linear_proj, group(OffloadModule::kAttnProj), context);
}

// ---- MLP --------------------------------------------------------------------------------------

MLP::MLP(const TransformerConfig& config, at::ScalarType dtype) : gated_(config.gated_linear_unit) {
  const int64_t h = config.hidden_size, t = config.tensor_model_parallel_size;
  const int64_t f = config.ffn() / t;  // this rank's share of the MLP's hidden columns
  const bool sp = config.sequence_parallel;
  linear_fc1 = register_module(
      "linear_fc1", std::make_shared<Linear>(h, gated_ ? 2 * f : f, config.add_bias_linear, false,
                                             dtype, LinearParallel::kColumn, sp));
  linear_fc2 = register_module(
      "linear_fc2", std::make_shared<Linear>(f, h, config.add_bias_linear, true, dtype,
                                             LinearParallel::kRow, sp));
}

std::pair<at::Tensor, at::Tensor> MLP::forward(const at::Tensor& x) {
  forward_counters().mlp.fetch_add(1, std::memory_order_relaxed);
  at::Tensor fc1, act;
  {
    ModuleScope scope("linear_fc1");
    fc1 = linear_fc1->forward(x).first;  // [s, b, f] or [s, b, 2f]
  }
  {
    ModuleScope scope("activation_func");
    if (gated_) {
      const auto halves = fc1.chunk(2, -1);
      act = at::silu(halves[0]) * halves[1];
    } else {
      act = at::gelu(fc1);
    }
  }
  ModuleScope scope("linear_fc2");
  return linear_fc2->forward(act);
}

// ---- TransformerLayer -------------------------------------------------------------------------

TransformerLayer::TransformerLayer(const TransformerConfig& config, const LayerPlan& plan,
                                   int64_t layer_number, at::ScalarType dtype)
    : layer_number_(layer_number), hidden_dropout_(config.hidden_dropout), plan_(plan) {
  input_layernorm = register_module("input_layernorm", std::make_shared<Norm>(config, dtype));
  if (config.multi_latent_attention) {
    mla_attention = register_module("self_attention",
                                    std::make_shared<MLASelfAttention>(config, plan, dtype));
  } else {
    self_attention =
        register_module("self_attention", std::make_shared<SelfAttention>(config, plan, dtype));
  }
  pre_mlp_layernorm = register_module("pre_mlp_layernorm", std::make_shared<Norm>(config, dtype));
  if (plan.moe) {
    moe = register_module("mlp", std::make_shared<MoELayer>(config, plan, layer_number, dtype));
  } else {
    mlp = register_module("mlp", std::make_shared<MLP>(config, dtype));
  }
}

namespace {
// A layer's norm, plain or (selective "layernorm") output-discarding: its output is freed once
// its consumer has saved it, and recomputed from the gradient hook of the consumer's module
// output (Megatron's hook tensors: the attention output for input_layernorm, the MLP output for
// pre_mlp_layernorm), which finish() registers.
class LayerNormStep {
 public:
  LayerNormStep(std::shared_ptr<Norm> norm, bool discard, ActivationOffloader* offloader)
      : norm_(std::move(norm)), discard_(discard), offloader_(offloader) {}
  at::Tensor operator()(const at::Tensor& x) {
    if (!discard_) return norm_->forward(x);
    auto norm = norm_;
    const at::Tensor out =
        ckpt_.checkpoint([norm](const TensorList& in) { return TensorList{norm->forward(in[0])}; },
                         {x})[0];
    // A norm output that output-discarding recompute frees is not worth a copy.
    if (offloader_ != nullptr) offloader_->exclude_this_forward(out);
    return out;
  }
  void finish(const at::Tensor& hook_tensor) {
    if (discard_) ckpt_.discard_output_and_register_recompute(hook_tensor);
  }

 private:
  std::shared_ptr<Norm> norm_;
  bool discard_;
  ActivationOffloader* offloader_;
  CheckpointWithoutOutput ckpt_;
};
}  // namespace

std::pair<at::Tensor, at::Tensor> TransformerLayer::run_mlp(const at::Tensor& x,
                                                            const LayerContext& ctx) {
  if (moe) return moe->forward(x, ctx.offloader);
  if (plan_.recompute_mlp && is_training()) {
    // Selective "mlp": the whole MLP in one checkpoint; fc2's bias is a parameter, not an
    // activation, so it is returned beside the checkpoint as Megatron does.
    const at::Tensor out = checkpoint(
        [this](const TensorList& in) { return TensorList{mlp->forward(in[0]).first}; }, false,
        {x})[0];
    return {out, mlp->linear_fc2->bias};
  }
  return mlp->forward(x);
}

// One half of a layer, as Megatron's _forward_attention and _forward_mlp: a norm, its module and
// the bias-dropout-add. The attn_norm and mlp_norm offload groups start at the norm's input and
// commit after the bias-dropout-add (which reads the residual, the norm's input), then release
// the residual (Megatron's placement); they capture only what the norm saves.
at::Tensor TransformerLayer::norm_module_bda(const at::Tensor& hidden, const LayerContext& ctx,
                                             const HalfLayer& half, const ModuleFn& module) {
  const bool train = is_training();
  ActivationOffloader* off = train ? ctx.offloader : nullptr;
  OffloadRegion region(plan_.offloads(half.group) ? off : nullptr, to_string(half.group));
  LayerNormStep norm(half.norm, plan_.discard_norm_outputs && train, off);
  at::Tensor ln;
  {
    ModuleScope scope(half.norm_name);
    ln = norm(region.enter(hidden));
    region.end_capture();
  }
  at::Tensor out, bias;
  {
    ModuleScope scope(half.module_name);
    std::tie(out, bias) = module(ln);
  }
  norm.finish(out);
  ModuleScope scope(half.bda_name);
  return region.commit(bias_dropout_add(out, bias, hidden, hidden_dropout_, train), {hidden});
}

at::Tensor TransformerLayer::forward_attention(const at::Tensor& hidden, const LayerContext& ctx) {
  return norm_module_bda(
      hidden, ctx, {input_layernorm, OffloadModule::kAttnNorm, "input_layernorm", "self_attention",
                    "self_attn_bda"},
      [&](const at::Tensor& ln) {
        return mla_attention ? mla_attention->forward(ln, ctx) : self_attention->forward(ln, ctx);
      });
}

at::Tensor TransformerLayer::forward_mlp(const at::Tensor& hidden, const LayerContext& ctx) {
  return norm_module_bda(hidden, ctx, {pre_mlp_layernorm, OffloadModule::kMlpNorm,
                                       "pre_mlp_layernorm", "mlp", "mlp_bda"},
                         [&](const at::Tensor& ln) { return run_mlp(ln, ctx); });
}

at::Tensor TransformerLayer::forward(const at::Tensor& hidden, const LayerContext& ctx) {
  forward_counters().layer.fetch_add(1, std::memory_order_relaxed);
  return forward_mlp(forward_attention(hidden, ctx), ctx);
}

// ---- TransformerBlock -------------------------------------------------------------------------

namespace {
class LayerList : public torch::nn::Module {};

// Marks `label` on the active timeline when the gradient of `t` is computed.
void mark_on_backward(const at::Tensor& t, std::string label) {
  // Not inside a checkpoint's no-grad forward: the hook would sit on the checkpoint's input.
  if (active_timeline() == nullptr || !at::GradMode::is_enabled() || !t.requires_grad()) return;
  t.register_hook([label = std::move(label)](const at::Tensor&) { timeline_mark(label); });
}
}  // namespace

TransformerBlock::TransformerBlock(const TransformerConfig& config, const ActivationPlan& plan,
                                   at::ScalarType dtype, TransformerConfig::StageLayers stage,
                                   bool post_process)
    : config_(config), plan_(plan), offset_(stage.offset) {
  // Registered as layers.0 .. layers.(count - 1) on every stage (Megatron's local numbering);
  // their layer_number is global (offset + i + 1).
  auto list = register_module("layers", std::make_shared<LayerList>());
  for (int64_t i = 0; i < stage.count; ++i) {
    const int64_t global = stage.offset + i;
    layers.push_back(list->register_module(
        std::to_string(i), std::make_shared<TransformerLayer>(
                               config, plan.layers[static_cast<size_t>(global)], global + 1, dtype)));
  }
  if (post_process) {
    final_layernorm = register_module("final_layernorm", std::make_shared<Norm>(config, dtype));
  }
}

at::Tensor TransformerBlock::run_layers(at::Tensor hidden, int64_t start, int64_t end,
                                        const LayerContext& ctx) {
  const std::string prefix = is_recomputing() ? "recompute layer " : "fwd layer ";
  ActivationOffloader* off = is_training() ? ctx.offloader : nullptr;
  // start and end are global layer indices (the plan's); layers[] holds this stage's.
  for (int64_t i = start; i < end; ++i) {
    const LayerPlan& lp = plan_.layers[static_cast<size_t>(i)];
    mark_on_backward(hidden, "bwd layer " + std::to_string(i));
    ModuleScope scope("layers", i);
    // Layer-level offload (Megatron's cpu_offloading_num_layers, which runs each layer in
    // Transformer Engine's CPU offload context; docs/offload.md): what each of the first K
    // layers saves goes to the host when its forward ends, and comes back one layer ahead of its
    // backward. Every layer opens a group, so the backward reaching layer K starts the reload
    // of layer K - 1 (OffloadSchedule's prefetch order).
    OffloadRegion region(lp.layer_group ? off : nullptr, "layer", GroupKind::kLayer,
                         lp.offload_layer);
    hidden = region.commit(
        layers[static_cast<size_t>(i - offset_)]->forward(region.enter(hidden), ctx));
    timeline_mark(prefix + std::to_string(i));
  }
  return hidden;
}

at::Tensor TransformerBlock::forward(const at::Tensor& hidden_in, const LayerContext& ctx) {
  at::Tensor hidden = hidden_in;
  // With sequence parallelism every layer works on this rank's tokens, so all of the block's
  // dropout draws from the model-parallel stream (Megatron's TransformerBlock.forward).
  const bool any_dropout = config_.hidden_dropout > 0.0 || config_.attention_dropout > 0.0;
  const std::optional<RngFork> sp_fork =
      config_.sequence_parallel && is_training() && any_dropout
          ? fork_model_parallel_rng(true, "actmem::TransformerBlock: sequence parallelism")
          : std::nullopt;
  const int64_t L = offset_ + static_cast<int64_t>(layers.size());  // one past this stage's last
  if ((plan_.full_recompute() || checkpoint_every_layer_) && is_training()) {
    // Megatron's checkpointed_forward: only each chunk's input is kept. The plan's chunks never
    // cross a stage boundary (check_activation_plan); this stage runs its own.
    std::vector<CheckpointChunk> every_layer;
    if (checkpoint_every_layer_) {
      for (int64_t i = offset_; i < L; ++i) every_layer.push_back({i, i + 1});
    }
    int64_t next = offset_;
    for (const auto& chunk : checkpoint_every_layer_ ? every_layer : plan_.chunks) {
      if (chunk.start < offset_ || chunk.start >= L) continue;
      hidden = run_layers(hidden, next, chunk.start, ctx);  // layers before a block chunk: plain
      ModuleScope scope("layers", chunk.start);  // the chunk's saved input belongs to its first layer
      hidden = checkpoint(
          [this, start = chunk.start, end = chunk.end, ctx](const TensorList& in) {
            return TensorList{run_layers(in[0], start, end, ctx)};
          },
          plan_.distribute_saved_activations, {hidden})[0];
      next = chunk.end;
    }
    hidden = run_layers(hidden, next, L, ctx);
  } else {
    hidden = run_layers(hidden, offset_, L, ctx);
  }
  if (!final_layernorm) return hidden;  // not the last pipeline stage
  mark_on_backward(hidden, "bwd head");
  ModuleScope scope("final_layernorm");
  return final_layernorm->forward(hidden);
}

// ---- GPTModel ---------------------------------------------------------------------------------

at::ScalarType params_dtype(const TransformerConfig& config) {
  return config.bf16 ? at::kBFloat16 : config.fp16 ? at::kHalf : at::kFloat;
}

GPTModel::GPTModel(const TransformerConfig& config, at::ScalarType dtype)
    : GPTModel(config, make_activation_plan(config), dtype) {}  // validates the config

GPTModel::GPTModel(const TransformerConfig& config, ActivationPlan plan, at::ScalarType requested)
    : config_(config), plan_(std::move(plan)) {
  // The plan replaces the config's recompute and offload flags, so only the shape is checked
  // here (a plan from make_activation_plan() was checked against the flags already).
  config_.validate_shape();
  check_activation_plan(config_, plan_);
  const at::ScalarType dtype =
      requested == at::ScalarType::Undefined ? params_dtype(config) : requested;
  TORCH_CHECK(dtype == params_dtype(config) || (dtype == at::kDouble && !is_16bit(params_dtype(config))),
              "actmem::GPTModel: the config's precision is ", config.precision(),
              " (parameters in ", params_dtype(config), ") but dtype ", dtype, " was requested; "
              "double is accepted for an fp32 config only");
  dtype_ = dtype;
  const int64_t h = config.hidden_size, v = config.vocab_size;
  const TensorParallelGroup& tp = tensor_parallel_group();
  TORCH_CHECK(tp.size == config.tensor_model_parallel_size, "actmem::GPTModel: "
              "tensor_model_parallel_size is ", config.tensor_model_parallel_size, " but this process ",
              "is in a tensor-parallel group of ", tp.size, tp.size == 1 ? " (run it under `actmem "
              "launch --nproc-per-node " + std::to_string(config.tensor_model_parallel_size) + "`)" : "");
  TORCH_CHECK(expert_parallel_group().size == config.expert_model_parallel_size,
              "actmem::GPTModel: expert_model_parallel_size is ", config.expert_model_parallel_size,
              " but this process is in an expert-parallel group of ", expert_parallel_group().size,
              expert_parallel_group().size == 1 ? " (run it under `actmem launch` with a multiple of "
              "tensor x expert parallel sizes as the number of processes)" : "");
  const TensorParallelGroup& pp = pipeline_parallel_group();
  TORCH_CHECK(pp.size == config.pipeline_model_parallel_size, "actmem::GPTModel: "
              "pipeline_model_parallel_size is ", config.pipeline_model_parallel_size, " but this "
              "process is in a pipeline of ", pp.size, pp.size == 1 ? " (run it under `actmem launch` "
              "with a multiple of tensor x pipeline parallel sizes as the number of processes)" : "");
  for (int64_t chunk = 0; chunk < config.virtual_pipeline_size(); ++chunk) {
    chunks_.push_back(config.model_chunk_layers(pp.rank, chunk));
  }
  pre_process_ = pp.rank == 0;
  post_process_ = pp.rank == pp.size - 1;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(config.seed);
  t_init_gen = &gen;
  struct Reset {
    ~Reset() { t_init_gen = nullptr; }
  } reset;

  const double std = config.init_method_std;
  // Megatron's output_layer_init_method: std / sqrt(2 * num_layers) for the residual projections.
  const double scaled_std = std / std::sqrt(2.0 * static_cast<double>(config.num_layers));

  // Note [Pipeline stages draw the whole model]
  // Every stage draws every weight in the single-process order and keeps its own (the layers of
  // other stages are built, drawn and dropped one at a time), so a model split into p stages is
  // the same function for every p: runs compare across layouts and a stage's weights do not
  // depend on the split. (Megatron initialises each stage from seed + 100 * pipeline rank.)
  const at::Tensor word = init_normal({v, h}, std, dtype);
  const at::Tensor positions =
      config.use_rope() ? at::Tensor() : init_normal({config.max_positions(), h}, std, dtype);
  if (pre_process_) {
    auto embedding = register_module("embedding", std::make_shared<torch::nn::Module>());
    word_embeddings =
        embedding->register_module("word_embeddings", std::make_shared<WeightHolder>(word))->weight;
    if (positions.defined()) {
      position_embeddings =
          embedding->register_module("position_embeddings", std::make_shared<WeightHolder>(positions))
              ->weight;
    }
  }
  // The RoPE tables: MLA's attention rotates its own decoupled part (Note [MLA's RoPE]) and
  // Megatron's GPTModel builds no model-level RoPE for it (learned absolute positions still
  // apply unless --position-embedding-type rope); standard attention's with rope.
  if (config.multi_latent_attention) {
    rope_ = std::make_unique<RotaryEmbedding>(RotaryEmbedding::for_mla(config, dtype));
  } else if (config.use_rope()) {
    rope_ = std::make_unique<RotaryEmbedding>(config, dtype);
  }
  if (rope_) {
    auto holder = register_module("rotary_pos_emb", std::make_shared<torch::nn::Module>());
    rope_->cos = holder->register_buffer("cos", rope_->cos);
    rope_->sin = holder->register_buffer("sin", rope_->sin);
  }
  causal_mask_ = make_causal_mask(config.max_positions());
  // One TransformerBlock per model chunk (Megatron builds one model per virtual stage); the
  // final norm belongs to the last chunk of the last stage.
  for (size_t chunk = 0; chunk < chunks_.size(); ++chunk) {
    const bool last_chunk = chunk + 1 == chunks_.size();
    decoders_.push_back(register_module(
        chunk == 0 ? std::string("decoder") : "decoder_vp" + std::to_string(chunk),
        std::make_shared<TransformerBlock>(config, plan_, dtype, chunks_[chunk],
                                           post_process_ && last_chunk)));
  }
  decoder = decoders_.front();
  {
    // Every rank draws the full (t = 1) weights in the same order and keeps its slice, so a
    // tensor-parallel model computes the same function as the single-process one (Megatron's
    // _initialize_affine_weight_cpu).
    at::NoGradGuard no_grad;
    const int r = tp.rank, t = tp.size;
    const int64_t f = config.ffn();
    auto rows = [&](const at::Tensor& full) { return full.chunk(t, 0)[r]; };
    auto cols = [&](const at::Tensor& full) { return full.chunk(t, 1)[r]; };
    auto init_layer = [&](TransformerLayer* layer) {
      if (MLASelfAttention* mla = layer->mla_attention.get()) {
        // Megatron's construction order: linear_proj, the query projection(s), kv down and up.
        auto draw = [&](Linear& l, double sd) {
          l.weight.copy_(init_normal(l.weight.sizes(), sd, dtype));
        };
        draw(*mla->linear_proj, scaled_std);
        if (mla->linear_q_proj) {
          draw(*mla->linear_q_proj, std);
        } else {
          draw(*mla->linear_q_down_proj, std);
          draw(*mla->linear_q_up_proj, std);
        }
        draw(*mla->linear_kv_down_proj, std);
        draw(*mla->linear_kv_up_proj, std);
      } else {
        layer->self_attention->linear_qkv->weight.copy_(rows(init_normal({3 * h, h}, std, dtype)));
        layer->self_attention->linear_proj->weight.copy_(
            cols(init_normal({h, h}, scaled_std, dtype)));
      }
      if (layer->moe) {
        init_moe_layer(*layer->moe, config, std, scaled_std, dtype);
        return;
      }
      layer->mlp->linear_fc1->weight.copy_(fc1_slice(
          init_normal({config.gated_linear_unit ? 2 * f : f, h}, std, dtype), config.gated_linear_unit));
      layer->mlp->linear_fc2->weight.copy_(fc2_slice(init_normal({h, f}, scaled_std, dtype)));
    };
    for (int64_t i = 0; i < config.num_layers; ++i) {
      const auto mine = std::find_if(chunks_.begin(), chunks_.end(),
                                     [i](const TransformerConfig::StageLayers& l) { return l.contains(i); });
      if (mine != chunks_.end()) {
        const auto& block = decoders_[static_cast<size_t>(mine - chunks_.begin())];
        init_layer(block->layers[static_cast<size_t>(i - mine->offset)].get());
      } else {  // another stage's layer: drawn to keep the order, then dropped
        TransformerLayer other(config, plan_.layers[static_cast<size_t>(i)], i + 1, dtype);
        init_layer(&other);
      }
    }
  }
  for (const auto& layer : all_layers()) {
    if (!layer->moe) continue;
    MoEStats::Layer stats;
    stats.layer_number = layer->layer_number();
    moe_stats_.layers.push_back(std::move(stats));
  }
  size_t next_moe = 0;  // the vector is complete: its elements stay where they are
  for (const auto& layer : all_layers()) {
    if (layer->moe) layer->moe->set_stats(&moe_stats_.layers[next_moe++]);
  }
  if (!post_process_) return;
  if (config.untie_embeddings_and_output_weights) {
    output_weight = register_module("output_layer",
                                    std::make_shared<WeightHolder>(init_normal({v, h}, std, dtype)))
                        ->weight;
  } else if (pre_process_) {
    output_weight = word_embeddings;
  } else {
    // Megatron's LanguageModule on the last stage: its own copy of the tied weight, registered as
    // output_layer.weight, its gradient summed with the first stage's over the embedding group
    // so the two copies stay equal (Trainer, finalize_model_grads).
    output_weight = register_module("output_layer", std::make_shared<WeightHolder>(word))->weight;
  }
}

at::Tensor GPTModel::shared_embedding_or_output_weight() const {
  if (config_.untie_embeddings_and_output_weights) return {};
  return pre_process_ ? word_embeddings : output_weight;
}

void GPTModel::set_checkpoint_every_layer(bool on) {
  for (const auto& block : decoders_) block->set_checkpoint_every_layer(on);
}

void GPTModel::set_moe_aux_loss_scale(double scale) {
  for (const auto& layer : all_layers()) {
    if (layer->moe) layer->moe->set_aux_loss_scale(scale);
  }
}

at::Tensor GPTModel::embed(const at::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2, "actmem::GPTModel: expected tokens [b, s], got ", tokens.sizes());
  const int64_t s = tokens.size(1);
  TORCH_CHECK(s <= config_.max_positions(), "actmem::GPTModel: sequence of ", s,
              " tokens exceeds max_position_embeddings ", config_.max_positions());
  at::Tensor words = at::embedding(word_embeddings, tokens);  // [b, s, h]
  if (position_embeddings.defined()) {
    words = words + position_embeddings.narrow(0, 0, s);  // broadcast over b
  }
  return words.transpose(0, 1).contiguous();  // [s, b, h]
}

at::Tensor GPTModel::embedding_forward(const at::Tensor& tokens) {
  timeline_mark("fwd start");
  ModuleScope scope("embedding");
  at::Tensor hidden = embed(tokens);
  // Each rank keeps its s/t tokens (a copy, so the full embedding output is freed) and drops
  // them with its own stream, as Megatron's LanguageModelEmbedding does.
  if (config_.sequence_parallel) hidden = scatter_to_sequence_parallel_region(hidden);
  const std::optional<RngFork> fork =
      config_.sequence_parallel && is_training() && config_.hidden_dropout > 0.0
          ? fork_model_parallel_rng(true, "actmem::GPTModel: sequence parallelism")
          : std::nullopt;
  hidden = apply_dropout(hidden, config_.hidden_dropout, is_training());
  timeline_mark("fwd embedding");
  return hidden;
}

at::Tensor GPTModel::decoder_forward(const at::Tensor& hidden, int64_t chunk) {
  // Every chunk's layers under "decoder" in the ledger: their paths carry the global layer index.
  ModuleScope scope("decoder");
  return decoders_[static_cast<size_t>(chunk)]->forward(
      hidden, LayerContext{rope_.get(), causal_mask_, offloader_});
}

std::vector<std::shared_ptr<TransformerLayer>> GPTModel::all_layers() const {
  std::vector<std::shared_ptr<TransformerLayer>> out;
  for (const auto& block : decoders_) out.insert(out.end(), block->layers.begin(), block->layers.end());
  return out;
}

at::Tensor GPTModel::output_logits(at::Tensor hidden) {
  ModuleScope scope("output_layer");
  // The output layer is replicated (docs/parallelism.md): with sequence parallelism the shards
  // are gathered, and backward keeps this rank's slice of the (identical) full gradient.
  if (config_.sequence_parallel) hidden = gather_from_sequence_parallel_region(hidden, false);
  return at::matmul(hidden, output_weight.t());  // [s, b, v]
}

void GPTModel::check_whole_model(const char* api) const {
  TORCH_CHECK(pre_process_ && post_process_, api, ": needs the whole model; this is pipeline "
              "stage ", pipeline_parallel_group().rank, " of ", config_.pipeline_model_parallel_size,
              " (use forward_stage)");
}

at::Tensor GPTModel::logits(const at::Tensor& tokens) {
  check_whole_model("actmem::GPTModel::logits");
  return output_logits(decoder_forward(embedding_forward(tokens), 0));
}

at::Tensor GPTModel::forward(const at::Tensor& tokens, const at::Tensor& labels) {
  check_whole_model("actmem::GPTModel::forward");
  return forward_stage(tokens, labels, at::Tensor());
}

at::Tensor GPTModel::forward_stage(const at::Tensor& tokens, const at::Tensor& labels,
                                   const at::Tensor& input, int64_t chunk) {
  TORCH_CHECK(chunk >= 0 && chunk < num_model_chunks(), "actmem::GPTModel::forward_stage: model "
              "chunk ", chunk, " outside 0..", num_model_chunks() - 1);
  TORCH_CHECK(!(pre_process_ && post_process_) || labels.sizes() == tokens.sizes(),
              "actmem::GPTModel::forward: labels ", labels.sizes(), " must match tokens ",
              tokens.sizes());
  at::Tensor hidden;
  if (chunk_pre_process(chunk)) {
    hidden = embedding_forward(tokens);
  } else {
    TORCH_CHECK(input.defined(), "actmem::GPTModel::forward_stage: pipeline stage ",
                pipeline_parallel_group().rank, " (model chunk ", chunk, ") needs the previous "
                "stage's output as input");
    hidden = input;
  }
  hidden = decoder_forward(hidden, chunk);
  if (!chunk_post_process(chunk)) return hidden;
  const at::Tensor out = output_logits(hidden);
  const int64_t v = out.size(-1);
  ModuleScope scope("loss");
  // At 16 bits the loss is computed in fp32 (Megatron's vocab_parallel_cross_entropy of
  // output.float()): the cast keeps nothing, the log-softmax keeps its fp32 output.
  at::Tensor loss = at::cross_entropy_loss(out.reshape({-1, v}).to(compute_dtype(out.scalar_type())),
                                           labels.t().reshape({-1}));
  timeline_mark("fwd loss");
  return loss;
}

void GPTModel::to_device(const at::Device& device) {
  to(device);  // parameters and buffers (the RoPE tables) move in place
  causal_mask_ = causal_mask_.to(device);
}

std::vector<at::Tensor> GPTModel::ordered_parameters() const { return parameters(); }

namespace {
bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
}  // namespace

std::vector<bool> GPTModel::tensor_parallel_flags() const {
  std::vector<bool> flags;
  for (const auto& item : named_parameters()) {
    const std::string& n = item.key();
    // The grouped experts' fc2 weights are named linear_fc2.weight0, .weight1, ...
    flags.push_back(config_.tensor_model_parallel_size > 1 &&
                    (n.find("linear_qkv.") != std::string::npos ||
                     n.find("linear_fc1.") != std::string::npos ||
                     ends_with(n, "linear_proj.weight") || ends_with(n, "linear_fc2.weight") ||
                     n.find("linear_fc2.weight") != std::string::npos));
  }
  return flags;
}

std::vector<bool> GPTModel::expert_parallel_flags() const {
  std::vector<bool> flags;
  for (const auto& item : named_parameters()) {
    flags.push_back(item.key().find(".mlp.experts.") != std::string::npos);
  }
  return flags;
}

std::vector<at::Tensor> GPTModel::sequence_parallel_parameters() const {
  std::vector<at::Tensor> out;
  if (!config_.sequence_parallel) return out;
  for (const auto& item : named_parameters()) {
    const std::string& n = item.key();
    // The MoE router's weight and bias and the shared experts' gate read this rank's tokens
    // only; the routed experts' fc2 biases are added by tensor rank 0 only (moe.h).
    if (n.find("layernorm.") != std::string::npos || ends_with(n, "linear_proj.bias") ||
        ends_with(n, "linear_fc2.bias") || n.find(".experts.linear_fc2.bias") != std::string::npos ||
        n.find(".mlp.router.") != std::string::npos || ends_with(n, "shared_experts.gate_weight")) {
      out.push_back(item.value());
    }
  }
  return out;
}

int64_t GPTModel::num_parameters() const {
  int64_t n = 0;
  for (const auto& p : parameters()) n += p.numel();
  return n;
}

}  // namespace actmem
