// gpt_dataset.h — Megatron-LM's GPT training samples over indexed datasets
// (megatron/core/datasets/gpt_dataset.py, blended_dataset.py, blended_megatron_dataset_builder.py
// and helpers.cpp), reproduced index for index:
//
//   document index   the split's sequences (Megatron splits and indexes a GPT dataset by
//                    sequence, not by document), repeated for enough epochs, shuffled
//   sample index     (position in the document index, token offset) where each sample starts:
//                    samples of seq_length + 1 tokens that run across document boundaries and
//                    overlap by one token (the label of the last position)
//   shuffle index    a permutation of the samples
//   blending         dataset i gets the sample whose share lags its weight the most
//
// The shuffles draw from numpy's legacy RandomState(seed) (MT19937 and its bounded-integer
// rejection), reimplemented here, so a dataset yields the samples Megatron's yields for the same
// files, split, sizes and seed. The indices are cached as .npy files beside the data.
#pragma once

#include "actmem/data/data.h"
#include "actmem/data/indexed_dataset.h"

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace actmem {

/// numpy.random.RandomState(seed), as far as Megatron's datasets use it: shuffle of a 1-D array
/// (Fisher–Yates from the end, numpy's random_interval draws).
class NumpyRandomState {
 public:
  explicit NumpyRandomState(uint32_t seed) : mt_(seed) {}
  uint32_t next_uint32() { return static_cast<uint32_t>(mt_()); }
  uint64_t next_uint64() {
    const uint64_t hi = next_uint32();
    return (hi << 32) | next_uint32();
  }
  /// A uniform integer in [0, max] (numpy's random_interval).
  uint64_t random_interval(uint64_t max);
  template <typename T>
  void shuffle(std::vector<T>& v) {
    for (size_t i = v.size(); i-- > 1;) {
      std::swap(v[i], v[static_cast<size_t>(random_interval(i))]);
    }
  }

 private:
  std::mt19937 mt_;  // the same MT19937, seeded as numpy's mt19937_seed (init_genrand)
};

/// numpy.random.default_rng(seed), as far as Megatron's mock dataset uses it: SeedSequence(seed)
/// seeding PCG64 (XSL-RR 128/64), and Generator.integers(low, high, dtype=int32) (Lemire's
/// bounded draws from 32-bit halves, the low half of each 64-bit output first).
class NumpyGenerator {
 public:
  explicit NumpyGenerator(uint32_t seed);
  uint64_t next_uint64();
  uint32_t next_uint32();
  /// A uniform integer in [low, high) (high > low), as integers(low, high, dtype=numpy.int32).
  int32_t integers_int32(int32_t low, int32_t high);

 private:
  unsigned __int128 state_ = 0, inc_ = 0;
  bool has_uint32_ = false;
  uint32_t uint32_ = 0;
};

/// Megatron's MockGPTLowLevelDataset (megatron/core/datasets/gpt_dataset.py), the documents of
/// --mock-data: 100000 sequences whose lengths are default_rng(0).integers(1, 4096, int32);
/// sequence i is [1, 2, ..., L_i - 1] modulo the tokenizer's vocabulary, then its end-of-document
/// id. Nothing is stored but the lengths: tokens are computed when read.
class MockGPTLowLevelDataset final : public LowLevelDataset {
 public:
  static constexpr int64_t kSize = 100000;
  static constexpr int32_t kMaxSequenceLength = 4096;
  /// vocab_size and eod: the tokenizer's (unpadded vocabulary; Megatron's tokenizer.vocab_size).
  MockGPTLowLevelDataset(int64_t vocab_size, int64_t eod);
  std::string name() const override { return "--mock-data"; }
  std::string description() const override;
  int64_t num_sequences() const override { return kSize; }
  int64_t sequence_length(int64_t i) const override;
  void read(int64_t i, int64_t offset, int64_t length, std::vector<int64_t>& out) const override;
  int64_t num_tokens() const { return tokens_; }

 private:
  int64_t vocab_, eod_, tokens_ = 0;
  std::vector<int32_t> lengths_;
};

/// Megatron's split of `num_elements` by normalised weights (--split 969,30,1): the [begin, end)
/// ranges of train, validation and test, begin = round(lo n) and end = round(hi n) of each
/// split's cumulative book-ends (convert_split_vector_to_split_matrix,
/// _build_megatron_dataset_splits; round half to even). A GPT dataset is split by sequences.
std::vector<std::pair<int64_t, int64_t>> split_ranges(const std::vector<double>& weights,
                                                      int64_t num_elements);
/// Parses "949,50,1" (or "95,5") into normalised weights; throws a clear error otherwise.
std::vector<double> parse_split(const std::string& split);

/// One source of samples of seq_length + 1 tokens.
class SampleSource {
 public:
  virtual ~SampleSource() = default;
  virtual int64_t size() const = 0;
  /// Sample i (0 <= i < size()), appended to `out`.
  virtual void sample(int64_t i, std::vector<int64_t>& out) const = 0;
};

/// Megatron's GPTDataset over sequences [begin, end) of one indexed dataset (its
/// indexed_indices; empty documents hold none, a multi-sentence document several).
class GPTDataset : public SampleSource {
 public:
  /// num_samples: the samples this split must provide (Megatron's target size); the document
  /// index repeats the sequences for as many epochs as that takes. cache_dir empty: no cache.
  GPTDataset(std::shared_ptr<const LowLevelDataset> data, std::pair<int64_t, int64_t> sequences,
             int64_t num_samples, int64_t seq_length, uint32_t seed, const std::string& split_name,
             const std::string& cache_dir);
  /// Samples available (every sample of every epoch built; at least the requested number).
  int64_t size() const override { return static_cast<int64_t>(shuffle_index_.size()); }
  void sample(int64_t i, std::vector<int64_t>& out) const override;
  const std::vector<int32_t>& document_index() const { return document_index_; }
  /// Pairs (document-index position, offset), flattened: 2 * (samples + 1) entries.
  const std::vector<int64_t>& sample_index() const { return sample_index_; }
  const std::vector<int64_t>& shuffle_index() const { return shuffle_index_; }
  int64_t num_epochs() const { return num_epochs_; }
  /// Whether the indices came from the cache.
  bool loaded_from_cache() const { return from_cache_; }

 private:
  int64_t tokens_per_epoch() const;
  // Megatron's epochs and samples for `num_samples` of this split.
  std::pair<int64_t, int64_t> epochs_and_samples(int64_t num_samples) const;
  // Whether indices read from the cache address this split only (Note [A cached index is
  // checked before it is used]).
  bool cached_indices_valid() const;
  void build(int64_t num_samples, uint32_t seed);
  std::shared_ptr<const LowLevelDataset> data_;
  std::pair<int64_t, int64_t> sequences_;
  int64_t seq_length_;
  int64_t num_epochs_ = 1;
  bool from_cache_ = false;
  std::vector<int32_t> document_index_;
  std::vector<int64_t> sample_index_;
  std::vector<int64_t> shuffle_index_;
};

/// Megatron's BlendedDataset: `size` samples drawn from `datasets` in proportion to `weights`
/// (build_blending_indices: each sample goes to the dataset furthest below its share).
class BlendedDataset : public SampleSource {
 public:
  BlendedDataset(std::vector<std::shared_ptr<const SampleSource>> datasets,
                 std::vector<double> weights, int64_t size);
  int64_t size() const override { return static_cast<int64_t>(dataset_index_.size()); }
  void sample(int64_t i, std::vector<int64_t>& out) const override;
  const std::vector<int16_t>& dataset_index() const { return dataset_index_; }

 private:
  std::vector<std::shared_ptr<const SampleSource>> datasets_;
  std::vector<int16_t> dataset_index_;
  std::vector<int64_t> dataset_sample_index_;
};

/// Micro-batches from a sample source, as Megatron's MegatronPretrainingSampler walks it:
/// micro-batch k holds samples [k b, (k + 1) b); tokens are a sample's first seq_length tokens,
/// labels its last seq_length. Every token must be below vocab_size (checked per batch, with
/// the sample named).
class DatasetBatches : public BatchSource {
 public:
  DatasetBatches(std::shared_ptr<const SampleSource> source, int64_t seq_length,
                 int64_t micro_batch_size, int64_t vocab_size, std::string what);
  std::pair<at::Tensor, at::Tensor> next() override;
  /// Micro-batch i of the source (count is unused: validation takes the first ones).
  std::pair<at::Tensor, at::Tensor> fixed(int64_t i, int64_t count) const override;

 private:
  std::pair<at::Tensor, at::Tensor> batch(int64_t k) const;
  std::shared_ptr<const SampleSource> source_;
  int64_t seq_, batch_, vocab_;
  std::string what_;
};

/// --data-path: either one prefix, or weight/prefix pairs ("0.3 A 0.7 B"). Weights normalised.
struct DataBlend {
  std::vector<std::string> prefixes;
  std::vector<double> weights;  // empty for a single prefix
};
DataBlend parse_data_path(const std::vector<std::string>& args);

/// The train, validation and test sources Megatron's BlendedMegatronDatasetBuilder builds for
/// these sizes (a source is null when it needs no samples). cache_dir empty means Megatron's
/// default, PREFIX/cache/GPTDataset_indices per dataset.
struct GPTSplits {
  std::shared_ptr<const SampleSource> train, valid, test;
  int64_t documents = 0;  // over all datasets
  int64_t sequences = 0;  // over all datasets (what the splits cut)
  int64_t tokens = 0;     // over all datasets
  int64_t bytes = 0;      // of their .bin files
};
GPTSplits build_gpt_splits(const DataBlend& blend, const std::string& split, int64_t seq_length,
                           uint32_t seed, const std::vector<int64_t>& samples_per_split,
                           const std::string& cache_dir);
/// The splits of --mock-data, as Megatron's builder makes them for MockGPTDataset: split forced
/// to 1,1,1 (BlendedMegatronDatasetConfig sets it when no blend is given) and the indices cached
/// only when `cache_dir` is given (--data-cache-path; Megatron has no default cache for a mock).
GPTSplits build_mock_gpt_splits(int64_t vocab_size, int64_t eod, int64_t seq_length, uint32_t seed,
                                const std::vector<int64_t>& samples_per_split,
                                const std::string& cache_dir);

}  // namespace actmem
