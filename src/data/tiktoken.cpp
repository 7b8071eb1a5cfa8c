// tiktoken.cpp — Megatron's TikTokenizer (megatron/core/tokenizers/text/libraries/
// tiktoken_tokenizer.py, TikTokenTokenizer): tiktoken's byte-level BPE over a vocabulary file
// that lists every token's bytes by rank.
//
//   --tokenizer-model V.json   a JSON list [{"rank": i, "token_bytes": base64, "token_str": ..}]
//                              in rank order, the first 256 the single bytes
//                              (reload_mergeable_ranks)
//   --vocab-size N             the ids (default 2^17): --tiktoken-num-special-tokens specials
//                              (default 1000) first, then the file's first N - specials tokens
//   --tokenizer-special-tokens the specials' names (default <unk> <s> </s> <mask> <pad> <cls>
//                              <sep>), the rest filled with <SPECIAL_i>; <eod> is </s>
//   --tiktoken-pattern v1|v2   the pre-tokenizing pattern (default v2)
//
// Encoding is tiktoken's Encoding.encode(text, allowed_special="all"): specials in the text are
// their ids; the rest is cut by the pattern; a piece that is one token is that token, else its
// bytes merge pairwise, the adjacent pair whose concatenation has the lowest rank first
// (leftmost among equals; tiktoken's _byte_pair_merge), until no concatenation has a rank.
#include "actmem/data/tokenizer.h"
#include "byte_level_bpe.h"
#include "unicode_text.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <climits>
#include <mutex>
#include <set>
#include <unordered_map>

namespace actmem {
namespace {

// tiktoken_tokenizer.py's _PATTERN_TIKTOKEN_V1 and _PATTERN_TIKTOKEN_V2.
const char* const kTiktokenV1 =
    R"([^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+)";
const char* const kTiktokenV2 =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|)"
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|)"
    R"( ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

const std::vector<std::string>& default_special_tokens() {
  static const std::vector<std::string> names = {"<unk>", "<s>",   "</s>", "<mask>",
                                                 "<pad>", "<cls>", "<sep>"};
  return names;
}

// RFC 4648 base64 (Python's base64.b64decode: padding required, no other characters).
bool base64_decode(const std::string& in, std::string& out) {
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  out.clear();
  if (in.size() % 4 != 0) return false;
  for (size_t i = 0; i < in.size(); i += 4) {
    int v[4];
    int pad = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = in[i + static_cast<size_t>(k)];
      if (c == '=' && i + 4 == in.size() && k >= 2) {
        v[k] = 0;
        ++pad;
      } else {
        if (pad > 0) return false;
        v[k] = value(c);
        if (v[k] < 0) return false;
      }
    }
    const uint32_t n = (static_cast<uint32_t>(v[0]) << 18) | (static_cast<uint32_t>(v[1]) << 12) |
                       (static_cast<uint32_t>(v[2]) << 6) | static_cast<uint32_t>(v[3]);
    out.push_back(static_cast<char>(n >> 16));
    if (pad < 2) out.push_back(static_cast<char>((n >> 8) & 0xFF));
    if (pad < 1) out.push_back(static_cast<char>(n & 0xFF));
  }
  return true;
}

class TikTokenizer final : public Tokenizer {
 public:
  explicit TikTokenizer(const TokenizerSpec& spec) {
    const std::string& path = spec.model;
    TORCH_CHECK(!path.empty(),
                "actmem: --tokenizer-type TikTokenizer needs --tokenizer-model, "
                "its vocabulary file (a JSON list of {rank, token_bytes, token_str})");
    TORCH_CHECK(path.size() >= 5 && path.compare(path.size() - 5, 5, ".json") == 0,
                "actmem: TikTokenizer: --tokenizer-model ", path,
                " must be a .json vocabulary file (Megatron's reload_mergeable_ranks reads only "
                "those)");
    const std::string pattern = spec.tiktoken_pattern.empty() ? "v2" : spec.tiktoken_pattern;
    TORCH_CHECK(pattern == "v1" || pattern == "v2",
                "actmem: --tiktoken-pattern must be v1 or v2, got '", pattern, "'");
    pattern_ = std::make_unique<text::PieceRegex>(pattern == "v1" ? kTiktokenV1 : kTiktokenV2);
    vocab_size_ = spec.vocab_size > 0 ? spec.vocab_size : (int64_t{1} << 17);
    num_special_ = spec.tiktoken_num_special_tokens;
    std::vector<std::string> specials =
        spec.special_tokens.empty() ? default_special_tokens() : spec.special_tokens;
    TORCH_CHECK(std::set<std::string>(specials.begin(), specials.end()).size() == specials.size(),
                "actmem: TikTokenizer: --tokenizer-special-tokens must be unique");
    TORCH_CHECK(static_cast<int64_t>(specials.size()) <= num_special_ && num_special_ < vocab_size_,
                "actmem: TikTokenizer needs --tokenizer-special-tokens (", specials.size(),
                ") <= --tiktoken-num-special-tokens (", num_special_, ") < --vocab-size (",
                vocab_size_, ")");
    for (const std::string& name : default_special_tokens()) {
      TORCH_CHECK(std::find(specials.begin(), specials.end(), name) != specials.end(),
                  "actmem: TikTokenizer: --tokenizer-special-tokens must include <unk> <s> </s> "
                  "<mask> <pad> <cls> <sep>; ",
                  name, " is missing");
    }
    eod_ = std::find(specials.begin(), specials.end(), "</s>") - specials.begin();
    for (auto i = static_cast<int64_t>(specials.size()); i < num_special_; ++i) {
      specials.push_back("<SPECIAL_" + std::to_string(i) + ">");
    }
    specials_ = specials;
    for (int64_t i = 0; i < num_special_; ++i) {
      added_.push_back({specials_[static_cast<size_t>(i)], i, false});
    }
    load(path);
  }

  std::string type() const override { return "TikTokenizer"; }
  int64_t vocab_size() const override { return vocab_size_; }
  int64_t eod() const override { return eod_; }

  std::vector<int64_t> tokenize(const std::string& text) const override {
    std::vector<int64_t> out;
    for (const bpe::Segment& seg : bpe::split_on_added(text, added_)) {
      if (seg.id >= 0) {
        out.push_back(seg.id);
        continue;
      }
      const std::string part = text.substr(seg.begin, seg.end - seg.begin);
      const std::vector<text::Char> chars = text::decode_utf8(part);
      std::vector<uint32_t> cps;
      cps.reserve(chars.size());
      for (const text::Char& c : chars) cps.push_back(c.cp);
      for (const auto& [b, e] : pattern_->pieces(cps, /*with_gaps=*/false)) {
        encode_piece(part.substr(chars[b].begin, chars[e - 1].end - chars[b].begin), out);
      }
    }
    return out;
  }

  std::string detokenize(const std::vector<int64_t>& ids) const override {
    std::string out;
    for (const int64_t id : ids) {
      if (id == eod_) {
        out += "\n";  // Tokenizer's contract: <eod> reads as a line break
      } else if (id >= 0 && id < num_special_) {
        out += specials_[static_cast<size_t>(id)];
      } else if (id >= num_special_ && id < vocab_size_) {
        out += bytes_[static_cast<size_t>(id - num_special_)];
      }
    }
    return out;
  }

 private:
  void load(const std::string& path) {
    nlohmann::json vocab;
    try {
      vocab = nlohmann::json::parse(
          bpe::read_tokenizer_file(path, "TikTokenizer", "--tokenizer-model"));
    } catch (const nlohmann::json::exception& e) {
      TORCH_CHECK(false, "actmem: TikTokenizer: --tokenizer-model ", path,
                  " is not JSON: ", e.what());
    }
    TORCH_CHECK(vocab.is_array(), "actmem: TikTokenizer: --tokenizer-model ", path,
                " must be a JSON list of {rank, token_bytes, token_str}");
    const int64_t inner = vocab_size_ - num_special_;
    TORCH_CHECK(static_cast<int64_t>(vocab.size()) >= inner,
                "actmem: TikTokenizer: --tokenizer-model ", path, " has ", vocab.size(),
                " tokens; --vocab-size ", vocab_size_, " less ", num_special_,
                " special tokens needs ", inner);
    for (int64_t i = 0; i < inner; ++i) {
      const auto& x = vocab[static_cast<size_t>(i)];
      const bool shape = x.is_object() && x.size() == 3 && x.contains("rank") &&
                         x.contains("token_bytes") && x.contains("token_str") &&
                         x["rank"].is_number_integer() && x["token_bytes"].is_string();
      TORCH_CHECK(shape, "actmem: TikTokenizer: --tokenizer-model ", path, " entry ", i,
                  " must be {\"rank\": int, \"token_bytes\": base64, \"token_str\": ...}");
      TORCH_CHECK(x["rank"].get<int64_t>() == i, "actmem: TikTokenizer: --tokenizer-model ", path,
                  " entry ", i, " has rank ", x["rank"].dump(), "; ranks must be 0, 1, 2, ...");
      std::string bytes;
      TORCH_CHECK(base64_decode(x["token_bytes"].get<std::string>(), bytes) && !bytes.empty(),
                  "actmem: TikTokenizer: --tokenizer-model ", path, " entry ", i,
                  ": token_bytes is not base64 of at least one byte");
      TORCH_CHECK(i >= 256 || (bytes.size() == 1 && static_cast<unsigned char>(bytes[0]) == i),
                  "actmem: TikTokenizer: --tokenizer-model ", path, " entry ", i,
                  ": the first 256 tokens must be the single bytes 0..255 in order");
      TORCH_CHECK(ranks_.emplace(bytes, i + num_special_).second,
                  "actmem: TikTokenizer: --tokenizer-model ", path, " lists the bytes of entry ", i,
                  " twice");
      bytes_.push_back(std::move(bytes));
    }
  }

  int64_t rank_of(const std::string& piece, size_t begin, size_t end) const {
    const auto it = ranks_.find(piece.substr(begin, end - begin));
    return it == ranks_.end() ? INT64_MAX : it->second;
  }

  void encode_piece(const std::string& piece, std::vector<int64_t>& out) const {
    if (const auto it = ranks_.find(piece); it != ranks_.end()) {
      out.push_back(it->second);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(cache_mutex_);
      if (const auto it = cache_.find(piece); it != cache_.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    // tiktoken's _byte_pair_merge: parts[i] = (start, rank of the merge of parts i and i+1).
    std::vector<std::pair<size_t, int64_t>> parts;
    const size_t n = piece.size();
    for (size_t i = 0; i + 1 < n; ++i) parts.emplace_back(i, rank_of(piece, i, i + 2));
    parts.emplace_back(n - 1, INT64_MAX);
    parts.emplace_back(n, INT64_MAX);
    const auto rank_at = [&](size_t i) {
      return i + 3 < parts.size() ? rank_of(piece, parts[i].first, parts[i + 3].first) : INT64_MAX;
    };
    while (true) {
      size_t at = 0;
      int64_t best = INT64_MAX;
      for (size_t i = 0; i + 1 < parts.size(); ++i) {
        if (parts[i].second < best) {
          best = parts[i].second;
          at = i;
        }
      }
      if (best == INT64_MAX) break;
      if (at > 0) parts[at - 1].second = rank_at(at - 1);
      parts[at].second = rank_at(at);
      parts.erase(parts.begin() + static_cast<std::ptrdiff_t>(at) + 1);
    }
    std::vector<int64_t> ids;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      const int64_t id = rank_of(piece, parts[i].first, parts[i + 1].first);
      TORCH_CHECK(id != INT64_MAX, "actmem: TikTokenizer: no token for a byte of the text");
      ids.push_back(id);
    }
    out.insert(out.end(), ids.begin(), ids.end());
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (cache_.size() < 100000) cache_.emplace(piece, std::move(ids));
  }

  std::unique_ptr<text::PieceRegex> pattern_;
  int64_t vocab_size_ = 0, num_special_ = 0, eod_ = 0;
  std::vector<std::string> specials_;
  std::vector<bpe::AddedToken> added_;
  std::unordered_map<std::string, int64_t> ranks_;
  std::vector<std::string> bytes_;
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int64_t>> cache_;
};

}  // namespace

std::unique_ptr<Tokenizer> make_tiktoken_tokenizer(const TokenizerSpec& spec) {
  return std::make_unique<TikTokenizer>(spec);
}

}  // namespace actmem
