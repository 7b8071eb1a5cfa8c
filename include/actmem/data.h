// data.h — byte-level tokenizer, the built-in corpus, train/validation split and batch sampling.
//
// Tokens are bytes (vocab 256). The built-in corpus is generated from a fixed seed, so every
// machine trains on the same text without downloading anything. Sampling uses its own
// counter-based generator and never touches libtorch's global RNG (which dropout consumes).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>

namespace actmem {

/// Maps text to token ids 0..255 (its bytes) and back.
struct ByteTokenizer {
  static constexpr int64_t kVocabSize = 256;
  /// [n] int64 tensor of the bytes of `text`.
  static at::Tensor encode(const std::string& text);
  static std::string decode(const at::Tensor& tokens);
};

/// The built-in corpus: `bytes` bytes of English-like sentences, identical on every machine.
std::string builtin_corpus(size_t bytes = 1 << 20);

/// Reads a whole file; throws "actmem::read_text_file: ..." when it cannot be read or is empty.
std::string read_text_file(const std::string& path);

/// Train and validation token streams.
struct Corpus {
  at::Tensor train;  // [n_train] int64
  at::Tensor valid;  // [n_valid] int64
  std::string source;  // "built-in" or the path
};

/// Parses Megatron's --split ("95,5" or "969,30,1": train, validation[, test] weights) and cuts
/// the token stream in that proportion (the test share is unused). Each kept part must hold at
/// least one window of seq_length + 1 tokens; throws a clear error otherwise.
Corpus split_corpus(const at::Tensor& tokens, const std::string& split, int64_t seq_length,
                    const std::string& source);

/// Loads `path` (or the built-in corpus when empty), tokenizes and splits it.
Corpus load_corpus(const std::string& path, const std::string& split, int64_t seq_length);

/// Samples (tokens, labels) micro-batches of [b, s] from a token stream. labels are tokens
/// shifted by one. Batch k of a sampler is a pure function of (seed, k).
class BatchSampler {
 public:
  BatchSampler(at::Tensor stream, int64_t seq_length, int64_t micro_batch_size, uint64_t seed);
  /// The next random micro-batch.
  std::pair<at::Tensor, at::Tensor> next();
  /// The i-th of `count` evenly spaced, fixed micro-batches (for validation).
  std::pair<at::Tensor, at::Tensor> fixed(int64_t i, int64_t count) const;
  int64_t batches_drawn() const { return drawn_; }

 private:
  std::pair<at::Tensor, at::Tensor> gather(const std::vector<int64_t>& offsets) const;
  at::Tensor stream_;
  int64_t seq_, batch_;
  uint64_t seed_;
  int64_t drawn_ = 0;
};

/// SplitMix64: a small, fast, well-mixed deterministic generator.
inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace actmem
