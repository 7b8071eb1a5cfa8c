// data.h — byte-level tokenizer, the built-in corpus, train/validation split and batch sampling.
//
// Tokens are bytes (vocab 256). The built-in corpus is generated from a fixed seed, so every
// machine trains on the same text without downloading anything. Sampling uses its own
// counter-based generator and never touches libtorch's global RNG (which dropout consumes).
//
// Note [Corpus in bounded memory]
// A corpus is host data (a data loader's, on a GPU machine): it lives outside the tracked device
// allocator, in the narrowest integer type its vocabulary allows (one byte per token here). A
// regular file is memory-mapped read-only and its bytes *are* the token stream: nothing is
// copied, pages are read when a batch touches them and the kernel may drop them again, so a
// corpus of any size costs at most its own size in memory. A file without a size (a pipe, a
// character device such as /dev/zero) is read up to kMaxStreamBytes and refused beyond.
#pragma once

#include "actmem/base/digest.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>

namespace actmem {

/// Maps text to token ids 0..255 (its bytes) and back.
struct ByteTokenizer {
  static constexpr int64_t kVocabSize = 256;
  /// [n] uint8 tensor of the bytes of `text` (the narrowest type that holds every token).
  static at::Tensor encode(const std::string& text);
  static std::string decode(const at::Tensor& tokens);
};

/// Size of the built-in corpus that load_corpus("") uses.
constexpr size_t kBuiltinCorpusBytes = size_t{1} << 20;

/// The built-in corpus: `bytes` bytes of English-like sentences, identical on every machine.
std::string builtin_corpus(size_t bytes = kBuiltinCorpusBytes);

/// The most bytes read from a file that has no size (a pipe, a device); Note [Corpus in bounded
/// memory].
constexpr int64_t kMaxStreamBytes = int64_t{256} << 20;

/// The bytes of a file as a [n] uint8 host tensor, in bounded memory (Note [Corpus in bounded
/// memory]): a regular file is memory-mapped, anything else read up to kMaxStreamBytes. Throws
/// "actmem::read_text_file: ..." for a directory, a file that cannot be opened or read, an empty
/// one, or one without a size that goes on beyond kMaxStreamBytes.
at::Tensor read_text_file(const std::string& path);

/// Train and validation token streams (views of one host tensor; Note [Corpus in bounded
/// memory]).
struct Corpus {
  at::Tensor train;    // [n_train] uint8
  at::Tensor valid;    // [n_valid] uint8
  std::string source;  // "built-in" or the path
  /// Bytes of the token stream (train, validation and the unused test share).
  int64_t bytes = 0;
  /// True when the stream is a read-only mapping of the file: its pages are page cache, which
  /// the kernel can drop and read again, so they are not counted as memory the run holds.
  bool memory_mapped = false;
  /// Host memory the stream holds that the kernel cannot drop (0 when memory-mapped).
  int64_t resident_bytes() const { return memory_mapped ? 0 : bytes; }
  /// With --data-path (Megatron's indexed datasets): train and validation sample counts; the
  /// two streams above are then undefined.
  int64_t train_samples = 0, valid_samples = 0;
  int64_t documents = 0, tokens = 0;
  int64_t sequences = 0;  // with --data-path: what the splits cut (Megatron splits by sequence)
};

/// Parses Megatron's --split ("95,5" or "969,30,1": train, validation[, test] weights) and cuts
/// the token stream in that proportion (the test share is unused). Each kept part must hold at
/// least one window of seq_length + 1 tokens; throws a clear error otherwise.
Corpus split_corpus(const at::Tensor& tokens, const std::string& split, int64_t seq_length,
                    const std::string& source);

/// Loads `path` (or the built-in corpus when empty), tokenizes and splits it.
Corpus load_corpus(const std::string& path, const std::string& split, int64_t seq_length);

/// Where a trainer's (tokens, labels) micro-batches of [b, s] int64 come from. Batch k is a
/// pure function of the source and k, so a run resumes by seeking to the batches it consumed.
class BatchSource {
 public:
  virtual ~BatchSource() = default;
  /// The next micro-batch.
  virtual std::pair<at::Tensor, at::Tensor> next() = 0;
  /// The i-th of `count` fixed micro-batches (for validation).
  virtual std::pair<at::Tensor, at::Tensor> fixed(int64_t i, int64_t count) const = 0;
  int64_t batches_drawn() const { return drawn_; }
  /// Continues as if `batches` micro-batches had been drawn (resuming from a checkpoint).
  void seek(int64_t batches);

 protected:
  int64_t drawn_ = 0;
};

/// Samples micro-batches from a token stream (uint8, int16, int32 or int64) at random offsets.
/// labels are tokens shifted by one. Batch k is a pure function of (seed, k).
class BatchSampler : public BatchSource {
 public:
  BatchSampler(at::Tensor stream, int64_t seq_length, int64_t micro_batch_size, uint64_t seed);
  /// The next random micro-batch.
  std::pair<at::Tensor, at::Tensor> next() override;
  /// The i-th of `count` evenly spaced, fixed micro-batches.
  std::pair<at::Tensor, at::Tensor> fixed(int64_t i, int64_t count) const override;

 private:
  std::pair<at::Tensor, at::Tensor> gather(const std::vector<int64_t>& offsets) const;
  at::Tensor stream_;
  int64_t seq_, batch_;
  uint64_t seed_;
};

}  // namespace actmem
