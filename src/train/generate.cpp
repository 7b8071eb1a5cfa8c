// generate.cpp — the KV cache and sampling (generate.h).
#include "actmem/train/generate.h"

#include "actmem/model/model.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

#include <cmath>

namespace actmem {

namespace {
// The per-head widths of the cached keys and values: the head dimension, or for MLA the
// up-projected keys (qk_head_dim + qk_pos_emb_head_dim) and values (v_head_dim).
std::pair<int64_t, int64_t> cached_head_dims(const TransformerConfig& c) {
  if (c.multi_latent_attention) return {c.mla_q_head_dim(), c.v_head_dim};
  return {c.kv_channels(), c.kv_channels()};
}
}  // namespace

KVCache::KVCache(GPTModel& model)
    : model_(model),
      capacity_(model.config().max_positions()),
      heads_(model.config().num_attention_heads),
      kv_heads_(model.config().multi_latent_attention ? model.config().num_attention_heads
                                                      : model.config().query_groups()),
      key_dim_(cached_head_dims(model.config()).first),
      value_dim_(cached_head_dims(model.config()).second) {
  TORCH_CHECK(model.config().tensor_model_parallel_size == 1, "actmem::KVCache: generation runs "
              "on one process; the model has tensor_model_parallel_size ",
              model.config().tensor_model_parallel_size);
  TORCH_CHECK(!model.config().gated_delta_net(),
              "actmem::KVCache: generation with "
              "GatedDeltaNet layers (their recurrent state instead of a key/value cache) is not "
              "implemented");
  const auto opts = model.word_embeddings.options().requires_grad(false);
  for (size_t i = 0; i < model.decoder->layers.size(); ++i) {
    keys_.push_back(at::empty({capacity_, kv_heads_, key_dim_}, opts));
    values_.push_back(at::empty({capacity_, kv_heads_, value_dim_}, opts));
  }
}

int64_t KVCache::bytes() const {
  int64_t n = 0;
  for (size_t i = 0; i < keys_.size(); ++i) n += keys_[i].nbytes() + values_[i].nbytes();
  return n;
}

int64_t KVCache::bytes_for(const GPTModel& model) {
  const auto& c = model.config();
  // Keys and values of every layer: [max_positions, key/value heads, key / value head dim].
  const auto [key, value] = cached_head_dims(c);
  const int64_t kv_heads = c.multi_latent_attention ? c.num_attention_heads : c.query_groups();
  return static_cast<int64_t>(model.decoder->layers.size()) * c.max_positions() * kv_heads *
         (key + value) * static_cast<int64_t>(model.word_embeddings.element_size());
}

at::Tensor KVCache::feed(const std::vector<int64_t>& tokens) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  TORCH_CHECK(n > 0, "actmem::KVCache::feed: no tokens");
  TORCH_CHECK(length_ + n <= capacity_, "actmem::KVCache::feed: ", length_ + n, " positions exceed "
              "the model's max_position_embeddings ", capacity_);
  const auto& cfg = model_.config();
  for (const int64_t t : tokens) {
    TORCH_CHECK(t >= 0 && t < cfg.vocab_size, "actmem::KVCache::feed: token ", t,
                " outside the vocabulary [0, ", cfg.vocab_size, ")");
  }
  at::NoGradGuard no_grad;
  const bool was_training = model_.is_training();
  model_.eval();
  const at::Device device = model_.word_embeddings.device();
  const at::Tensor ids = at::tensor(tokens, at::kLong).to(device);
  const int64_t p0 = length_, total = p0 + n;
  // Embedding, as GPTModel::embed for positions [p0, p0 + n): [n, 1, h].
  at::Tensor hidden = at::embedding(model_.word_embeddings, ids);
  if (model_.position_embeddings.defined()) {
    hidden = hidden + model_.position_embeddings.narrow(0, p0, n);
  }
  hidden = hidden.unsqueeze(1);
  // Query i (position p0 + i) sees keys 0..p0 + i: mask the keys after it.
  const at::Tensor key_pos = at::arange(total, at::TensorOptions().dtype(at::kLong).device(device));
  const at::Tensor query_pos = at::arange(p0, total, at::TensorOptions().dtype(at::kLong).device(device));
  const at::Tensor masked = key_pos.unsqueeze(0) > query_pos.unsqueeze(1);  // [n, total]
  const double plain_scale = 1.0 / std::sqrt(static_cast<double>(key_dim_));
  const bool fp32_softmax = cfg.attention_softmax_in_fp32 && is_16bit(hidden.scalar_type());
  for (size_t l = 0; l < model_.decoder->layers.size(); ++l) {
    auto& layer = *model_.decoder->layers[l];
    const at::Tensor ln = layer.input_layernorm->forward(hidden);
    at::Tensor q, k, v, gate;
    double scale = plain_scale;
    if (layer.mla_attention) {
      // MLA rotates its decoupled part inside the projection.
      std::tie(q, k, v) = layer.mla_attention->project(ln, *model_.rope(), p0);
      scale = layer.mla_attention->softmax_scale();
    } else {
      // Megatron's layout, q/k norms, RoPE from position p0.
      const SelfAttention::Projected p = layer.self_attention->project(ln, model_.rope(), p0);
      std::tie(q, k, v, gate) = std::tie(p.q, p.k, p.v, p.gate);
    }
    keys_[l].narrow(0, p0, n).copy_(k.squeeze(1));
    values_[l].narrow(0, p0, n).copy_(v.squeeze(1));
    // The cache keeps G key/value heads; each serves its group's a/G query heads.
    const at::Tensor kk = expand_kv_heads(keys_[l].narrow(0, 0, total).unsqueeze(1), heads_)
                              .squeeze(1)
                              .permute({1, 2, 0});  // [a, d, T]
    const at::Tensor vv = expand_kv_heads(values_[l].narrow(0, 0, total).unsqueeze(1), heads_)
                              .squeeze(1)
                              .transpose(0, 1);                              // [a, T, d]
    at::Tensor scores = at::bmm(q.squeeze(1).transpose(0, 1), kk);           // [a, n, T]
    scores.mul_(scale);
    scores.masked_fill_(masked.unsqueeze(0), -10000.0);  // Megatron's attention_mask_func value
    const at::Tensor probs = fp32_softmax ? at::softmax(scores.to(at::kFloat), -1).to(scores.scalar_type())
                                          : at::softmax(scores, -1);
    at::Tensor context =
        at::bmm(probs, vv).transpose(0, 1).reshape({n, 1, heads_ * value_dim_});  // [n, 1, a*dv]
    if (gate.defined()) context = apply_output_gate(context, gate);
    Linear& proj = layer.mla_attention ? *layer.mla_attention->linear_proj
                                       : *layer.self_attention->linear_proj;
    auto [attn, attn_bias] = proj.forward(context);
    hidden = hidden + (attn_bias.defined() ? attn + attn_bias : attn);
    const at::Tensor ln2 = layer.pre_mlp_layernorm->forward(hidden);
    auto [mlp, mlp_bias] = layer.moe ? layer.moe->forward(ln2, nullptr) : layer.mlp->forward(ln2);
    hidden = hidden + (mlp_bias.defined() ? mlp + mlp_bias : mlp);
  }
  hidden = model_.decoder->final_layernorm->forward(hidden);
  const at::Tensor logits = at::matmul(hidden.squeeze(1), model_.output_weight.t());  // [n, v]
  length_ = total;
  if (was_training) model_.train();
  return logits.to(at::kFloat);
}

int64_t sample_token(const at::Tensor& all_logits, const SamplingOptions& o, at::Generator& gen) {
  TORCH_CHECK(all_logits.dim() == 1, "actmem::sample_token: expected logits [v]");
  TORCH_CHECK(o.vocab_size >= 0, "actmem::sample_token: expected vocab_size >= 0, got ",
              o.vocab_size);
  // The padding rows of the embedding are no token: Megatron's TorchSampling clamps a sampled
  // padding id to vocab_size - 1; here they are never drawn (on purpose: a clamp turns the
  // padding's probability into the last token's).
  const at::Tensor logits_in = o.vocab_size > 0 && o.vocab_size < all_logits.size(0)
                                   ? all_logits.narrow(0, 0, o.vocab_size)
                                   : all_logits;
  if (o.greedy) return logits_in.argmax().item<int64_t>();
  TORCH_CHECK(o.temperature > 0.0 && std::isfinite(o.temperature), "actmem: --temperature must be "
              "positive, got ", o.temperature);
  TORCH_CHECK(o.top_k >= 0, "actmem: --top-k must be >= 0, got ", o.top_k);
  TORCH_CHECK(o.top_p >= 0.0 && o.top_p <= 1.0, "actmem: --top-p must be in [0, 1], got ", o.top_p);
  at::Tensor logits = logits_in.to(at::kFloat) / o.temperature;
  const int64_t v = logits.size(0);
  // As Megatron's modify_logits_for_top_k_filtering / top_p: drop, then sample from the rest.
  if (o.top_k > 0 && o.top_k < v) {
    const at::Tensor kth = std::get<0>(at::topk(logits, o.top_k)).min();
    logits = logits.masked_fill(logits < kth, -INFINITY);
  }
  if (o.top_p > 0.0 && o.top_p < 1.0) {
    auto [sorted, order] = at::sort(logits, /*dim=*/0, /*descending=*/true);
    const at::Tensor probs = at::softmax(sorted, 0);
    // Remove a token when the tokens before it already reach p (the first always stays).
    const at::Tensor remove = (probs.cumsum(0) - probs) >= o.top_p;
    logits = logits.scatter(0, order, sorted.masked_fill(remove, -INFINITY));
  }
  const at::Tensor probs = at::softmax(logits, 0);
  return at::multinomial(probs, 1, /*replacement=*/false, gen).item<int64_t>();
}

std::vector<int64_t> generate(GPTModel& model, const std::vector<int64_t>& prompt,
                              const SamplingOptions& o, const std::function<void(int64_t)>& on_token) {
  TORCH_CHECK(!prompt.empty(), "actmem::generate: the prompt has no tokens");
  TORCH_CHECK(o.max_new_tokens >= 0, "actmem: --max-new-tokens must be >= 0");
  KVCache cache(model);
  TORCH_CHECK(static_cast<int64_t>(prompt.size()) < cache.capacity(), "actmem::generate: the "
              "prompt has ", prompt.size(), " tokens; the model has ", cache.capacity(),
              " positions (max_position_embeddings), so nothing can follow it");
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  std::vector<int64_t> out;
  at::Tensor logits = cache.feed(prompt);
  while (static_cast<int64_t>(out.size()) < o.max_new_tokens) {
    const int64_t next = sample_token(logits[logits.size(0) - 1].cpu(), o, gen);
    out.push_back(next);
    if (on_token) on_token(next);
    if (next == o.stop_token || cache.length() >= cache.capacity()) break;
    logits = cache.feed({next});
  }
  return out;
}

}  // namespace actmem
