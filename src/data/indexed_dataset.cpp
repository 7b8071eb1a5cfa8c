// indexed_dataset.cpp — the MMIDIDX reader and writer (format in indexed_dataset.h).
#include "actmem/data/indexed_dataset.h"

#include "actmem/base/output_file.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace actmem {

namespace {

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr int64_t kHeaderBytes = 9 + 8 + 1 + 8 + 8;

// Maps a whole file read-only; returns its size through `bytes`. An empty file maps to nullptr.
void* map_file(const std::string& path, int64_t& bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "actmem::IndexedDataset: cannot open ", path, ": ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    TORCH_CHECK(false, "actmem::IndexedDataset: ", path, " is not a regular file");
  }
  bytes = static_cast<int64_t>(st.st_size);
  void* p = nullptr;
  if (bytes > 0) {
    p = ::mmap(nullptr, static_cast<size_t>(bytes), PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      const std::string err = std::strerror(errno);
      ::close(fd);
      TORCH_CHECK(false, "actmem::IndexedDataset: cannot map ", path, ": ", err);
    }
  }
  ::close(fd);
  return p;
}

template <typename T>
T read_le(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));  // the format is little-endian, as this machine
  return v;
}

template <typename T>
void append_as_int64(const char* src, int64_t n, std::vector<int64_t>& out) {
  const size_t start = out.size();
  out.resize(start + static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    out[start + static_cast<size_t>(i)] =
        static_cast<int64_t>(read_le<T>(src + i * static_cast<int64_t>(sizeof(T))));
  }
}

}  // namespace

int64_t token_bytes(int code) {
  switch (code) {
    case kUInt8:
    case kInt8:
      return 1;
    case kInt16:
    case kUInt16:
      return 2;
    case kInt32:
    case kFloat32:
      return 4;
    case kInt64:
    case kFloat64:
      return 8;
    default:
      TORCH_CHECK(false, "actmem::token_bytes: unknown dtype code ", code,
                  " (Megatron's codes are 1 to 8)");
  }
}

int optimal_dtype_code(int64_t vocab_size) {
  return vocab_size < 65500 ? kUInt16 : kInt32;
}

IndexedDataset::IndexedDataset(const std::string& prefix) : prefix_(prefix) {
  const std::string idx = prefix + ".idx", bin = prefix + ".bin";
  idx_map_ = map_file(idx, idx_bytes_);
  try {
    const char* p = static_cast<const char*>(idx_map_);
    TORCH_CHECK(idx_bytes_ >= kHeaderBytes && std::memcmp(p, kMagic, 9) == 0,
                "actmem::IndexedDataset: ", idx,
                " is not a Megatron indexed-dataset index (no "
                "MMIDIDX header); the legacy and lazy formats are not supported");
    const auto version = read_le<uint64_t>(p + 9);
    TORCH_CHECK(version == 1, "actmem::IndexedDataset: ", idx, " has version ", version,
                ", expected 1");
    code_ = read_le<uint8_t>(p + 17);
    TORCH_CHECK(code_ >= 1 && code_ <= 8, "actmem::IndexedDataset: ", idx, " has dtype code ",
                code_, ", expected 1 to 8");
    TORCH_CHECK(code_ != kFloat32 && code_ != kFloat64, "actmem::IndexedDataset: ", idx,
                " holds floating-point values (dtype code ", code_, "), not token ids");
    item_bytes_ = token_bytes(code_);
    const auto s = read_le<uint64_t>(p + 18), d = read_le<uint64_t>(p + 26);
    // The arrays must lie inside the file (overflow-safe: counts are bounded by the size first).
    const auto room = static_cast<uint64_t>(idx_bytes_ - kHeaderBytes);
    TORCH_CHECK(s <= room / 12 && d <= room / 8 && s * 12 + d * 8 <= room,
                "actmem::IndexedDataset: ", idx, " is truncated: it declares ", s,
                " sequences and ", d, " document indices but holds ", idx_bytes_, " bytes");
    num_sequences_ = static_cast<int64_t>(s);
    num_doc_indices_ = static_cast<int64_t>(d);
    // mmap is page-aligned and the header is 34 bytes: the arrays are not naturally aligned, so
    // they are kept as bytes and read with memcpy (read_le); an int32_t* or int64_t* into them
    // would be undefined behaviour (UndefinedBehaviorSanitizer reports the loads).
    lengths_ = p + kHeaderBytes;
    pointers_ = p + kHeaderBytes + 4 * num_sequences_;
    doc_indices_ = p + kHeaderBytes + 12 * num_sequences_;
    TORCH_CHECK(num_doc_indices_ >= 1, "actmem::IndexedDataset: ", idx, " has no document indices");

    bin_map_ = map_file(bin, bin_bytes_);
    // Samples are read at random places: no readahead, or every page fault would map (and keep
    // resident) tens of pages around the sample that nothing reads.
    if (bin_map_ != nullptr) ::madvise(bin_map_, static_cast<size_t>(bin_bytes_), MADV_RANDOM);
    int64_t expected = 0;
    for (int64_t i = 0; i < num_sequences_; ++i) {
      const auto len = read_le<int32_t>(lengths_ + 4 * i);
      const auto ptr = read_le<int64_t>(pointers_ + 8 * i);
      TORCH_CHECK(len >= 0 && ptr == expected, "actmem::IndexedDataset: ", idx, ": sequence ", i,
                  " has length ", len, " at byte ", ptr, ", expected a length >= 0 at byte ",
                  expected);
      expected += static_cast<int64_t>(len) * item_bytes_;
    }
    TORCH_CHECK(expected <= bin_bytes_, "actmem::IndexedDataset: ", bin, " holds ", bin_bytes_,
                " bytes but ", idx, " describes ", expected, " (is the .bin truncated?)");
    int64_t prev = -1;
    for (int64_t i = 0; i < num_doc_indices_; ++i) {
      const auto v = read_le<int64_t>(doc_indices_ + 8 * i);
      TORCH_CHECK((i == 0 ? v == 0 : v >= prev) && v <= num_sequences_,
                  "actmem::IndexedDataset: ", idx, ": document index ", i, " is ", v,
                  "; expected indices increasing from 0 to the sequence count ", num_sequences_);
      prev = v;
    }
    TORCH_CHECK(prev == num_sequences_, "actmem::IndexedDataset: ", idx,
                ": the last document index "
                "is ",
                prev, ", expected the sequence count ", num_sequences_);
  } catch (...) {
    if (idx_map_ != nullptr) ::munmap(idx_map_, static_cast<size_t>(idx_bytes_));
    if (bin_map_ != nullptr) ::munmap(bin_map_, static_cast<size_t>(bin_bytes_));
    throw;
  }
}

IndexedDataset::~IndexedDataset() {
  if (idx_map_ != nullptr) ::munmap(idx_map_, static_cast<size_t>(idx_bytes_));
  if (bin_map_ != nullptr) ::munmap(bin_map_, static_cast<size_t>(bin_bytes_));
}

std::string IndexedDataset::description() const {
  return nlohmann::json{{"dataset_path", std::filesystem::absolute(prefix_).string()},
                        {"bin_bytes", bin_bytes_},
                        {"num_sequences", num_sequences_}}
      .dump();
}

int64_t IndexedDataset::document_index(int64_t i) const {
  TORCH_CHECK(i >= 0 && i < num_doc_indices_, "actmem::IndexedDataset: document index ", i,
              " out of range [0, ", num_doc_indices_, ")");
  return read_le<int64_t>(doc_indices_ + 8 * i);
}

int64_t IndexedDataset::sequence_length(int64_t i) const {
  TORCH_CHECK(i >= 0 && i < num_sequences_, "actmem::IndexedDataset: sequence ", i,
              " out of range [0, ", num_sequences_, ")");
  return read_le<int32_t>(lengths_ + 4 * i);
}

void IndexedDataset::read(int64_t i, int64_t offset, int64_t length,
                          std::vector<int64_t>& out) const {
  const int64_t n = sequence_length(i);
  TORCH_CHECK(offset >= 0 && length >= 0 && offset + length <= n,
              "actmem::IndexedDataset::read: "
              "tokens [",
              offset, ", ", offset + length, ") of sequence ", i, " of length ", n);
  const auto ptr = read_le<int64_t>(pointers_ + 8 * i);
  const char* src = static_cast<const char*>(bin_map_) + ptr + offset * item_bytes_;
  switch (code_) {
    case kUInt8:
      append_as_int64<uint8_t>(src, length, out);
      break;
    case kInt8:
      append_as_int64<int8_t>(src, length, out);
      break;
    case kInt16:
      append_as_int64<int16_t>(src, length, out);
      break;
    case kUInt16:
      append_as_int64<uint16_t>(src, length, out);
      break;
    case kInt32:
      append_as_int64<int32_t>(src, length, out);
      break;
    case kInt64:
      append_as_int64<int64_t>(src, length, out);
      break;
    default:
      TORCH_INTERNAL_ASSERT(false);
  }
}

at::Tensor IndexedDataset::get(int64_t i) const {
  std::vector<int64_t> tokens;
  read(i, 0, sequence_length(i), tokens);
  return at::tensor(tokens, at::kLong);
}

// ---- IndexedDatasetBuilder ---------------------------------------------------------------------

namespace {
constexpr size_t kBuilderBuffer = size_t{1} << 20;

void write_all(int fd, const char* data, size_t n, const std::string& path) {
  const int err = write_fully(fd, data, n);
  TORCH_CHECK(err == 0, "actmem::IndexedDatasetBuilder: writing ", path,
              " failed: ", std::strerror(err));
}

template <typename T>
void put(std::vector<char>& buf, T v) {
  const char* p = reinterpret_cast<const char*>(&v);
  buf.insert(buf.end(), p, p + sizeof(T));
}
}  // namespace

IndexedDatasetBuilder::IndexedDatasetBuilder(const std::string& prefix, int code)
    : prefix_(prefix), code_(code), item_bytes_(token_bytes(code)) {
  TORCH_CHECK(code != kFloat32 && code != kFloat64,
              "actmem::IndexedDatasetBuilder: token ids "
              "need an integer dtype, got code ",
              code);
  const std::string tmp = prefix_ + ".bin.tmp";
  fd_ = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd_ >= 0, "actmem::IndexedDatasetBuilder: cannot create ", tmp, ": ",
              std::strerror(errno));
  buffer_.reserve(kBuilderBuffer);
}

IndexedDatasetBuilder::~IndexedDatasetBuilder() {
  if (fd_ >= 0) {
    ::close(fd_);
    std::remove((prefix_ + ".bin.tmp").c_str());  // never finalized: leave nothing half-made
  }
}

void IndexedDatasetBuilder::flush() {
  write_all(fd_, buffer_.data(), buffer_.size(), prefix_ + ".bin.tmp");
  buffer_.clear();
}

void IndexedDatasetBuilder::add_item(const std::vector<int64_t>& tokens) {
  TORCH_CHECK(!finalized_, "actmem::IndexedDatasetBuilder: add_item after finalize");
  TORCH_CHECK(tokens.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()),
              "actmem::IndexedDatasetBuilder: a sequence of ", tokens.size(),
              " tokens does not fit "
              "the format's int32 lengths");
  const int64_t lo = code_ == kUInt8    ? 0
                     : code_ == kInt8   ? -128
                     : code_ == kInt16  ? -32768
                     : code_ == kUInt16 ? 0
                     : code_ == kInt32  ? std::numeric_limits<int32_t>::min()
                                        : std::numeric_limits<int64_t>::min();
  const int64_t hi = code_ == kUInt8    ? 255
                     : code_ == kInt8   ? 127
                     : code_ == kInt16  ? 32767
                     : code_ == kUInt16 ? 65535
                     : code_ == kInt32  ? std::numeric_limits<int32_t>::max()
                                        : std::numeric_limits<int64_t>::max();
  for (const int64_t t : tokens) {
    TORCH_CHECK(t >= lo && t <= hi, "actmem::IndexedDatasetBuilder: token ", t,
                " does not fit dtype code ", code_, " [", lo, ", ", hi, "]");
    switch (code_) {
      case kUInt8:
        put(buffer_, static_cast<uint8_t>(t));
        break;
      case kInt8:
        put(buffer_, static_cast<int8_t>(t));
        break;
      case kInt16:
        put(buffer_, static_cast<int16_t>(t));
        break;
      case kUInt16:
        put(buffer_, static_cast<uint16_t>(t));
        break;
      case kInt32:
        put(buffer_, static_cast<int32_t>(t));
        break;
      default:
        put(buffer_, t);
        break;
    }
    if (buffer_.size() >= kBuilderBuffer) flush();
  }
  lengths_.push_back(static_cast<int32_t>(tokens.size()));
  tokens_ += static_cast<int64_t>(tokens.size());
}

void IndexedDatasetBuilder::end_document() {
  doc_indices_.push_back(static_cast<int64_t>(lengths_.size()));
}

void IndexedDatasetBuilder::finalize() {
  TORCH_CHECK(!finalized_, "actmem::IndexedDatasetBuilder: finalize called twice");
  flush();
  TORCH_CHECK(::fsync(fd_) == 0 && ::close(fd_) == 0, "actmem::IndexedDatasetBuilder: closing ",
              prefix_, ".bin.tmp failed: ", std::strerror(errno));
  fd_ = -1;
  std::vector<char> idx;
  idx.insert(idx.end(), kMagic, kMagic + 9);
  put<uint64_t>(idx, 1);
  put<uint8_t>(idx, static_cast<uint8_t>(code_));
  put<uint64_t>(idx, lengths_.size());
  put<uint64_t>(idx, doc_indices_.size());
  for (const int32_t l : lengths_) put(idx, l);
  int64_t ptr = 0;
  for (const int32_t l : lengths_) {
    put(idx, ptr);
    ptr += static_cast<int64_t>(l) * item_bytes_;
  }
  for (const int64_t d : doc_indices_) put(idx, d);
  const std::string idx_tmp = prefix_ + ".idx.tmp";
  const int fd = ::open(idx_tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, "actmem::IndexedDatasetBuilder: cannot create ", idx_tmp, ": ",
              std::strerror(errno));
  write_all(fd, idx.data(), idx.size(), idx_tmp);
  TORCH_CHECK(::fsync(fd) == 0 && ::close(fd) == 0, "actmem::IndexedDatasetBuilder: closing ",
              idx_tmp, " failed: ", std::strerror(errno));
  // The .bin first: an .idx never describes a .bin that is not there yet.
  TORCH_CHECK(std::rename((prefix_ + ".bin.tmp").c_str(), (prefix_ + ".bin").c_str()) == 0 &&
                  std::rename(idx_tmp.c_str(), (prefix_ + ".idx").c_str()) == 0,
              "actmem::IndexedDatasetBuilder: cannot publish ", prefix_,
              ".bin/.idx: ", std::strerror(errno));
  finalized_ = true;
}

}  // namespace actmem
