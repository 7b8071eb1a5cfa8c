// gpt2_bpe.cpp — Megatron's GPT2BPETokenizer (--vocab-file vocab.json --merge-file merges.txt):
// GPT-2's byte-level BPE, as Hugging Face's GPT-2 tokenizer applies it (the one Megatron's
// megatron/core/tokenizers builds for GPT2BPETokenizer from these two files).
//
//   1. "<|endoftext|>" in the text is the end-of-document id (a special token: never split).
//   2. The rest is cut by GPT-2's pattern
//        's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//      matched here by hand over code points (alternatives tried in order at each position, as
//      a backtracking regex does), with Unicode's letter and number categories
//      (unicode_classes.inc) and White_Space.
//   3. Each piece's bytes become printable characters (bytes_to_unicode), then adjacent symbols
//      merge by the rank of their pair in merges.txt, lowest rank first, every occurrence of that
//      pair left to right, until no pair has a rank.
//   4. Each symbol is looked up in vocab.json.
#include "actmem/data/tokenizer.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <climits>
#include <fstream>
#include <iterator>
#include <mutex>
#include <sstream>
#include <unordered_map>

namespace actmem {
namespace {

struct CodePointRange {
  uint32_t first, last;
};
#include "unicode_classes.inc"

template <size_t N>
bool in_ranges(const CodePointRange (&table)[N], uint32_t cp) {
  const auto it = std::upper_bound(std::begin(table), std::end(table), cp,
                                   [](uint32_t c, const CodePointRange& r) { return c < r.first; });
  return it != std::begin(table) && cp <= std::prev(it)->last;
}

// Unicode's White_Space property (PropList.txt), what \s matches in the regex engines of
// Hugging Face's tokenizers.
bool is_space(uint32_t cp) {
  return (cp >= 0x9 && cp <= 0xD) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}
bool is_letter(uint32_t cp) {
  return cp < 0x80 ? std::isalpha(static_cast<int>(cp)) != 0 : in_ranges(kLetters, cp);
}
bool is_number(uint32_t cp) {
  return cp < 0x80 ? (cp >= '0' && cp <= '9') : in_ranges(kNumbers, cp);
}

// One character of the text: its code point and its bytes [begin, end). A byte that does not
// start valid UTF-8 is a character of its own (an "other" character: its byte still encodes).
struct Char {
  uint32_t cp;
  size_t begin, end;
};

std::vector<Char> decode_utf8(const std::string& s) {
  std::vector<Char> out;
  size_t i = 0;
  while (i < s.size()) {
    const auto b = static_cast<unsigned char>(s[i]);
    int n = b < 0x80 ? 1 : (b >> 5) == 0x6 ? 2 : (b >> 4) == 0xE ? 3 : (b >> 3) == 0x1E ? 4 : 0;
    uint32_t cp = n == 1 ? b : n == 2 ? (b & 0x1F) : n == 3 ? (b & 0x0F) : (b & 0x07);
    bool ok = n > 0 && i + static_cast<size_t>(n) <= s.size();
    for (int k = 1; ok && k < n; ++k) {
      const auto c = static_cast<unsigned char>(s[i + static_cast<size_t>(k)]);
      ok = (c & 0xC0) == 0x80;
      cp = (cp << 6) | (c & 0x3F);
    }
    // Overlong forms, surrogates and values past U+10FFFF are not characters either.
    ok = ok && !(n == 2 && cp < 0x80) && !(n == 3 && cp < 0x800) && !(n == 4 && cp < 0x10000) &&
         !(cp >= 0xD800 && cp <= 0xDFFF) && cp <= 0x10FFFF;
    if (!ok) {
      out.push_back({0xFFFFFFFFu, i, i + 1});  // neither space, letter nor number
      ++i;
      continue;
    }
    out.push_back({cp, i, i + static_cast<size_t>(n)});
    i += static_cast<size_t>(n);
  }
  return out;
}

bool space_at(const std::vector<Char>& c, size_t i) {
  return c[i].cp != 0xFFFFFFFFu && is_space(c[i].cp);
}
bool letter_at(const std::vector<Char>& c, size_t i) {
  return c[i].cp != 0xFFFFFFFFu && is_letter(c[i].cp);
}
bool number_at(const std::vector<Char>& c, size_t i) {
  return c[i].cp != 0xFFFFFFFFu && is_number(c[i].cp);
}
bool other_at(const std::vector<Char>& c, size_t i) {
  return !space_at(c, i) && !letter_at(c, i) && !number_at(c, i);
}

// The end (in characters) of the piece GPT-2's pattern matches at i (i < c.size()).
size_t match_piece(const std::vector<Char>& c, size_t i) {
  const size_t n = c.size();
  // 's|'t|'re|'ve|'m|'ll|'d
  if (c[i].cp == '\'' && i + 1 < n) {
    const uint32_t a = c[i + 1].cp, b = i + 2 < n ? c[i + 2].cp : 0;
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
  }
  // ' ?\p{L}+', ' ?\p{N}+', ' ?[^\s\p{L}\p{N}]+'
  using Class = bool (*)(const std::vector<Char>&, size_t);
  for (const Class cls : std::array<Class, 3>{letter_at, number_at, other_at}) {
    size_t j = i;
    if (c[j].cp == ' ' && j + 1 < n && cls(c, j + 1)) ++j;
    if (!cls(c, j)) continue;
    while (j < n && cls(c, j)) ++j;
    return j;
  }
  // '\s+(?!\S)': the whitespace run, less its last character when a non-space follows it;
  // else '\s+'.
  size_t j = i;
  while (j < n && space_at(c, j)) ++j;
  if (j < n && j - i >= 2) return j - 1;
  return j;
}

// GPT-2's bytes_to_unicode: printable bytes map to themselves, the others to 256 + k.
std::array<std::string, 256> byte_symbols() {
  std::array<std::string, 256> out;
  int next = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    const uint32_t cp = printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + next++);
    std::string s;
    if (cp < 0x80) {
      s.push_back(static_cast<char>(cp));
    } else {
      s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
    out[static_cast<size_t>(b)] = s;
  }
  return out;
}

std::string read_file(const std::string& path, const char* flag) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "actmem: GPT2BPETokenizer cannot read ", flag, " ", path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

class GPT2BPETokenizer final : public Tokenizer {
 public:
  GPT2BPETokenizer(const std::string& vocab_file, const std::string& merge_file)
      : symbols_(byte_symbols()) {
    TORCH_CHECK(!vocab_file.empty() && !merge_file.empty(),
                "actmem: --tokenizer-type GPT2BPETokenizer needs --vocab-file (vocab.json) and "
                "--merge-file (merges.txt)");
    nlohmann::json vocab;
    try {
      vocab = nlohmann::json::parse(read_file(vocab_file, "--vocab-file"));
    } catch (const nlohmann::json::exception& e) {
      TORCH_CHECK(false, "actmem: GPT2BPETokenizer: --vocab-file ", vocab_file,
                  " is not JSON: ", e.what());
    }
    TORCH_CHECK(vocab.is_object() && !vocab.empty(), "actmem: GPT2BPETokenizer: --vocab-file ",
                vocab_file, " must be a JSON object {token: id}");
    for (const auto& [token, id] : vocab.items()) {
      TORCH_CHECK(id.is_number_integer() && id.get<int64_t>() >= 0 &&
                      id.get<int64_t>() < static_cast<int64_t>(vocab.size()),
                  "actmem: GPT2BPETokenizer: --vocab-file ", vocab_file, " maps '", token, "' to ",
                  id.dump(), "; ids must be integers in [0, ", vocab.size(), ")");
      const auto i = id.get<int64_t>();
      TORCH_CHECK(ids_.emplace(token, i).second, "actmem: GPT2BPETokenizer: duplicate token");
      if (tokens_.size() <= static_cast<size_t>(i)) tokens_.resize(static_cast<size_t>(i) + 1);
      TORCH_CHECK(tokens_[static_cast<size_t>(i)].empty(),
                  "actmem: GPT2BPETokenizer: --vocab-file ", vocab_file, " gives id ", i,
                  " to two tokens");
      tokens_[static_cast<size_t>(i)] = token;
    }
    const auto eod = ids_.find("<|endoftext|>");
    TORCH_CHECK(eod != ids_.end(), "actmem: GPT2BPETokenizer: --vocab-file ", vocab_file,
                " has no <|endoftext|>, the token that ends documents");
    eod_ = eod->second;
    for (const auto& s : symbols_) {
      TORCH_CHECK(ids_.count(s), "actmem: GPT2BPETokenizer: --vocab-file ", vocab_file,
                  " lacks a byte's symbol ('", s, "'): byte-level BPE needs all 256");
    }
    std::istringstream merges(read_file(merge_file, "--merge-file"));
    std::string line;
    int64_t rank = 0, line_no = 0;
    while (std::getline(merges, line)) {
      ++line_no;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.empty() || line.rfind("#version", 0) == 0) continue;
      const size_t space = line.find(' ');
      TORCH_CHECK(space != std::string::npos && space > 0 && space + 1 < line.size() &&
                      line.find(' ', space + 1) == std::string::npos,
                  "actmem: GPT2BPETokenizer: --merge-file ", merge_file, " line ", line_no,
                  " is not a pair 'a b': '", line, "'");
      ranks_.emplace(line, rank++);  // first occurrence wins
    }
    TORCH_CHECK(!ranks_.empty(), "actmem: GPT2BPETokenizer: --merge-file ", merge_file,
                " has no merges");
  }
  std::string type() const override { return "GPT2BPETokenizer"; }
  int64_t vocab_size() const override { return static_cast<int64_t>(ids_.size()); }
  int64_t eod() const override { return eod_; }

  std::vector<int64_t> tokenize(const std::string& text) const override {
    static const std::string kEod = "<|endoftext|>";
    std::vector<int64_t> out;
    size_t start = 0;
    while (start <= text.size()) {
      const size_t special = text.find(kEod, start);
      encode_ordinary(
          text.substr(start, special == std::string::npos ? std::string::npos : special - start),
          out);
      if (special == std::string::npos) break;
      out.push_back(eod_);
      start = special + kEod.size();
    }
    return out;
  }

  std::string detokenize(const std::vector<int64_t>& ids) const override {
    std::string symbols;
    for (const int64_t id : ids) {
      if (id == eod_) {
        symbols += "\n";  // Tokenizer's contract: <eod> reads as a line break
      } else if (id >= 0 && id < static_cast<int64_t>(tokens_.size())) {
        symbols += tokens_[static_cast<size_t>(id)];
      }
    }
    // Each symbol back to its byte (a symbol that is no byte's, as "\n" above, stays as it is).
    std::string out;
    for (const Char& c : decode_utf8(symbols)) {
      const std::string s = symbols.substr(c.begin, c.end - c.begin);
      const auto it = byte_of_symbol().find(s);
      if (it != byte_of_symbol().end()) {
        out.push_back(static_cast<char>(it->second));
      } else {
        out += s;
      }
    }
    return out;
  }

 private:
  const std::unordered_map<std::string, int>& byte_of_symbol() const {
    std::call_once(inverse_once_, [this] {
      for (int b = 0; b < 256; ++b) inverse_.emplace(symbols_[static_cast<size_t>(b)], b);
    });
    return inverse_;
  }

  void encode_ordinary(const std::string& text, std::vector<int64_t>& out) const {
    const std::vector<Char> chars = decode_utf8(text);
    size_t i = 0;
    while (i < chars.size()) {
      const size_t j = match_piece(chars, i);
      const std::string piece = text.substr(chars[i].begin, chars[j - 1].end - chars[i].begin);
      for (const int64_t id : bpe(piece)) out.push_back(id);
      i = j;
    }
  }

  std::vector<int64_t> bpe(const std::string& piece) const {
    {
      std::lock_guard<std::mutex> lock(cache_mutex_);
      if (const auto it = cache_.find(piece); it != cache_.end()) return it->second;
    }
    std::vector<std::string> word;
    for (const char b : piece) word.push_back(symbols_[static_cast<unsigned char>(b)]);
    while (word.size() > 1) {
      int64_t best = INT64_MAX;
      for (size_t k = 0; k + 1 < word.size(); ++k) {
        const auto it = ranks_.find(word[k] + " " + word[k + 1]);
        if (it != ranks_.end()) best = std::min(best, it->second);
      }
      if (best == INT64_MAX) break;
      std::vector<std::string> merged;
      for (size_t k = 0; k < word.size(); ++k) {
        if (k + 1 < word.size()) {
          const auto it = ranks_.find(word[k] + " " + word[k + 1]);
          if (it != ranks_.end() && it->second == best) {
            merged.push_back(word[k] + word[k + 1]);
            ++k;
            continue;
          }
        }
        merged.push_back(word[k]);
      }
      word = std::move(merged);
    }
    std::vector<int64_t> ids;
    for (const auto& s : word) {
      const auto it = ids_.find(s);
      TORCH_CHECK(it != ids_.end(), "actmem: GPT2BPETokenizer: the merges make '", s,
                  "', which --vocab-file does not have");
      ids.push_back(it->second);
    }
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (cache_.size() < 100000) cache_.emplace(piece, ids);
    return ids;
  }

  std::array<std::string, 256> symbols_;
  std::unordered_map<std::string, int64_t> ids_;
  std::vector<std::string> tokens_;
  std::unordered_map<std::string, int64_t> ranks_;
  int64_t eod_ = 0;
  mutable std::once_flag inverse_once_;
  mutable std::unordered_map<std::string, int> inverse_;
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int64_t>> cache_;
};

}  // namespace

std::unique_ptr<Tokenizer> make_gpt2_bpe_tokenizer(const std::string& vocab_file,
                                                   const std::string& merge_file) {
  return std::make_unique<GPT2BPETokenizer>(vocab_file, merge_file);
}

}  // namespace actmem
