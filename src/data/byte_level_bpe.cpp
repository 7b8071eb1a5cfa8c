// byte_level_bpe.cpp — byte-level BPE as Hugging Face's tokenizers runs it (byte_level_bpe.h).
#include "byte_level_bpe.h"

#include "unicode_text.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <climits>
#include <fstream>
#include <iterator>
#include <mutex>

namespace actmem::bpe {

const std::array<std::string, 256>& byte_symbols() {
  static const std::array<std::string, 256> symbols = [] {
    std::array<std::string, 256> out;
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      text::append_utf8(out[static_cast<size_t>(b)], printable ? static_cast<uint32_t>(b) : next++);
    }
    return out;
  }();
  return symbols;
}

std::vector<Segment> split_on_added(const std::string& text, const std::vector<AddedToken>& added,
                                    bool normalized) {
  std::vector<Segment> out;
  // Only positions whose byte starts some token are tried.
  std::array<bool, 256> starts{};
  bool any = false;
  for (const AddedToken& t : added) {
    if (t.normalized == normalized && !t.content.empty()) {
      starts[static_cast<unsigned char>(t.content[0])] = any = true;
    }
  }
  if (!any) {
    if (!text.empty()) out.push_back({0, text.size(), -1});
    return out;
  }
  size_t gap = 0, pos = 0;
  while (pos < text.size()) {
    if (!starts[static_cast<unsigned char>(text[pos])]) {
      ++pos;
      continue;
    }
    const AddedToken* best = nullptr;
    for (const AddedToken& t : added) {
      if (t.normalized == normalized && !t.content.empty() &&
          (!best || t.content.size() > best->content.size()) &&
          text.compare(pos, t.content.size(), t.content) == 0) {
        best = &t;
      }
    }
    if (!best) {
      ++pos;
      continue;
    }
    if (gap < pos) out.push_back({gap, pos, -1});
    out.push_back({pos, pos + best->content.size(), best->id});
    pos = gap = pos + best->content.size();
  }
  if (gap < text.size()) out.push_back({gap, text.size(), -1});
  return out;
}

std::string read_tokenizer_file(const std::string& path, const std::string& tokenizer,
                                const std::string& flag) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "actmem: ", tokenizer, " cannot read ", flag, " ", path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

namespace {

class ByteLevelBpe final : public Tokenizer {
 public:
  explicit ByteLevelBpe(ByteLevelBpeSpec spec) : spec_(std::move(spec)) {
    for (const auto& s : byte_symbols()) {
      TORCH_CHECK(spec_.vocab.count(s), "actmem: ", spec_.type,
                  ": the vocabulary lacks a byte's "
                  "symbol ('",
                  s, "'): byte-level BPE needs all 256");
    }
    int64_t rank = 0;
    for (const auto& [a, b] : spec_.merges) ranks_.emplace(a + " " + b, rank++);  // first wins
    for (const auto& [token, id] : spec_.vocab) {
      if (tokens_.size() <= static_cast<size_t>(id)) tokens_.resize(static_cast<size_t>(id) + 1);
      tokens_[static_cast<size_t>(id)] = token;
    }
    for (int b = 0; b < 256; ++b) byte_of_.emplace(byte_symbols()[static_cast<size_t>(b)], b);
    for (const AddedToken& t : spec_.added) added_content_.emplace(t.id, t.content);
  }
  std::string type() const override { return spec_.type; }
  int64_t vocab_size() const override { return spec_.vocab_size; }
  int64_t eod() const override { return spec_.eod; }

  std::vector<int64_t> tokenize(const std::string& text) const override {
    std::vector<int64_t> out = spec_.prefix_ids;
    for (const Segment& seg : split_on_added(text, spec_.added, false)) {
      if (seg.id >= 0) {
        out.push_back(seg.id);
        continue;
      }
      std::string part = text.substr(seg.begin, seg.end - seg.begin);
      if (spec_.nfc) part = text::nfc(part);
      for (const Segment& inner : split_on_added(part, spec_.added, true)) {
        if (inner.id >= 0) {
          out.push_back(inner.id);
          continue;
        }
        std::vector<std::string> pieces{part.substr(inner.begin, inner.end - inner.begin)};
        for (const PreTokenizerStep& step : spec_.steps) pieces = pre_tokenize(step, pieces);
        for (const std::string& piece : pieces) {
          for (const int64_t id : bpe(piece)) out.push_back(id);
        }
      }
    }
    out.insert(out.end(), spec_.suffix_ids.begin(), spec_.suffix_ids.end());
    return out;
  }

  std::string detokenize(const std::vector<int64_t>& ids) const override {
    std::string out;
    for (const int64_t id : ids) {
      if (id == spec_.eod) {
        out += "\n";  // Tokenizer's contract: <eod> reads as a line break
      } else if (const auto it = added_content_.find(id); it != added_content_.end()) {
        out += it->second;
      } else if (id >= 0 && id < static_cast<int64_t>(tokens_.size())) {
        const std::string& symbols = tokens_[static_cast<size_t>(id)];
        for (const text::Char& c : text::decode_utf8(symbols)) {
          const std::string s = symbols.substr(c.begin, c.end - c.begin);
          const auto b = byte_of_.find(s);
          if (b != byte_of_.end()) {
            out.push_back(static_cast<char>(b->second));
          } else {
            out += s;
          }
        }
      }
    }
    return out;
  }

 private:
  static std::vector<std::string> pre_tokenize(const PreTokenizerStep& step,
                                               const std::vector<std::string>& pieces) {
    std::vector<std::string> out;
    for (std::string piece : pieces) {
      if (step.kind == PreTokenizerStep::kByteLevel && step.add_prefix_space &&
          (piece.empty() || piece[0] != ' ')) {
        piece = std::string(1, ' ') + piece;
      }
      if (!step.pattern) {
        out.push_back(std::move(piece));
        continue;
      }
      const std::vector<text::Char> chars = text::decode_utf8(piece);
      std::vector<uint32_t> cps;
      cps.reserve(chars.size());
      for (const text::Char& c : chars) cps.push_back(c.cp);
      for (const auto& [b, e] : step.pattern->pieces(cps, /*with_gaps=*/true)) {
        out.push_back(piece.substr(chars[b].begin, chars[e - 1].end - chars[b].begin));
      }
    }
    return out;
  }

  std::vector<int64_t> bpe(const std::string& piece) const {
    {
      std::lock_guard<std::mutex> lock(cache_mutex_);
      if (const auto it = cache_.find(piece); it != cache_.end()) return it->second;
    }
    std::vector<std::string> word;
    std::string whole;
    for (const char b : piece) {
      word.push_back(byte_symbols()[static_cast<unsigned char>(b)]);
      whole += word.back();
    }
    std::vector<int64_t> ids;
    const auto direct = spec_.ignore_merges ? spec_.vocab.find(whole) : spec_.vocab.end();
    if (direct != spec_.vocab.end()) {
      ids.push_back(direct->second);
    } else {
      // The lowest-ranked pair, leftmost among equals, merges first (Hugging Face's BPE);
      // rank[k] is the rank of (word[k], word[k + 1]), updated only beside a merge.
      std::vector<int64_t> rank(word.size(), INT64_MAX);
      std::string key;
      const auto pair_rank = [&](size_t k) {
        key.assign(word[k]).append(1, ' ').append(word[k + 1]);
        const auto it = ranks_.find(key);
        return it == ranks_.end() ? INT64_MAX : it->second;
      };
      for (size_t k = 0; k + 1 < word.size(); ++k) rank[k] = pair_rank(k);
      while (word.size() > 1) {
        const auto best = std::min_element(rank.begin(), rank.end() - 1);
        if (*best == INT64_MAX) break;
        const auto at = static_cast<size_t>(best - rank.begin());
        word[at] += word[at + 1];
        word.erase(word.begin() + static_cast<std::ptrdiff_t>(at) + 1);
        rank.erase(rank.begin() + static_cast<std::ptrdiff_t>(at) + 1);
        rank[at] = at + 1 < word.size() ? pair_rank(at) : INT64_MAX;
        if (at > 0) rank[at - 1] = pair_rank(at - 1);
      }
      for (const auto& s : word) {
        const auto it = spec_.vocab.find(s);
        TORCH_CHECK(it != spec_.vocab.end(), "actmem: ", spec_.type, ": the merges make '", s,
                    "', which the vocabulary does not have");
        ids.push_back(it->second);
      }
    }
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (cache_.size() < 100000) cache_.emplace(piece, ids);
    return ids;
  }

  ByteLevelBpeSpec spec_;
  std::unordered_map<std::string, int64_t> ranks_;
  std::vector<std::string> tokens_;
  std::unordered_map<std::string, int> byte_of_;
  std::unordered_map<int64_t, std::string> added_content_;
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int64_t>> cache_;
};

}  // namespace

std::unique_ptr<Tokenizer> make_byte_level_bpe(ByteLevelBpeSpec spec) {
  return std::make_unique<ByteLevelBpe>(std::move(spec));
}

}  // namespace actmem::bpe
