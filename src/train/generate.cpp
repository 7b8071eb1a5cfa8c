// generate.cpp — the KV cache and sampling (generate.h).
#include "actmem/train/generate.h"

#include "actmem/model/model.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

#include <cmath>

namespace actmem {

KVCache::KVCache(GPTModel& model) : model_(model), capacity_(model.config().max_positions()) {
  TORCH_CHECK(model.config().tensor_model_parallel_size == 1,
              "actmem::KVCache: generation runs "
              "on one process; the model has tensor_model_parallel_size ",
              model.config().tensor_model_parallel_size);
  const auto opts = model.word_embeddings.options().requires_grad(false);
  for (const auto& layer : model.decoder->layers) {
    states_.push_back(layer->self_attention->make_decode_state(capacity_, opts));
  }
}

KVCache::~KVCache() = default;

int64_t KVCache::bytes() const {
  int64_t n = 0;
  for (const auto& state : states_) n += state ? state->bytes() : 0;
  return n;
}

int64_t KVCache::bytes_for(const GPTModel& model) {
  // Every layer's mixer state at full capacity, as make_decode_state sizes it.
  const TransformerConfig& c = model.config();
  const int64_t element = static_cast<int64_t>(model.word_embeddings.element_size());
  int64_t n = 0;
  for (const auto& layer : model.decoder->layers) {
    n += layer->spec().mixer->decode_state_bytes(c, c.max_positions(), element);
  }
  return n;
}

at::Tensor KVCache::feed(const std::vector<int64_t>& tokens) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  TORCH_CHECK(n > 0, "actmem::KVCache::feed: no tokens");
  TORCH_CHECK(length_ + n <= capacity_, "actmem::KVCache::feed: ", length_ + n,
              " positions exceed "
              "the model's max_position_embeddings ",
              capacity_);
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
  const int64_t p0 = length_;
  // Embedding, as GPTModel::embed for positions [p0, p0 + n): [n, 1, h].
  at::Tensor hidden = at::embedding(model_.word_embeddings, ids);
  if (model_.position_embeddings.defined()) {
    hidden = hidden + model_.position_embeddings.narrow(0, p0, n);
  }
  hidden = hidden.unsqueeze(1);
  const LayerContext ctx{model_.rope(), model_.attention_mask(), nullptr};
  for (size_t l = 0; l < model_.decoder->layers.size(); ++l) {
    hidden = model_.decoder->layers[l]->decode(hidden, states_[l].get(), p0, ctx);
  }
  hidden = model_.decoder->final_layernorm->forward(hidden);
  const at::Tensor logits = at::matmul(hidden.squeeze(1), model_.output_weight.t());  // [n, v]
  length_ = p0 + n;
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
  TORCH_CHECK(o.temperature > 0.0 && std::isfinite(o.temperature),
              "actmem: --temperature must be "
              "positive, got ",
              o.temperature);
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
                              const SamplingOptions& o,
                              const std::function<void(int64_t)>& on_token) {
  TORCH_CHECK(!prompt.empty(), "actmem::generate: the prompt has no tokens");
  TORCH_CHECK(o.max_new_tokens >= 0, "actmem: --max-new-tokens must be >= 0");
  KVCache cache(model);
  TORCH_CHECK(static_cast<int64_t>(prompt.size()) < cache.capacity(),
              "actmem::generate: the "
              "prompt has ",
              prompt.size(), " tokens; the model has ", cache.capacity(),
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
