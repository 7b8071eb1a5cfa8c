// byte_level_bpe.h — the byte-level BPE tokenizer that GPT2BPETokenizer (gpt2_bpe.cpp, from
// vocab.json + merges.txt) and HuggingFaceTokenizer (hf_tokenizer.cpp, from a tokenizer.json)
// both build, as Hugging Face's tokenizers runs such a tokenizer:
//
//   1. Added tokens found in the text (leftmost, longest first; the normalized ones in what the
//      others leave) are their ids, never split.
//   2. The rest is normalized (NFC, when the tokenizer has that normalizer) and goes through the
//   pre-tokenizer steps in order, each cutting every piece the step
//      before made: Split (a pattern, piece_regex.h; matches and the gaps between them are
//      pieces) or ByteLevel (a leading space added if asked, GPT-2's pattern if use_regex).
//   3. Each piece's bytes become printable symbols (GPT-2's bytes_to_unicode); with
//      ignore_merges a piece that is one vocabulary entry is that id; otherwise adjacent symbols
//      merge, the pair of lowest merge rank first (leftmost among equals), until none has a rank.
//   4. The post-processor's template adds its special ids before and after (e.g. Llama 3's
//      <|begin_of_text|>).
// The tiktoken tokenizer (tiktoken.cpp) shares the added-token search.
#pragma once

#include "actmem/data/tokenizer.h"
#include "piece_regex.h"

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace actmem::bpe {

/// GPT-2's bytes_to_unicode: the symbol (UTF-8) each byte becomes.
const std::array<std::string, 256>& byte_symbols();

struct AddedToken {
  std::string content;
  int64_t id;
  bool normalized = false;  // Hugging Face's: looked for in what the others leave
};

/// [begin, end) byte spans of `text`: the added tokens' occurrences (leftmost, the longest of
/// those starting there; `id` set) and the text between them (`id` -1).
struct Segment {
  size_t begin, end;
  int64_t id;
};
/// Only the tokens whose `normalized` equals `normalized` are looked for.
std::vector<Segment> split_on_added(const std::string& text, const std::vector<AddedToken>& added,
                                    bool normalized = false);

struct PreTokenizerStep {
  enum Kind { kSplit, kByteLevel } kind = kSplit;
  std::shared_ptr<const text::PieceRegex> pattern;  // kSplit's; kByteLevel's when use_regex
  bool add_prefix_space = false;                    // kByteLevel
};

struct ByteLevelBpeSpec {
  std::string type;                                         // for messages and Tokenizer::type
  std::unordered_map<std::string, int64_t> vocab;           // symbols -> id
  std::vector<std::pair<std::string, std::string>> merges;  // rank order
  bool ignore_merges = false;
  bool nfc = false;  // the NFC normalizer: applied to the text outside non-normalized added tokens
  std::vector<AddedToken> added;
  std::vector<PreTokenizerStep> steps;
  std::vector<int64_t> prefix_ids, suffix_ids;  // the post-processor's single-sequence template
  int64_t vocab_size = 0;
  int64_t eod = -1;
};

/// The tokenizer `spec` describes; throws when the vocabulary lacks a byte's symbol.
std::unique_ptr<Tokenizer> make_byte_level_bpe(ByteLevelBpeSpec spec);

/// GPT-2's pre-tokenizing pattern (a ByteLevel pre-tokenizer's with use_regex).
extern const char* const kGpt2Pattern;

/// Reads a whole file; throws naming the tokenizer and the flag that gave `path` when it cannot.
std::string read_tokenizer_file(const std::string& path, const std::string& tokenizer,
                                const std::string& flag);

}  // namespace actmem::bpe
