// data.cpp — tokenizer, built-in corpus, split and sampling.
#include "actmem/data/data.h"

#include <ATen/ATen.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <sstream>
#include <vector>

namespace actmem {

at::Tensor ByteTokenizer::encode(const std::string& text) {
  at::Tensor out = at::empty({static_cast<int64_t>(text.size())}, at::kByte);
  std::memcpy(out.data_ptr<uint8_t>(), text.data(), text.size());
  return out;
}

std::string ByteTokenizer::decode(const at::Tensor& tokens) {
  const at::Tensor t = tokens.to(at::kLong).contiguous().cpu();
  std::string out(static_cast<size_t>(t.numel()), '\0');
  const int64_t* p = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    TORCH_CHECK(p[i] >= 0 && p[i] < kVocabSize, "actmem::ByteTokenizer::decode: token ", p[i],
                " outside [0, 256)");
    out[static_cast<size_t>(i)] = static_cast<char>(p[i]);
  }
  return out;
}

// Note [Built-in corpus]
// A small grammar over fixed word lists, driven by SplitMix64 from a constant seed: subjects,
// verbs, objects and places make sentences; a few sentences make a paragraph. The text has
// learnable structure at the character, word and sentence level, so the loss of a small model
// falls visibly within a few dozen steps.
std::string builtin_corpus(size_t bytes) {
  static const std::array<const char*, 16> kSubjects = {
      "the engineer",    "a small model", "the scheduler", "every layer",
      "the optimizer",   "our team",      "the allocator", "a tired student",
      "the old machine", "each worker",   "the compiler",  "a careful reader",
      "the gradient",    "my neighbour",  "the river",     "a quiet cat"};
  static const std::array<const char*, 16> kVerbs = {
      "keeps",  "recomputes", "offloads", "measures", "writes", "reads",  "moves",  "saves",
      "checks", "trains",     "finds",    "loses",    "counts", "copies", "builds", "watches"};
  static const std::array<const char*, 16> kObjects = {
      "the activations", "a long sequence",      "every tensor",    "the hidden state",
      "its memory",      "the attention scores", "a paper",         "the weights",
      "two numbers",     "the host buffer",      "the first batch", "a green light",
      "the loss curve",  "an old book",          "the last page",   "a bright star"};
  static const std::array<const char*, 12> kPlaces = {
      "in the morning", "on the device",  "before the backward pass",
      "after lunch",    "on every step",  "in host memory",
      "at night",       "without a copy", "near the window",
      "during warmup",  "by the river",   "in one pass"};
  static const std::array<const char*, 6> kJoins = {" and then ", " because ", " while ",
                                                    ", so ",      " but ",     " until "};
  std::string out;
  out.reserve(bytes + 256);
  uint64_t state = 0x5EEDC0DEull;
  auto pick = [&state](size_t n) {
    state = splitmix64(state);
    return static_cast<size_t>(state % n);
  };
  int sentence = 0;
  while (out.size() < bytes) {
    std::string s = kSubjects[pick(kSubjects.size())];
    s += ' ';
    s += kVerbs[pick(kVerbs.size())];
    s += ' ';
    s += kObjects[pick(kObjects.size())];
    if (pick(3) != 0) {
      s += ' ';
      s += kPlaces[pick(kPlaces.size())];
    }
    if (pick(4) == 0) {
      s += kJoins[pick(kJoins.size())];
      s += kSubjects[pick(kSubjects.size())];
      s += ' ';
      s += kVerbs[pick(kVerbs.size())];
      s += ' ';
      s += kObjects[pick(kObjects.size())];
    }
    s[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(s[0])));
    s += pick(8) == 0 ? "!" : ".";
    out += s;
    out += (++sentence % 5 == 0) ? "\n\n" : " ";
  }
  out.resize(bytes);
  return out;
}

namespace {

// A [bytes] uint8 tensor in host memory: allocated outside the tracked device allocator, so
// device-memory numbers hold only what the model and the batch use.
at::Tensor host_bytes_tensor(int64_t bytes) {
  void* p = std::malloc(static_cast<size_t>(std::max<int64_t>(1, bytes)));
  TORCH_CHECK(p != nullptr, "actmem::load_corpus: out of host memory for ", bytes, " bytes");
  return at::from_blob(
      p, {bytes}, [](void* q) { std::free(q); }, at::kByte);
}

// Closes a file descriptor on every path out of read_text_file.
struct FdGuard {
  int fd;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
};

// read_text_file, also saying whether the result is a mapping of the file.
at::Tensor read_file_bytes(const std::string& path, bool& mapped) {
  mapped = false;
  const FdGuard file{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  TORCH_CHECK(file.fd >= 0, "actmem::read_text_file: cannot open '", path,
              "': ", std::strerror(errno));
  struct stat st {};
  TORCH_CHECK(::fstat(file.fd, &st) == 0, "actmem::read_text_file: cannot read '", path,
              "': ", std::strerror(errno));
  TORCH_CHECK(!S_ISDIR(st.st_mode), "actmem::read_text_file: '", path,
              "' is a directory, expected a text file");
  if (S_ISREG(st.st_mode)) {
    // Note [Corpus in bounded memory]: the mapping is the token stream; nothing is copied.
    const auto bytes = static_cast<int64_t>(st.st_size);
    TORCH_CHECK(bytes > 0, "actmem::read_text_file: '", path, "' is empty");
    void* p = ::mmap(nullptr, static_cast<size_t>(bytes), PROT_READ, MAP_PRIVATE, file.fd, 0);
    TORCH_CHECK(p != MAP_FAILED, "actmem::read_text_file: cannot map '", path, "' (", bytes,
                " bytes): ", std::strerror(errno));
    ::madvise(p, static_cast<size_t>(bytes), MADV_RANDOM);  // batches read scattered windows
    mapped = true;
    return at::from_blob(
        p, {bytes}, [bytes](void* q) { ::munmap(q, static_cast<size_t>(bytes)); }, at::kByte);
  }
  // A pipe or a device: read up to kMaxStreamBytes (Note [Corpus in bounded memory]) into one
  // growing buffer that becomes the tensor's storage.
  std::unique_ptr<uint8_t, void (*)(void*)> buffer(nullptr, std::free);
  size_t size = 0, capacity = 0;
  for (;;) {
    if (size == capacity) {
      TORCH_CHECK(static_cast<int64_t>(size) < kMaxStreamBytes, "actmem::read_text_file: '", path,
                  "' is not a regular file and goes on beyond ", kMaxStreamBytes >> 20,
                  " MiB; save the text to a file and pass that (a regular file of any size is "
                  "memory-mapped)");
      capacity = std::min<size_t>(std::max<size_t>(2 * capacity, 1 << 16), kMaxStreamBytes);
      auto* grown = static_cast<uint8_t*>(std::realloc(buffer.get(), capacity));
      TORCH_CHECK(grown != nullptr, "actmem::read_text_file: out of host memory reading '", path,
                  "'");
      buffer.release();
      buffer.reset(grown);
    }
    const ssize_t n = ::read(file.fd, buffer.get() + size, capacity - size);
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n >= 0, "actmem::read_text_file: error while reading '", path,
                "': ", std::strerror(errno));
    if (n == 0) break;
    size += static_cast<size_t>(n);
  }
  TORCH_CHECK(size > 0, "actmem::read_text_file: '", path, "' is empty");
  return at::from_blob(
      buffer.release(), {static_cast<int64_t>(size)}, [](void* q) { std::free(q); }, at::kByte);
}

}  // namespace

at::Tensor read_text_file(const std::string& path) {
  bool mapped = false;
  return read_file_bytes(path, mapped);
}

namespace {
std::vector<double> parse_split(const std::string& split) {
  std::vector<double> weights;
  std::stringstream ss(split);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    double w = -1.0;
    try {
      w = std::stod(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    while (used < item.size() && std::isspace(static_cast<unsigned char>(item[used]))) ++used;
    TORCH_CHECK(used == item.size() && !item.empty() && w >= 0.0 && std::isfinite(w),
                "actmem::split_corpus: --split must be 2 or 3 non-negative comma-separated "
                "weights such as \"95,5\", got \"",
                split, "\"");
    weights.push_back(w);
  }
  TORCH_CHECK(weights.size() == 2 || weights.size() == 3,
              "actmem::split_corpus: --split must be 2 or 3 non-negative comma-separated weights "
              "such as \"95,5\", got \"",
              split, "\"");
  TORCH_CHECK(weights[0] > 0.0 && weights[1] > 0.0,
              "actmem::split_corpus: --split needs positive train and validation weights, got \"",
              split, "\"");
  return weights;
}
}  // namespace

Corpus split_corpus(const at::Tensor& tokens, const std::string& split, int64_t seq_length,
                    const std::string& source) {
  TORCH_CHECK(seq_length > 0, "actmem::split_corpus: seq_length must be positive, got ",
              seq_length);
  const auto w = parse_split(split);
  const double total = std::accumulate(w.begin(), w.end(), 0.0);
  const int64_t n = tokens.numel();
  const auto n_train = static_cast<int64_t>(static_cast<double>(n) * w[0] / total);
  const auto n_valid = static_cast<int64_t>(static_cast<double>(n) * w[1] / total);
  const int64_t need = seq_length + 1;
  TORCH_CHECK(n_train >= need && n_valid >= need, "actmem::split_corpus: ", source, " has ", n,
              " tokens; with --split ", split, " the training part has ", n_train,
              " and the validation part ", n_valid,
              ", but each needs at least seq_length + 1 = ", need,
              " (use a longer file or a shorter --seq-length)");
  TORCH_CHECK(tokens.dim() == 1 && tokens.device().is_cpu(),
              "actmem::split_corpus: expected a "
              "1-D host token stream, got ",
              tokens.sizes(), " on ", tokens.device());
  return {tokens.narrow(0, 0, n_train), tokens.narrow(0, n_train, n_valid), source,
          static_cast<int64_t>(tokens.nbytes()), false};
}

Corpus load_corpus(const std::string& path, const std::string& split, int64_t seq_length) {
  if (path.empty()) {
    const std::string text = builtin_corpus(kBuiltinCorpusBytes);
    at::Tensor tokens = host_bytes_tensor(static_cast<int64_t>(text.size()));
    std::memcpy(tokens.data_ptr<uint8_t>(), text.data(), text.size());
    return split_corpus(tokens, split, seq_length, "built-in");
  }
  // Bytes are the tokens of the byte-level tokenizer: the file's bytes are the stream.
  bool mapped = false;
  at::Tensor tokens = read_file_bytes(path, mapped);
  Corpus corpus = split_corpus(tokens, split, seq_length, path);
  corpus.memory_mapped = mapped;
  return corpus;
}

BatchSampler::BatchSampler(at::Tensor stream, int64_t seq_length, int64_t micro_batch_size,
                           uint64_t seed)
    : stream_(std::move(stream)), seq_(seq_length), batch_(micro_batch_size), seed_(seed) {
  const auto type = stream_.scalar_type();
  TORCH_CHECK(
      stream_.dim() == 1 && stream_.is_contiguous() &&
          (type == at::kByte || type == at::kShort || type == at::kInt || type == at::kLong),
      "actmem::BatchSampler: expected a contiguous 1-D uint8, int16, int32 or int64 token "
      "stream, got ",
      stream_.sizes(), " ", type);
  TORCH_CHECK(seq_ > 0 && batch_ > 0,
              "actmem::BatchSampler: seq_length and micro_batch_size must "
              "be positive, got ",
              seq_, " and ", batch_);
  TORCH_CHECK(stream_.numel() >= seq_ + 1, "actmem::BatchSampler: stream of ", stream_.numel(),
              " tokens is shorter than seq_length + 1 = ", seq_ + 1);
}

namespace {
// Widens the windows [offset, offset + seq] of `src` into int64 tokens and labels.
template <typename T>
void gather_windows(const T* src, const std::vector<int64_t>& offsets, int64_t seq, int64_t* tokens,
                    int64_t* labels) {
  for (size_t i = 0; i < offsets.size(); ++i) {
    const T* w = src + offsets[i];
    int64_t* t = tokens + static_cast<int64_t>(i) * seq;
    int64_t* l = labels + static_cast<int64_t>(i) * seq;
    for (int64_t j = 0; j < seq; ++j) {
      t[j] = static_cast<int64_t>(w[j]);
      l[j] = static_cast<int64_t>(w[j + 1]);
    }
  }
}
}  // namespace

std::pair<at::Tensor, at::Tensor> BatchSampler::gather(const std::vector<int64_t>& offsets) const {
  at::Tensor tokens = at::empty({batch_, seq_}, at::kLong);
  at::Tensor labels = at::empty({batch_, seq_}, at::kLong);
  int64_t* t = tokens.data_ptr<int64_t>();
  int64_t* l = labels.data_ptr<int64_t>();
  switch (stream_.scalar_type()) {
    case at::kByte:
      gather_windows(stream_.data_ptr<uint8_t>(), offsets, seq_, t, l);
      break;
    case at::kShort:
      gather_windows(stream_.data_ptr<int16_t>(), offsets, seq_, t, l);
      break;
    case at::kInt:
      gather_windows(stream_.data_ptr<int32_t>(), offsets, seq_, t, l);
      break;
    default:
      gather_windows(stream_.data_ptr<int64_t>(), offsets, seq_, t, l);
      break;
  }
  return {tokens, labels};
}

std::pair<at::Tensor, at::Tensor> BatchSampler::next() {
  const auto windows = static_cast<uint64_t>(stream_.numel() - seq_);  // valid start offsets
  std::vector<int64_t> offsets(batch_);
  for (int64_t i = 0; i < batch_; ++i) {
    const uint64_t r = splitmix64(seed_ ^ splitmix64(static_cast<uint64_t>(drawn_ * batch_ + i)));
    offsets[i] = static_cast<int64_t>(r % windows);
  }
  ++drawn_;
  return gather(offsets);
}

void BatchSource::seek(int64_t batches) {
  TORCH_CHECK(batches >= 0, "actmem::BatchSource::seek: expected a non-negative batch count, got ",
              batches);
  drawn_ = batches;
}

std::pair<at::Tensor, at::Tensor> BatchSampler::fixed(int64_t i, int64_t count) const {
  TORCH_CHECK(count > 0 && i >= 0 && i < count,
              "actmem::BatchSampler::fixed: expected 0 <= i < "
              "count, got i=",
              i, " count=", count);
  const int64_t windows = stream_.numel() - seq_;
  const int64_t total = count * batch_;
  std::vector<int64_t> offsets(batch_);
  for (int64_t j = 0; j < batch_; ++j) {
    offsets[j] = static_cast<int64_t>((static_cast<double>(i * batch_ + j) / total) * windows);
  }
  return gather(offsets);
}

}  // namespace actmem
