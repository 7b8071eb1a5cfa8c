// gpt_dataset.cpp — Megatron's GPTDataset, BlendedDataset and their builder (gpt_dataset.h).
#include "actmem/data/gpt_dataset.h"

#include "actmem/base/digest.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <sstream>

#include <unistd.h>

namespace actmem {

namespace fs = std::filesystem;

uint64_t NumpyRandomState::random_interval(uint64_t max) {
  // numpy/random/src/distributions/distributions.c: random_interval.
  if (max == 0) return 0;
  uint64_t mask = max;
  mask |= mask >> 1;
  mask |= mask >> 2;
  mask |= mask >> 4;
  mask |= mask >> 8;
  mask |= mask >> 16;
  mask |= mask >> 32;
  uint64_t value = 0;
  if (max <= 0xffffffffULL) {
    while ((value = (next_uint32() & mask)) > max) {
    }
  } else {
    while ((value = (next_uint64() & mask)) > max) {
    }
  }
  return value;
}

std::vector<double> parse_split(const std::string& split) {
  // Megatron's parse_and_normalize_split (blended_megatron_dataset_config.py): the weights are
  // re.findall(r"[.0-9]+", split), whatever separates them, so a script's literal '99,1,0'
  // (quotes and all) reads as 99, 1, 0; fewer than three are padded with zeros. On purpose not
  // as Megatron: a letter or a sign is refused rather than skipped ("95,x" is not 95,0,0 and
  // "-5" not 5 here).
  std::vector<double> w;
  for (size_t i = 0; i < split.size();) {
    const auto c = static_cast<unsigned char>(split[i]);
    TORCH_CHECK(!std::isalpha(c) && c != '-' && c != '+',
                "actmem: --split expects comma-separated non-negative weights such as 949,50,1, "
                "got '",
                split, "'");
    if (!std::isdigit(c) && c != '.') {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < split.size() &&
           (std::isdigit(static_cast<unsigned char>(split[j])) || split[j] == '.'))
      ++j;
    const std::string part = split.substr(i, j - i);
    char* end = nullptr;
    const double v = std::strtod(part.c_str(), &end);
    // float() of the match: "1.2.3" or "." is Megatron's ValueError.
    TORCH_CHECK(end == part.c_str() + part.size() && std::isfinite(v),
                "actmem: --split expects comma-separated non-negative weights such as 949,50,1, "
                "got '",
                split, "' ('", part, "' is not a number)");
    w.push_back(v);
    i = j;
  }
  TORCH_CHECK(w.size() >= 1 && w.size() <= 3,
              "actmem: --split takes 1 to 3 weights (train, "
              "validation, test), got '",
              split, "'");
  while (w.size() < 3) w.push_back(0.0);  // Megatron pads with zeros
  const double sum = std::accumulate(w.begin(), w.end(), 0.0);
  TORCH_CHECK(sum > 0, "actmem: --split weights sum to 0 ('", split, "')");
  for (auto& v : w) v /= sum;
  return w;
}

std::vector<std::pair<int64_t, int64_t>> split_ranges(const std::vector<double>& weights,
                                                      int64_t num_elements) {
  // Megatron-LM today (megatron/core/datasets): blended_megatron_dataset_config.py
  // convert_split_vector_to_split_matrix turns the normalised weights into book-ends
  // [(0, w0), (w0, w0 + w1), (w0 + w1, w0 + w1 + w2)] (cumulative sums, left to right), and
  // blended_megatron_dataset_builder.py _build_megatron_dataset_splits takes
  // beg = int(round(lo * n)), end = int(round(hi * n)) per split. Python's round() of a float
  // rounds half to even, as std::nearbyint does in the default rounding mode. A zero weight is
  // Megatron's None split: lo == hi, so beg == end here. (actmem used the rule Megatron had from
  // 2023-10-26 to 2023-12-09, _get_split_indices, which took the rounding remainder off every
  // boundary: 330 sequences at 949,50,1 trained on [0, 314) instead of [0, 313).)
  TORCH_CHECK(num_elements >= 0, "actmem::split_ranges: expected a non-negative count, got ",
              num_elements);
  const double n = static_cast<double>(num_elements);
  std::vector<std::pair<int64_t, int64_t>> out;
  double lo = 0.0;
  for (const double w : weights) {
    const double hi = lo + w;
    out.emplace_back(static_cast<int64_t>(std::nearbyint(lo * n)),
                     static_cast<int64_t>(std::nearbyint(hi * n)));
    lo = hi;
  }
  return out;
}

// ---- .npy cache files -------------------------------------------------------------------------

namespace {

template <typename T>
const char* npy_descr();
template <>
const char* npy_descr<int32_t>() {
  return "<i4";
}
template <>
const char* npy_descr<int64_t>() {
  return "<i8";
}

std::string npy_header(const char* descr, const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << "{'descr': '" << descr << "', 'fortran_order': False, 'shape': (";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << (shape.size() == 1 ? ",), }" : "), }");  // Python's tuple repr
  std::string h = os.str();
  // Version 1.0: magic (6) + version (2) + u16 length, header padded to 64 bytes with '\n' last.
  const size_t total = 10 + h.size() + 1;
  h.append((64 - total % 64) % 64, ' ');
  h.push_back('\n');
  return h;
}

template <typename T>
void write_npy(const std::string& path, const std::vector<T>& v, std::vector<int64_t> shape) {
  const std::string header = npy_header(npy_descr<T>(), shape);
  // Unique per process: tensor-parallel ranks build the same indices and may write at once.
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    TORCH_CHECK(out, "actmem::GPTDataset: cannot write the index cache ", tmp);
    out.write("\x93NUMPY\x01\x00", 8);
    const uint16_t len = static_cast<uint16_t>(header.size());
    out.write(reinterpret_cast<const char*>(&len), 2);
    out << header;
    out.write(reinterpret_cast<const char*>(v.data()),
              static_cast<std::streamsize>(v.size() * sizeof(T)));
    TORCH_CHECK(out.good(), "actmem::GPTDataset: writing the index cache ", tmp, " failed");
  }
  fs::rename(tmp, path);  // whole files only: a crash leaves no half-written cache entry
}

// Reads a cache file written by write_npy with exactly this type and shape; false otherwise.
template <typename T>
bool read_npy(const std::string& path, std::vector<T>& v, const std::vector<int64_t>& shape) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  const std::string header = npy_header(npy_descr<T>(), shape);
  std::string prefix(10 + header.size(), '\0');
  if (!in.read(prefix.data(), static_cast<std::streamsize>(prefix.size()))) return false;
  if (prefix.compare(0, 6, "\x93NUMPY") != 0 || prefix.substr(10) != header) return false;
  int64_t n = 1;
  for (const int64_t s : shape) n *= s;
  v.resize(static_cast<size_t>(n));
  if (!in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(T))))
    return false;
  return in.peek() == std::char_traits<char>::eof();
}

}  // namespace

// ---- GPTDataset -------------------------------------------------------------------------------

GPTDataset::GPTDataset(std::shared_ptr<const LowLevelDataset> data,
                       std::pair<int64_t, int64_t> sequences, int64_t num_samples,
                       int64_t seq_length, uint32_t seed, const std::string& split_name,
                       const std::string& cache_dir)
    : data_(std::move(data)), sequences_(sequences), seq_length_(seq_length) {
  TORCH_CHECK(seq_length_ > 0 && num_samples >= 0,
              "actmem::GPTDataset: seq_length must be positive "
              "and num_samples non-negative");
  // Megatron's GPTDataset indexes sequences, not documents (numel_low_level_dataset): a
  // document of several sequences (preprocess_data.py --split-sentences) contributes each, an
  // empty document none.
  TORCH_CHECK(sequences_.first >= 0 && sequences_.first < sequences_.second &&
                  sequences_.second <= data_->num_sequences(),
              "actmem::GPTDataset: the ", split_name, " split of ", data_->name(),
              " has no "
              "sequences (sequences [",
              sequences_.first, ", ", sequences_.second, ") of ", data_->num_sequences(),
              "); change --split or add data");
  // The cache key: what decides the indices (Megatron hashes a similar description).
  nlohmann::json desc = {{"class", "GPTDataset"},
                         {"dataset", nlohmann::json::parse(data_->description())},
                         {"sequences", {sequences_.first, sequences_.second}},
                         {"num_samples", num_samples},
                         {"sequence_length", seq_length_},
                         {"random_seed", seed},
                         {"split", split_name},
                         {"add_extra_token_to_sequence", true},
                         {"drop_last_partial_sequence", true}};
  const std::string text = desc.dump();
  Digest d;
  d.update(text.data(), text.size());
  const std::string base =
      cache_dir.empty() ? std::string()
                        : (fs::path(cache_dir) / (d.hex() + "-GPTDataset-" + split_name)).string();
  if (!base.empty()) {
    std::ifstream meta(base + "-description.txt");
    std::string cached((std::istreambuf_iterator<char>(meta)), std::istreambuf_iterator<char>());
    if (cached == text) {
      // Note [A cached index is checked before it is used]
      // Megatron trusts its cache files (megatron/core/datasets/gpt_dataset.py loads them with
      // numpy.load and indexes the .bin with their contents). A damaged or crafted entry could
      // then ask for an allocation of any size (the counts set the arrays' lengths) or make
      // sample() read outside the memory map (the indices address it). Here the counts must be
      // the ones this dataset's description implies, each file exactly its shape, and every
      // entry in range: documents in the split, sample boundaries increasing within their
      // documents, each sample seq_length + 1 tokens, the shuffle a permutation. An entry that
      // fails is rebuilt (and rewritten) with a warning naming it; the cache only ever saves time.
      const auto [epochs, samples] = epochs_and_samples(num_samples);
      std::vector<int64_t> counts;
      if (read_npy<int64_t>(base + "-counts.npy", counts, {2}) && counts[0] == epochs &&
          counts[1] == samples) {
        num_epochs_ = epochs;
        const int64_t n_doc = num_epochs_ * (sequences_.second - sequences_.first);
        from_cache_ =
            read_npy<int32_t>(base + "-document_index.npy", document_index_, {n_doc}) &&
            read_npy<int64_t>(base + "-sample_index.npy", sample_index_, {samples + 1, 2}) &&
            read_npy<int64_t>(base + "-shuffle_index.npy", shuffle_index_, {samples});
      }
      if (from_cache_) from_cache_ = cached_indices_valid();
      if (!from_cache_) {
        TORCH_WARN("actmem::GPTDataset: the cached indices ", base, "-*.npy do not match ",
                   data_->name(),
                   " (a damaged or altered cache entry); "
                   "rebuilding them");
      }
    }
  }
  if (from_cache_) return;
  document_index_.clear();
  sample_index_.clear();
  shuffle_index_.clear();
  build(num_samples, seed);
  if (base.empty()) return;
  std::error_code ec;
  fs::create_directories(cache_dir, ec);
  if (ec) return;  // a read-only data directory: indices are rebuilt each run
  try {
    const int64_t samples = size();
    write_npy<int32_t>(base + "-document_index.npy", document_index_,
                       {static_cast<int64_t>(document_index_.size())});
    write_npy<int64_t>(base + "-sample_index.npy", sample_index_, {samples + 1, 2});
    write_npy<int64_t>(base + "-shuffle_index.npy", shuffle_index_, {samples});
    write_npy<int64_t>(base + "-counts.npy", std::vector<int64_t>{num_epochs_, samples}, {2});
    // Last: the description marks the entry complete (whole, through a rename).
    const std::string tmp = base + "-description.txt.tmp." + std::to_string(::getpid());
    std::ofstream(tmp) << text;
    fs::rename(tmp, base + "-description.txt");
  } catch (const std::exception&) {
    // The cache is an optimisation: a full disk or a racing writer costs a rebuild next time.
  }
}

int64_t GPTDataset::tokens_per_epoch() const {
  int64_t tokens = 0;
  for (int64_t doc = sequences_.first; doc < sequences_.second; ++doc) {
    tokens += data_->sequence_length(doc);
  }
  TORCH_CHECK(tokens > seq_length_, "actmem::GPTDataset: ", data_->name(), " has ", tokens,
              " tokens in its sequences [", sequences_.first, ", ", sequences_.second,
              "), fewer than one sample of ", seq_length_ + 1);
  return tokens;
}

std::pair<int64_t, int64_t> GPTDataset::epochs_and_samples(int64_t num_samples) const {
  // _get_num_epochs: epochs until they hold the requested tokens; then every whole sample of
  // them (helpers.cpp: build_sample_idx's count).
  const int64_t tokens = tokens_per_epoch();
  const int64_t requested = num_samples * seq_length_ + 1;
  int64_t epochs = 1;
  for (int64_t t = tokens; t < requested; t += tokens) ++epochs;
  return {epochs, (epochs * tokens - 1) / seq_length_};
}

bool GPTDataset::cached_indices_valid() const {
  const int64_t n_doc = static_cast<int64_t>(document_index_.size());
  for (const int32_t doc : document_index_) {
    if (doc < sequences_.first || doc >= sequences_.second) return false;
  }
  const int64_t samples = static_cast<int64_t>(shuffle_index_.size());
  if (sample_index_[0] != 0 || sample_index_[1] != 0) return false;
  for (int64_t s = 0; s <= samples; ++s) {
    const int64_t pos = sample_index_[static_cast<size_t>(2 * s)];
    const int64_t offset = sample_index_[static_cast<size_t>(2 * s + 1)];
    if (pos < 0 || pos >= n_doc || offset < 0 ||
        offset >= data_->sequence_length(document_index_[static_cast<size_t>(pos)])) {
      return false;
    }
    if (s > 0) {
      // Each sample is seq_length + 1 tokens: from the previous boundary (its first token) to
      // this one (its last), both inclusive.
      const int64_t prev = sample_index_[static_cast<size_t>(2 * s - 2)];
      const int64_t prev_offset = sample_index_[static_cast<size_t>(2 * s - 1)];
      if (pos < prev || (pos == prev && offset <= prev_offset)) return false;
      int64_t tokens = offset + 1 - prev_offset;
      for (int64_t p = prev; p < pos && tokens <= seq_length_ + 1; ++p) {
        tokens += data_->sequence_length(document_index_[static_cast<size_t>(p)]);
      }
      if (tokens != seq_length_ + 1) return false;
    }
  }
  std::vector<bool> seen(static_cast<size_t>(samples), false);
  for (const int64_t i : shuffle_index_) {
    if (i < 0 || i >= samples || seen[static_cast<size_t>(i)]) return false;
    seen[static_cast<size_t>(i)] = true;
  }
  return true;
}

void GPTDataset::build(int64_t num_samples, uint32_t seed) {
  // gpt_dataset.py: _build_document_sample_shuffle_indices, with add_extra_token_to_sequence
  // and drop_last_partial_sequence (Megatron's defaults).
  const int64_t n_docs = sequences_.second - sequences_.first;
  const int64_t tokens_per_epoch = this->tokens_per_epoch();
  num_epochs_ = epochs_and_samples(num_samples).first;
  bool separate_final_epoch = false;
  int64_t samples_sans_final = 0;
  if (num_epochs_ > 1) {
    samples_sans_final = ((num_epochs_ - 1) * tokens_per_epoch - 1) / seq_length_;
    const int64_t from_final = num_samples - samples_sans_final;
    const int64_t per_epoch = (tokens_per_epoch - 1) / seq_length_;
    TORCH_INTERNAL_ASSERT(from_final >= 0 && from_final <= per_epoch + 1);
    separate_final_epoch = from_final < static_cast<int64_t>(0.80 * static_cast<double>(per_epoch));
  }
  NumpyRandomState rng(seed);
  // _build_document_index: epochs of the documents, shuffled (the last epoch on its own when
  // separate).
  auto epochs = [&](int64_t count) {
    std::vector<int32_t> idx;
    idx.reserve(static_cast<size_t>(count * n_docs));
    for (int64_t e = 0; e < count; ++e) {
      for (int64_t doc = sequences_.first; doc < sequences_.second; ++doc) {
        idx.push_back(static_cast<int32_t>(doc));
      }
    }
    rng.shuffle(idx);
    return idx;
  };
  if (!separate_final_epoch) {
    document_index_ = epochs(num_epochs_);
  } else {
    document_index_ = epochs(num_epochs_ - 1);
    const auto last = epochs(1);
    document_index_.insert(document_index_.end(), last.begin(), last.end());
  }
  // helpers.cpp: build_sample_idx.
  const int64_t total_samples = (num_epochs_ * tokens_per_epoch - 1) / seq_length_;
  sample_index_.assign(static_cast<size_t>(2 * (total_samples + 1)), 0);
  int64_t doc_pos = 0, doc_offset = 0;
  for (int64_t s = 1; s <= total_samples; ++s) {
    int64_t remaining = seq_length_ + 1;
    while (remaining != 0) {
      const int64_t doc_length =
          data_->sequence_length(document_index_[static_cast<size_t>(doc_pos)]) - doc_offset;
      remaining -= doc_length;
      if (remaining <= 0) {
        doc_offset +=
            remaining + doc_length - 1;  // the next sample starts at this one's last token
        remaining = 0;
      } else {
        ++doc_pos;
        doc_offset = 0;
      }
    }
    sample_index_[static_cast<size_t>(2 * s)] = doc_pos;
    sample_index_[static_cast<size_t>(2 * s + 1)] = doc_offset;
  }
  // _build_shuffle_index.
  const int64_t first = separate_final_epoch ? samples_sans_final : total_samples;
  std::vector<int64_t> head(static_cast<size_t>(first));
  std::iota(head.begin(), head.end(), 0);
  rng.shuffle(head);
  if (first < total_samples) {
    std::vector<int64_t> tail(static_cast<size_t>(total_samples - first));
    std::iota(tail.begin(), tail.end(), first);
    rng.shuffle(tail);
    head.insert(head.end(), tail.begin(), tail.end());
  }
  shuffle_index_ = std::move(head);
}

void GPTDataset::sample(int64_t i, std::vector<int64_t>& out) const {
  TORCH_CHECK(i >= 0 && i < size(), "actmem::GPTDataset: sample ", i, " out of range [0, ", size(),
              ")");
  const int64_t s = shuffle_index_[static_cast<size_t>(i)];
  const int64_t beg = sample_index_[static_cast<size_t>(2 * s)];
  const int64_t beg_off = sample_index_[static_cast<size_t>(2 * s + 1)];
  const int64_t end = sample_index_[static_cast<size_t>(2 * s + 2)];
  const int64_t end_off = sample_index_[static_cast<size_t>(2 * s + 3)];
  for (int64_t pos = beg; pos <= end; ++pos) {
    const int64_t doc = document_index_[static_cast<size_t>(pos)];
    const int64_t offset = pos == beg ? beg_off : 0;
    const int64_t stop = pos == end ? end_off + 1 : data_->sequence_length(doc);
    data_->read(doc, offset, stop - offset, out);
  }
}

// ---- BlendedDataset ---------------------------------------------------------------------------

BlendedDataset::BlendedDataset(std::vector<std::shared_ptr<const SampleSource>> datasets,
                               std::vector<double> weights, int64_t size)
    : datasets_(std::move(datasets)) {
  TORCH_CHECK(!datasets_.empty() && datasets_.size() == weights.size() && datasets_.size() < 32768,
              "actmem::BlendedDataset: expected one weight per dataset");
  // helpers.cpp: build_blending_indices.
  std::vector<int64_t> current(datasets_.size(), 0);
  dataset_index_.resize(static_cast<size_t>(size));
  dataset_sample_index_.resize(static_cast<size_t>(size));
  for (int64_t i = 0; i < size; ++i) {
    const double x = std::max(static_cast<double>(i), 1.0);
    size_t best = 0;
    double best_error = weights[0] * x - static_cast<double>(current[0]);
    for (size_t d = 1; d < datasets_.size(); ++d) {
      const double error = weights[d] * x - static_cast<double>(current[d]);
      if (error > best_error) {
        best_error = error;
        best = d;
      }
    }
    dataset_index_[static_cast<size_t>(i)] = static_cast<int16_t>(best);
    dataset_sample_index_[static_cast<size_t>(i)] = current[best]++;
  }
  for (size_t d = 0; d < datasets_.size(); ++d) {
    TORCH_CHECK(current[d] <= datasets_[d]->size(), "actmem::BlendedDataset: dataset ", d,
                " provides ", datasets_[d]->size(), " samples, the blend needs ", current[d]);
  }
}

void BlendedDataset::sample(int64_t i, std::vector<int64_t>& out) const {
  TORCH_CHECK(i >= 0 && i < size(), "actmem::BlendedDataset: sample ", i, " out of range [0, ",
              size(), ")");
  const auto& d = datasets_[static_cast<size_t>(dataset_index_[static_cast<size_t>(i)])];
  d->sample(dataset_sample_index_[static_cast<size_t>(i)], out);
}

// ---- DatasetBatches ---------------------------------------------------------------------------

DatasetBatches::DatasetBatches(std::shared_ptr<const SampleSource> source, int64_t seq_length,
                               int64_t micro_batch_size, int64_t vocab_size, std::string what)
    : source_(std::move(source)),
      seq_(seq_length),
      batch_(micro_batch_size),
      vocab_(vocab_size),
      what_(std::move(what)) {
  TORCH_CHECK(source_ && source_->size() >= batch_, "actmem::DatasetBatches: the ", what_,
              " data has ", source_ ? source_->size() : 0,
              " samples, fewer than one micro-batch of ", batch_);
}

std::pair<at::Tensor, at::Tensor> DatasetBatches::next() {
  return batch(drawn_++);
}

std::pair<at::Tensor, at::Tensor> DatasetBatches::fixed(int64_t i, int64_t) const {
  return batch(i);
}

std::pair<at::Tensor, at::Tensor> DatasetBatches::batch(int64_t k) const {
  const int64_t first = k * batch_;
  TORCH_CHECK(first + batch_ <= source_->size(), "actmem::DatasetBatches: micro-batch ", k,
              " needs samples up to ", first + batch_, " but the ", what_, " data was built with ",
              source_->size(),
              " (as Megatron's, it is sized for --train-iters x "
              "--global-batch-size samples)");
  at::Tensor tokens = at::empty({batch_, seq_}, at::kLong);
  at::Tensor labels = at::empty({batch_, seq_}, at::kLong);
  std::vector<int64_t> buf;
  for (int64_t j = 0; j < batch_; ++j) {
    buf.clear();
    source_->sample(first + j, buf);
    TORCH_INTERNAL_ASSERT(static_cast<int64_t>(buf.size()) == seq_ + 1, "sample of ", buf.size(),
                          " tokens, expected ", seq_ + 1);
    for (const int64_t t : buf) {
      TORCH_CHECK(t >= 0 && t < vocab_, "actmem: token ", t, " in ", what_, " sample ", first + j,
                  " is outside the model's vocabulary [0, ", vocab_,
                  "); train with the tokenizer "
                  "the data was made with (--tokenizer-type, --tokenizer-model) or a larger "
                  "--vocab-size");
    }
    std::memcpy(tokens.data_ptr<int64_t>() + j * seq_, buf.data(), sizeof(int64_t) * seq_);
    std::memcpy(labels.data_ptr<int64_t>() + j * seq_, buf.data() + 1, sizeof(int64_t) * seq_);
  }
  return {tokens, labels};
}

// ---- the builder ------------------------------------------------------------------------------

DataBlend parse_data_path(const std::vector<std::string>& args) {
  DataBlend blend;
  TORCH_CHECK(!args.empty(), "actmem: --data-path needs a dataset prefix, or weight-prefix pairs");
  if (args.size() == 1) {
    blend.prefixes = args;
    return blend;
  }
  TORCH_CHECK(args.size() % 2 == 0,
              "actmem: --data-path with several datasets takes weight-prefix "
              "pairs (--data-path 0.3 A 0.7 B), got ",
              args.size(), " values");
  double sum = 0.0;
  for (size_t i = 0; i < args.size(); i += 2) {
    char* end = nullptr;
    const double w = std::strtod(args[i].c_str(), &end);
    TORCH_CHECK(
        end == args[i].c_str() + args[i].size() && !args[i].empty() && std::isfinite(w) && w > 0,
        "actmem: --data-path expects a positive weight before each prefix, got '", args[i],
        "' before '", args[i + 1], "'");
    blend.weights.push_back(w);
    blend.prefixes.push_back(args[i + 1]);
    sum += w;
  }
  for (auto& w : blend.weights) w /= sum;
  return blend;
}

namespace {
// _build_megatron_dataset_splits over each dataset, blended when there are several
// (blended_megatron_dataset_builder.py). cache_dirs: one per dataset, empty for none.
void build_splits(GPTSplits& out, const std::vector<std::shared_ptr<const LowLevelDataset>>& data,
                  const std::vector<double>& blend_weights, const std::string& split,
                  int64_t seq_length, uint32_t seed, const std::vector<int64_t>& samples_per_split,
                  const std::vector<std::string>& cache_dirs) {
  static const char* kNames[] = {"train", "valid", "test"};
  TORCH_CHECK(samples_per_split.size() == 3, "actmem::build_gpt_splits: three sizes expected");
  const std::vector<double> weights = parse_split(split);
  for (int s = 0; s < 3; ++s) {
    const int64_t target = samples_per_split[static_cast<size_t>(s)];
    if (target == 0) continue;
    std::vector<std::shared_ptr<const SampleSource>> parts;
    for (size_t d = 0; d < data.size(); ++d) {
      const auto ranges = split_ranges(weights, data[d]->num_sequences());
      // blended_megatron_dataset_builder.py: _get_size_per_split_per_dataset (0.5% extra).
      const int64_t size =
          blend_weights.empty()
              ? target
              : static_cast<int64_t>(
                    std::ceil(std::ceil(static_cast<double>(target) * blend_weights[d]) * 1.005));
      parts.push_back(std::make_shared<const GPTDataset>(data[d], ranges[static_cast<size_t>(s)],
                                                         size, seq_length, seed, kNames[s],
                                                         cache_dirs[d]));
    }
    std::shared_ptr<const SampleSource> source =
        blend_weights.empty()
            ? parts[0]
            : std::make_shared<const BlendedDataset>(parts, blend_weights, target);
    (s == 0 ? out.train : s == 1 ? out.valid : out.test) = source;
  }
}
}  // namespace

GPTSplits build_gpt_splits(const DataBlend& blend, const std::string& split, int64_t seq_length,
                           uint32_t seed, const std::vector<int64_t>& samples_per_split,
                           const std::string& cache_dir) {
  GPTSplits out;
  std::vector<std::shared_ptr<const LowLevelDataset>> data;
  std::vector<std::string> dirs;
  for (const auto& prefix : blend.prefixes) {
    const auto d = std::make_shared<const IndexedDataset>(prefix);
    out.documents += d->num_documents();
    out.sequences += d->num_sequences();
    out.bytes += d->bin_bytes();
    out.tokens += d->bin_bytes() / token_bytes(d->code());
    dirs.push_back(!cache_dir.empty()
                       ? cache_dir
                       : (fs::path(prefix) / "cache" / "GPTDataset_indices").string());
    data.push_back(d);
  }
  build_splits(out, data, blend.weights, split, seq_length, seed, samples_per_split, dirs);
  return out;
}

GPTSplits build_mock_gpt_splits(int64_t vocab_size, int64_t eod, int64_t seq_length, uint32_t seed,
                                const std::vector<int64_t>& samples_per_split,
                                const std::string& cache_dir) {
  GPTSplits out;
  const auto mock = std::make_shared<const MockGPTLowLevelDataset>(vocab_size, eod);
  out.documents = out.sequences = mock->num_sequences();
  out.tokens = mock->num_tokens();
  build_splits(out, {mock}, {}, "1,1,1", seq_length, seed, samples_per_split, {cache_dir});
  return out;
}

// ---- numpy's default_rng and the mock dataset ----------------------------------------------

namespace {
// numpy's SeedSequence(entropy).generate_state(n_words, uint32) (numpy/random/bit_generator.pyx,
// the hashmix/mix of Melissa O'Neill's seed_seq_fe with a pool of 4 words).
std::vector<uint32_t> seed_sequence_state(const std::vector<uint32_t>& entropy, size_t n_words) {
  constexpr uint32_t kInitA = 0x43b0d7e5, kMultA = 0x931e8875, kInitB = 0x8b51f9dd,
                     kMultB = 0x58f38ded, kMixMultL = 0xca01f9dd, kMixMultR = 0x4973f715;
  constexpr int kXShift = 16;
  constexpr size_t kPool = 4;
  uint32_t hash_const = kInitA;
  auto hashmix = [&hash_const](uint32_t v) {
    v ^= hash_const;
    hash_const *= kMultA;
    v *= hash_const;
    return v ^ (v >> kXShift);
  };
  auto mix = [](uint32_t x, uint32_t y) {
    uint32_t r = kMixMultL * x - kMixMultR * y;
    return r ^ (r >> kXShift);
  };
  uint32_t pool[kPool];
  for (size_t i = 0; i < kPool; ++i) pool[i] = hashmix(i < entropy.size() ? entropy[i] : 0u);
  for (size_t src = 0; src < kPool; ++src) {
    for (size_t dst = 0; dst < kPool; ++dst) {
      if (src != dst) pool[dst] = mix(pool[dst], hashmix(pool[src]));
    }
  }
  for (size_t src = kPool; src < entropy.size(); ++src) {
    for (size_t dst = 0; dst < kPool; ++dst) pool[dst] = mix(pool[dst], hashmix(entropy[src]));
  }
  std::vector<uint32_t> out(n_words);
  uint32_t h = kInitB;
  for (size_t i = 0; i < n_words; ++i) {
    uint32_t v = pool[i % kPool] ^ h;
    h *= kMultB;
    v *= h;
    out[i] = v ^ (v >> kXShift);
  }
  return out;
}
constexpr unsigned __int128 kPcgMultiplier =
    (static_cast<unsigned __int128>(0x2360ED051FC65DA4ULL) << 64) | 0x4385DF649FCCF645ULL;
}  // namespace

NumpyGenerator::NumpyGenerator(uint32_t seed) {
  // PCG64(SeedSequence(seed)): four uint64 words of state (little-endian pairs of uint32), then
  // pcg_setseq_128_srandom_r(initstate, initseq).
  const std::vector<uint32_t> w = seed_sequence_state({seed}, 8);
  uint64_t u[4];
  for (int i = 0; i < 4; ++i) u[i] = w[2 * i] | (static_cast<uint64_t>(w[2 * i + 1]) << 32);
  const unsigned __int128 initstate = (static_cast<unsigned __int128>(u[0]) << 64) | u[1];
  const unsigned __int128 initseq = (static_cast<unsigned __int128>(u[2]) << 64) | u[3];
  inc_ = (initseq << 1) | 1;
  state_ = 0;
  state_ = state_ * kPcgMultiplier + inc_;
  state_ += initstate;
  state_ = state_ * kPcgMultiplier + inc_;
}

uint64_t NumpyGenerator::next_uint64() {
  state_ = state_ * kPcgMultiplier + inc_;
  const uint64_t x = static_cast<uint64_t>(state_ >> 64) ^ static_cast<uint64_t>(state_);
  const unsigned rot = static_cast<unsigned>(state_ >> 122);
  return (x >> rot) | (x << ((64 - rot) & 63));
}

uint32_t NumpyGenerator::next_uint32() {
  if (has_uint32_) {
    has_uint32_ = false;
    return uint32_;
  }
  const uint64_t n = next_uint64();
  has_uint32_ = true;
  uint32_ = static_cast<uint32_t>(n >> 32);
  return static_cast<uint32_t>(n);
}

int32_t NumpyGenerator::integers_int32(int32_t low, int32_t high) {
  TORCH_CHECK(high > low, "actmem::NumpyGenerator::integers_int32: expected high > low, got [", low,
              ", ", high, ")");
  // buffered_bounded_lemire_uint32 with rng = high - 1 - low (endpoint=False).
  const uint32_t rng = static_cast<uint32_t>(static_cast<int64_t>(high) - 1 - low);
  if (rng == 0) return low;
  if (rng == 0xFFFFFFFFu) return static_cast<int32_t>(static_cast<uint32_t>(low) + next_uint32());
  const uint32_t rng_excl = rng + 1;
  uint64_t m = static_cast<uint64_t>(next_uint32()) * rng_excl;
  uint32_t leftover = static_cast<uint32_t>(m);
  if (leftover < rng_excl) {
    const uint32_t threshold = (0xFFFFFFFFu - rng) % rng_excl;
    while (leftover < threshold) {
      m = static_cast<uint64_t>(next_uint32()) * rng_excl;
      leftover = static_cast<uint32_t>(m);
    }
  }
  return static_cast<int32_t>(static_cast<int64_t>(low) + static_cast<int64_t>(m >> 32));
}

MockGPTLowLevelDataset::MockGPTLowLevelDataset(int64_t vocab_size, int64_t eod)
    : vocab_(vocab_size), eod_(eod) {
  TORCH_CHECK(vocab_size >= 1 && eod >= 0 && eod < vocab_size,
              "actmem::MockGPTLowLevelDataset: expected a positive vocabulary and an "
              "end-of-document id inside it, got vocab_size ",
              vocab_size, " and eod ", eod);
  NumpyGenerator rng(0);  // Megatron's hard-coded seed, whatever --seed is
  lengths_.resize(static_cast<size_t>(kSize));
  for (auto& l : lengths_) {
    l = rng.integers_int32(1, kMaxSequenceLength);
    tokens_ += l;
  }
}

std::string MockGPTLowLevelDataset::description() const {
  return nlohmann::json{{"mock", "MockGPTLowLevelDataset"}, {"vocab_size", vocab_}, {"eod", eod_}}
      .dump();
}

int64_t MockGPTLowLevelDataset::sequence_length(int64_t i) const {
  TORCH_CHECK(i >= 0 && i < kSize, "actmem::MockGPTLowLevelDataset: sequence ", i,
              " out of range [0, ", kSize, ")");
  return lengths_[static_cast<size_t>(i)];
}

void MockGPTLowLevelDataset::read(int64_t i, int64_t offset, int64_t length,
                                  std::vector<int64_t>& out) const {
  const int64_t n = sequence_length(i);
  TORCH_CHECK(offset >= 0 && length >= 0 && offset + length <= n,
              "actmem::MockGPTLowLevelDataset::read: tokens [", offset, ", ", offset + length,
              ") outside sequence ", i, " of ", n);
  // numpy.concatenate([(arange(L - 1) + 1) % vocab_size, [eod]]).
  for (int64_t k = offset; k < offset + length; ++k) {
    out.push_back(k < n - 1 ? (k + 1) % vocab_ : eod_);
  }
}

}  // namespace actmem
