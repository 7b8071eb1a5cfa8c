// generate.h — text generation from a trained GPTModel: a key-value cache so each new token
// costs one position of compute, and greedy, temperature, top-k and top-p sampling.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace actmem {

class DecodeState;
class GPTModel;

/// Feeds tokens through `model` (eval mode, one sequence, tensor-parallel size 1), keeping every
/// layer's keys and values, so the logits of the next position cost one position of compute.
/// The arithmetic is the model's own (its norms, linears, MLP and rotary tables); attention runs
/// over the cached keys with the causal rule. Equal to GPTModel::logits up to floating-point
/// summation order (tests compare them).
class KVCache {
 public:
  /// Throws for a model whose mixers cannot decode incrementally (PartModule::make_decode_state).
  explicit KVCache(GPTModel& model);
  ~KVCache();
  /// Appends `tokens` and returns the logits of each appended position, [n, vocab] (fp32).
  at::Tensor feed(const std::vector<int64_t>& tokens);
  int64_t length() const { return length_; }
  /// The positions the model has (max_position_embeddings): the cache's capacity.
  int64_t capacity() const { return capacity_; }
  /// Bytes of the mixers' states this cache holds (the attentions' keys and values, all layers,
  /// full capacity).
  int64_t bytes() const;
  /// What a cache of `model` holds, without allocating one.
  static int64_t bytes_for(const GPTModel& model);
  void clear() { length_ = 0; }

 private:
  GPTModel& model_;
  int64_t capacity_;
  // Per layer, its mixer's state (PartModule::make_decode_state): the attentions' keys and
  // values of G heads (MLA caches its up-projected per-head keys and values).
  std::vector<std::unique_ptr<DecodeState>> states_;
  int64_t length_ = 0;
};

struct SamplingOptions {
  int64_t max_new_tokens = 100;
  /// Take the most likely token (temperature, top-k and top-p are then unused).
  bool greedy = false;
  double temperature = 1.0;
  /// Keep the k most likely tokens (0: all).
  int64_t top_k = 0;
  /// Keep the smallest set of most likely tokens whose probability reaches p (0: all).
  double top_p = 0.0;
  uint64_t seed = 1234;
  /// Stop after this token (the tokenizer's <eod>); -1: never.
  int64_t stop_token = -1;
  /// Draw only from ids below this (the tokenizer's vocabulary, not the embedding's padding
  /// rows); 0: every logit.
  int64_t vocab_size = 0;
};

/// Picks the next token from fp32 logits [v] as `options` says (the generator draws for
/// sampling). Throws for invalid options (temperature <= 0, top_p outside [0, 1], top_k < 0).
int64_t sample_token(const at::Tensor& logits, const SamplingOptions& options, at::Generator& gen);

/// Generates after `prompt` (at least one token); `on_token` sees each new token as it is made.
/// Stops at max_new_tokens, at stop_token, or when the model's positions are used up. Returns
/// the new tokens.
std::vector<int64_t> generate(GPTModel& model, const std::vector<int64_t>& prompt,
                              const SamplingOptions& options,
                              const std::function<void(int64_t)>& on_token = {});

}  // namespace actmem
