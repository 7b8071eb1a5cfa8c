// indexed_dataset.h — Megatron-LM's indexed dataset (the MMIDIDX format of
// megatron/core/datasets/indexed_dataset.py): token sequences in PREFIX.bin, their index in
// PREFIX.idx, both memory-mapped and never read whole.
//
//   PREFIX.idx   "MMIDIDX\0\0"              9 bytes
//                u64 version (1)
//                u8  dtype code             1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
//                                           6 float64, 7 float32, 8 uint16
//                u64 sequence count S
//                u64 document-index count D (documents + 1)
//                i32 sequence_lengths[S]    tokens per sequence
//                i64 sequence_pointers[S]   byte offset of each sequence in PREFIX.bin
//                i64 document_indices[D]    sequence index where each document starts, then S
//                (i8 sequence_modes[S]      multimodal datasets only; not read here)
//   PREFIX.bin   the tokens, little-endian, sequence after sequence
//
// All little-endian, no padding; Megatron's _IndexWriter writes exactly this.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace actmem {

/// Megatron's DType codes for the token type of a .bin file (libtorch has no uint16, so tokens
/// are read by code, not as a tensor type).
enum TokenDTypeCode : int {
  kUInt8 = 1,
  kInt8 = 2,
  kInt16 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kFloat64 = 6,
  kFloat32 = 7,
  kUInt16 = 8,
};
/// Bytes per token of a code; throws for a code outside 1..8.
int64_t token_bytes(int code);
/// The narrowest type Megatron's preprocessing picks for a vocabulary (DType.optimal_dtype):
/// uint16 below 65500 tokens, else int32.
int optimal_dtype_code(int64_t vocab_size);

/// What Megatron's GPTDataset reads from its "low-level dataset": token sequences by index.
/// IndexedDataset (PREFIX.bin/.idx files) and MockGPTLowLevelDataset (--mock-data, generated)
/// provide it.
class LowLevelDataset {
 public:
  virtual ~LowLevelDataset() = default;
  /// How messages name it: the prefix, or --mock-data.
  virtual std::string name() const = 0;
  /// JSON text identifying its contents (part of GPTDataset's index-cache key).
  virtual std::string description() const = 0;
  virtual int64_t num_sequences() const = 0;
  virtual int64_t sequence_length(int64_t i) const = 0;
  /// Tokens [offset, offset + length) of sequence i, appended to `out` as int64.
  virtual void read(int64_t i, int64_t offset, int64_t length, std::vector<int64_t>& out) const = 0;
};

/// A read-only, memory-mapped PREFIX.bin + PREFIX.idx. Sequences are read on demand; the kernel
/// pages in what a sample touches and may drop it again, so a dataset of any size costs at most
/// the pages in use.
class IndexedDataset final : public LowLevelDataset {
 public:
  /// Opens PREFIX.idx and PREFIX.bin and validates the index against the .bin's size (every
  /// sequence inside the file, pointers consistent with lengths, document indices increasing
  /// from 0 to S). Throws naming the file and what is wrong.
  explicit IndexedDataset(const std::string& prefix);
  ~IndexedDataset();
  IndexedDataset(const IndexedDataset&) = delete;
  IndexedDataset& operator=(const IndexedDataset&) = delete;

  const std::string& prefix() const { return prefix_; }
  std::string name() const override { return prefix_; }
  /// {"dataset_path": absolute prefix, "bin_bytes", "num_sequences"}.
  std::string description() const override;
  int64_t num_sequences() const override { return num_sequences_; }
  /// Documents (document_indices has one entry more).
  int64_t num_documents() const { return num_doc_indices_ - 1; }
  int code() const { return code_; }
  int64_t sequence_length(int64_t i) const override;
  /// Entry i of the document indices (0 <= i <= num_documents()): the sequence where document i
  /// starts, and the sequence count for i = num_documents().
  int64_t document_index(int64_t i) const;
  /// Tokens [offset, offset + length) of sequence i, appended to `out` as int64.
  void read(int64_t i, int64_t offset, int64_t length, std::vector<int64_t>& out) const override;
  /// Every token of sequence i as an int64 tensor.
  at::Tensor get(int64_t i) const;
  /// Bytes of the two files.
  int64_t bin_bytes() const { return bin_bytes_; }

 private:
  std::string prefix_;
  void* idx_map_ = nullptr;
  void* bin_map_ = nullptr;
  int64_t idx_bytes_ = 0, bin_bytes_ = 0;
  int code_ = 0;
  int64_t item_bytes_ = 0;
  int64_t num_sequences_ = 0, num_doc_indices_ = 0;
  // The .idx's arrays, little-endian and not naturally aligned: read with memcpy.
  const char* lengths_ = nullptr;
  const char* pointers_ = nullptr;
  const char* doc_indices_ = nullptr;
};

/// Writes PREFIX.bin and PREFIX.idx as Megatron's IndexedDatasetBuilder: add_item() appends one
/// sequence, end_document() closes a document, finalize() writes the index. The .bin is written
/// through a buffer as items arrive (memory holds the index only); both files are written under
/// temporary names and renamed when complete, so a crash never leaves a dataset that loads
/// wrong.
class IndexedDatasetBuilder {
 public:
  IndexedDatasetBuilder(const std::string& prefix, int code);
  ~IndexedDatasetBuilder();
  IndexedDatasetBuilder(const IndexedDatasetBuilder&) = delete;
  IndexedDatasetBuilder& operator=(const IndexedDatasetBuilder&) = delete;
  /// Appends one sequence; every token must fit the dtype.
  void add_item(const std::vector<int64_t>& tokens);
  void end_document();
  /// Writes the index and publishes both files. The builder is spent afterwards.
  void finalize();
  int64_t tokens_written() const { return tokens_; }

 private:
  void flush();
  std::string prefix_;
  int code_;
  int64_t item_bytes_;
  int fd_ = -1;
  std::vector<char> buffer_;
  std::vector<int32_t> lengths_;
  std::vector<int64_t> doc_indices_{0};
  int64_t tokens_ = 0;
  bool finalized_ = false;
};

}  // namespace actmem
