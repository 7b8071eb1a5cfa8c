// piece_regex.h — the regular expressions that cut text into pieces before byte-level BPE:
// GPT-2's pattern, tiktoken's (Megatron's TikTokenizer v1/v2, cl100k, o200k) and the Split
// pre-tokenizers of Hugging Face tokenizer.json files (Llama 3, Qwen2/3, DeepSeek).
//
// A backtracking matcher over code points, leftmost-first like the engines those tokenizers run
// (Rust's fancy-regex in tiktoken, Oniguruma in Hugging Face's tokenizers). It reads the subset
// these patterns are written in, and refuses anything else by name rather than match differently:
//   alternation |, groups (...) (?:...) (?i:...), lookahead (?=...) (?!...), anchors ^ $,
//   quantifiers ? * + {m} {m,} {m,n}, each greedy, lazy (?) or possessive (+),
//   classes [...] [^...] with ranges, \p{..}/\P{..} general categories (L, Lu, N, M, ...),
//   \s (White_Space) \S \d (Nd) \D \w (L, M, N, Pc as Oniguruma's) \W,
//   escapes \r \n \t \f \v \x.. \u.... \x{...}, and '.'.
// (?i) folds ASCII letters (as Oniguruma does for these patterns: U+017F is not 's').
// $ matches at the end of the text or before a '\n' (Oniguruma's end of line).
// Limits that keep the recursion off the stack's end: groups nest at most 32 deep, a pattern has
// at most 1024 elements, a quantified group repeats at most 500 times in a row, and a match
// attempt backtracks at most 10^6 steps (as Oniguruma's retry limit and fancy-regex's backtrack
// limit bound theirs): an error past them, never a crash or a hang.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace actmem::text {

class PieceRegex {
 public:
  /// Compiles `pattern` (UTF-8); throws naming the construct it does not read.
  explicit PieceRegex(const std::string& pattern);
  ~PieceRegex();
  PieceRegex(PieceRegex&&) noexcept;
  PieceRegex& operator=(PieceRegex&&) noexcept;

  /// The end of the match that starts at `pos` in `cps` (code points), or npos when none does.
  size_t match_at(const std::vector<uint32_t>& cps, size_t pos) const;

  /// The non-empty matches, scanning left to right as a regex's find-all does; with
  /// `with_gaps`, the stretches between them too (Hugging Face's Split, behavior Isolated).
  std::vector<std::pair<size_t, size_t>> pieces(const std::vector<uint32_t>& cps,
                                                bool with_gaps) const;

  const std::string& pattern() const { return pattern_; }

  struct Node;

 private:
  std::string pattern_;
  std::unique_ptr<std::vector<std::vector<Node>>> alternatives_;
};

}  // namespace actmem::text
