// sentencepiece_client.h — the asking side of actmem-sentencepiece's pipe protocol (the protocol
// in sentencepiece_helper.cpp), over any two file descriptors, so
// fuzz/fuzz_sentencepiece_client.cpp can answer it with any bytes. Internal to actmem_data.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace actmem::spm {

/// Requests to a helper through `to_helper`, replies read from `from_helper` (neither owned).
/// Every reply is checked before it is used: sizes against what the request can produce (an
/// encoding has at most kMaxIdsPerByte ids per byte of text, a decoding at most
/// kMaxBytesPerPiece bytes per id) so no allocation follows a size the helper made up, ids
/// within the model's pieces. A helper that breaks the protocol or goes away is a clear error.
class Client {
 public:
  /// NFKC can turn one 3-byte character into 18 (U+FDFA), and byte fallback a character into its
  /// 4 bytes' pieces: 24 ids per byte at most; the bound leaves room.
  static constexpr uint64_t kMaxIdsPerByte = 32;
  /// Pieces are at most 16 bytes by default (--max_piece_length); user symbols may be longer.
  static constexpr uint64_t kMaxBytesPerPiece = 4096;

  Client(int to_helper, int from_helper) : to_(to_helper), from_(from_helper) {}

  struct Info {
    int32_t pieces = 0;  // the model's piece count (vocabulary size)
    int32_t eos = -1;    // the </s> id, -1 when the model has none
  };
  /// 'I'. `model` names the model in errors.
  Info info(const std::string& model);
  /// 'E': the ids of `text`, each in [0, pieces).
  std::vector<int32_t> encode(const std::string& text, int32_t pieces);
  /// 'D': the text of `ids` (control pieces skipped by the helper).
  std::string decode(const std::vector<int32_t>& ids);

 private:
  std::string read_error();
  int to_, from_;
};

}  // namespace actmem::spm
