// hf_tokenizer.cpp — Megatron's HuggingFaceTokenizer from a local tokenizer (--tokenizer-model
// DIR holding tokenizer.json, or the tokenizer.json itself), for the byte-level BPE family that
// GPT-2, Llama 3, Qwen2/Qwen3 and DeepSeek-V2/V3 ship: run by byte_level_bpe.cpp.
//
// Megatron's HuggingFaceTokenizer (megatron/core/tokenizers/text/libraries/
// huggingface_tokenizer.py) is transformers' AutoTokenizer; text_to_ids is `tokenizer(text)
// .input_ids` (the post-processor's special tokens included), the vocabulary size len(tokenizer)
// (the model's ids with the added tokens), eod the eos_token of tokenizer_config.json.
//
// What tokenizer.json may hold (anything else is refused by name, never approximated):
//   normalizer      null or NFC (Qwen2/Qwen3's)
//   pre_tokenizer   ByteLevel, or a Sequence of Split (Regex or String pattern, behavior
//                   Isolated, not inverted) ending in ByteLevel
//   model           BPE with byte-level symbols: vocab, merges ("a b" or ["a", "b"]),
//                   ignore_merges; no dropout, unk/byte fallback, subword prefix or word suffix
//   added_tokens    matched as they are written (no lstrip, rstrip or single_word)
//   post_processor  null, ByteLevel, TemplateProcessing or a Sequence of them
#include "actmem/data/tokenizer.h"
#include "byte_level_bpe.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <set>

namespace actmem {
namespace {

using nlohmann::json;

class HfLoader {
 public:
  explicit HfLoader(const std::string& model) {
    TORCH_CHECK(!model.empty(),
                "actmem: --tokenizer-type HuggingFaceTokenizer needs "
                "--tokenizer-model, a local tokenizer directory (tokenizer.json, "
                "tokenizer_config.json) or its tokenizer.json; actmem does not download from the "
                "hub");
    namespace fs = std::filesystem;
    const bool dir = fs::is_directory(model);
    file_ = dir ? (fs::path(model) / "tokenizer.json").string() : model;
    TORCH_CHECK(fs::is_regular_file(file_), "actmem: HuggingFaceTokenizer: --tokenizer-model ",
                model, dir ? " has no tokenizer.json" : " is neither a directory nor a file",
                " (a hub name needs the network, which actmem does not use: download the "
                "tokenizer and pass its directory)");
    config_ = (fs::path(file_).parent_path() / "tokenizer_config.json").string();
    map_ = (fs::path(file_).parent_path() / "special_tokens_map.json").string();
    try {
      j_ =
          json::parse(bpe::read_tokenizer_file(file_, "HuggingFaceTokenizer", "--tokenizer-model"));
    } catch (const json::exception& e) {
      TORCH_CHECK(false, "actmem: HuggingFaceTokenizer: ", file_, " is not JSON: ", e.what());
    }
    TORCH_CHECK(j_.is_object(), "actmem: HuggingFaceTokenizer: ", file_, " must be a JSON object");
  }

  bpe::ByteLevelBpeSpec spec() {
    bpe::ByteLevelBpeSpec s;
    s.type = "HuggingFaceTokenizer";
    normalizer(s);
    model(s);
    added(s);
    pre_tokenizer(s);
    post_processor(s);
    // len(tokenizer): the distinct ids of the model's vocabulary and the added tokens; they must
    // be 0..n-1 (the embedding has a row per id).
    std::set<int64_t> ids;
    for (const auto& [token, id] : s.vocab) ids.insert(id);
    for (const auto& t : s.added) ids.insert(t.id);
    TORCH_CHECK(
        !ids.empty() && *ids.begin() == 0 && *ids.rbegin() == static_cast<int64_t>(ids.size()) - 1,
        "actmem: HuggingFaceTokenizer: ", file_, "'s ids are not 0..n-1 without gaps");
    s.vocab_size = static_cast<int64_t>(ids.size());
    s.eod = eos_id(s);
    return s;
  }

 private:
  [[noreturn]] void refuse(const std::string& what) const {
    TORCH_CHECK(false, "actmem: HuggingFaceTokenizer: ", file_, ": ", what,
                " is not supported (actmem reads byte-level BPE tokenizers: docs/tokenizers.md)");
  }
  static std::string type_of(const json& x) {
    return x.is_object() && x.contains("type") && x["type"].is_string()
               ? x["type"].get<std::string>()
               : std::string("?");
  }
  static bool flag(const json& x, const char* key, bool fallback) {
    return x.contains(key) && x[key].is_boolean() ? x[key].get<bool>() : fallback;
  }

  void normalizer(bpe::ByteLevelBpeSpec& s) const {
    if (!j_.contains("normalizer") || j_["normalizer"].is_null()) return;
    if (type_of(j_["normalizer"]) != "NFC") refuse("the normalizer " + type_of(j_["normalizer"]));
    s.nfc = true;  // Qwen2/Qwen3's
  }

  void model(bpe::ByteLevelBpeSpec& s) const {
    TORCH_CHECK(j_.contains("model") && j_["model"].is_object(),
                "actmem: HuggingFaceTokenizer: ", file_, " has no model");
    const json& m = j_["model"];
    if (type_of(m) != "BPE" && !(type_of(m) == "?" && m.contains("merges"))) {
      refuse("the model " + type_of(m) + " (only BPE)");
    }
    if (m.contains("dropout") && !m["dropout"].is_null()) refuse("BPE dropout");
    if (m.contains("unk_token") && !m["unk_token"].is_null()) refuse("BPE with an unk_token");
    if (flag(m, "byte_fallback", false)) refuse("BPE byte_fallback");
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      if (m.contains(key) && !m[key].is_null() && !(m[key].is_string() && m[key] == "")) {
        refuse(std::string("BPE's ") + key);
      }
    }
    s.ignore_merges = flag(m, "ignore_merges", false);
    TORCH_CHECK(m.contains("vocab") && m["vocab"].is_object() && m.contains("merges") &&
                    m["merges"].is_array(),
                "actmem: HuggingFaceTokenizer: ", file_,
                "'s BPE model needs vocab {token: id} "
                "and merges");
    for (const auto& [token, id] : m["vocab"].items()) {
      TORCH_CHECK(id.is_number_integer() && id.get<int64_t>() >= 0,
                  "actmem: HuggingFaceTokenizer: ", file_, " maps '", token, "' to ", id.dump(),
                  "; ids must be non-negative integers");
      s.vocab.emplace(token, id.get<int64_t>());
    }
    for (const json& merge : m["merges"]) {
      if (merge.is_string()) {
        const std::string line = merge.get<std::string>();
        const size_t space = line.find(' ');
        TORCH_CHECK(space != std::string::npos && space > 0 && space + 1 < line.size() &&
                        line.find(' ', space + 1) == std::string::npos,
                    "actmem: HuggingFaceTokenizer: ", file_, ": the merge '", line,
                    "' is not a pair 'a b'");
        s.merges.emplace_back(line.substr(0, space), line.substr(space + 1));
      } else {
        TORCH_CHECK(
            merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string(),
            "actmem: HuggingFaceTokenizer: ", file_, ": a merge ", merge.dump(),
            " is not a pair of strings");
        s.merges.emplace_back(merge[0].get<std::string>(), merge[1].get<std::string>());
      }
    }
  }

  void added(bpe::ByteLevelBpeSpec& s) const {
    if (!j_.contains("added_tokens") || j_["added_tokens"].is_null()) return;
    TORCH_CHECK(j_["added_tokens"].is_array(), "actmem: HuggingFaceTokenizer: ", file_,
                "'s added_tokens must be a list");
    for (const json& t : j_["added_tokens"]) {
      TORCH_CHECK(t.is_object() && t.contains("id") && t["id"].is_number_integer() &&
                      t["id"].get<int64_t>() >= 0 && t.contains("content") &&
                      t["content"].is_string(),
                  "actmem: HuggingFaceTokenizer: ", file_, ": an added token ", t.dump(),
                  " needs an id and a content");
      const std::string content = t["content"].get<std::string>();
      for (const char* key : {"lstrip", "rstrip", "single_word"}) {
        if (flag(t, key, false)) refuse(std::string("the added token ") + content + "'s " + key);
      }
      // normalized: true tokens are looked for after the others (with no normalizer, in the
      // same text), as Hugging Face's AddedVocabulary does.
      s.added.push_back({content, t["id"].get<int64_t>(), flag(t, "normalized", false)});
    }
  }

  void pre_tokenizer(bpe::ByteLevelBpeSpec& s) const {
    const json& p = j_.contains("pre_tokenizer") ? j_["pre_tokenizer"] : json();
    std::vector<json> steps;
    if (type_of(p) == "Sequence" && p.contains("pretokenizers") && p["pretokenizers"].is_array()) {
      for (const json& x : p["pretokenizers"]) steps.push_back(x);
    } else {
      steps.push_back(p);
    }
    TORCH_CHECK(type_of(steps.back()) == "ByteLevel", "actmem: HuggingFaceTokenizer: ", file_,
                ": the pre-tokenizer ", type_of(steps.back()),
                " is not supported: actmem reads byte-level BPE "
                "tokenizers, whose pre-tokenizer ends in ByteLevel (docs/tokenizers.md)");
    for (size_t k = 0; k < steps.size(); ++k) {
      const json& x = steps[k];
      bpe::PreTokenizerStep step;
      if (type_of(x) == "ByteLevel") {
        TORCH_CHECK(k + 1 == steps.size(), "actmem: HuggingFaceTokenizer: ", file_,
                    ": ByteLevel must be the last pre-tokenizer");
        step.kind = bpe::PreTokenizerStep::kByteLevel;
        step.add_prefix_space = flag(x, "add_prefix_space", false);
        if (flag(x, "use_regex", true)) {
          step.pattern = std::make_shared<const text::PieceRegex>(bpe::kGpt2Pattern);
        }
      } else if (type_of(x) == "Split") {
        const std::string behavior = x.contains("behavior") && x["behavior"].is_string()
                                         ? x["behavior"].get<std::string>()
                                         : std::string("?");
        if (behavior != "Isolated") refuse("Split with behavior " + behavior);
        if (flag(x, "invert", false)) refuse("an inverted Split");
        const json& pat = x.contains("pattern") ? x["pattern"] : json();
        std::string regex;
        if (pat.is_object() && pat.contains("Regex") && pat["Regex"].is_string()) {
          regex = pat["Regex"].get<std::string>();
        } else if (pat.is_object() && pat.contains("String") && pat["String"].is_string()) {
          // A literal: every character escaped.
          for (const char c : pat["String"].get<std::string>()) {
            if (std::string("\\^$.|?*+()[]{}").find(c) != std::string::npos) regex.push_back('\\');
            regex.push_back(c);
          }
          TORCH_CHECK(!regex.empty(), "actmem: HuggingFaceTokenizer: ", file_,
                      ": an empty Split string");
        } else {
          refuse("a Split pattern " + pat.dump());
        }
        step.kind = bpe::PreTokenizerStep::kSplit;
        step.pattern = std::make_shared<const text::PieceRegex>(regex);
      } else {
        refuse("the pre-tokenizer " + type_of(x));
      }
      s.steps.push_back(std::move(step));
    }
  }

  void post_processor(bpe::ByteLevelBpeSpec& s) const {
    if (!j_.contains("post_processor") || j_["post_processor"].is_null()) return;
    std::vector<json> parts;
    const json& p = j_["post_processor"];
    if (type_of(p) == "Sequence" && p.contains("processors") && p["processors"].is_array()) {
      for (const json& x : p["processors"]) parts.push_back(x);
    } else {
      parts.push_back(p);
    }
    bool templated = false;
    for (const json& x : parts) {
      if (type_of(x) == "ByteLevel") continue;  // offsets only; the ids are unchanged
      if (type_of(x) != "TemplateProcessing") refuse("the post-processor " + type_of(x));
      TORCH_CHECK(!templated, "actmem: HuggingFaceTokenizer: ", file_,
                  ": two TemplateProcessing post-processors");
      templated = true;
      TORCH_CHECK(x.contains("single") && x["single"].is_array(),
                  "actmem: HuggingFaceTokenizer: ", file_,
                  ": TemplateProcessing without a single template");
      bool seen_sequence = false;
      for (const json& item : x["single"]) {
        if (item.contains("Sequence")) {
          TORCH_CHECK(!seen_sequence, "actmem: HuggingFaceTokenizer: ", file_,
                      ": the single template names the sequence twice");
          seen_sequence = true;
          continue;
        }
        TORCH_CHECK(item.contains("SpecialToken") && item["SpecialToken"].contains("id") &&
                        item["SpecialToken"]["id"].is_string(),
                    "actmem: HuggingFaceTokenizer: ", file_, ": a template item ", item.dump(),
                    " is neither a SpecialToken nor the Sequence");
        const std::string name = item["SpecialToken"]["id"].get<std::string>();
        const json& specials = x.contains("special_tokens") ? x["special_tokens"] : json();
        TORCH_CHECK(specials.is_object() && specials.contains(name) &&
                        specials[name].contains("ids") && specials[name]["ids"].is_array(),
                    "actmem: HuggingFaceTokenizer: ", file_, ": the template's special token ",
                    name, " has no ids");
        for (const json& id : specials[name]["ids"]) {
          TORCH_CHECK(id.is_number_integer(), "actmem: HuggingFaceTokenizer: ", file_,
                      ": special token ids must be integers");
          (seen_sequence ? s.suffix_ids : s.prefix_ids).push_back(id.get<int64_t>());
        }
      }
      TORCH_CHECK(seen_sequence, "actmem: HuggingFaceTokenizer: ", file_,
                  ": the single template never names the sequence");
    }
  }

  // tokenizer_config.json's eos_token (a string or {"content": ...}), else special_tokens_map's.
  int64_t eos_id(const bpe::ByteLevelBpeSpec& s) const {
    std::string eos;
    for (const std::string& path : {config_, map_}) {
      if (!eos.empty() || !std::filesystem::is_regular_file(path)) continue;
      json c;
      try {
        c = json::parse(
            bpe::read_tokenizer_file(path, "HuggingFaceTokenizer", "--tokenizer-model"));
      } catch (const json::exception& e) {
        TORCH_CHECK(false, "actmem: HuggingFaceTokenizer: ", path, " is not JSON: ", e.what());
      }
      const json& e = c.is_object() && c.contains("eos_token") ? c["eos_token"] : json();
      if (e.is_string()) eos = e.get<std::string>();
      if (e.is_object() && e.contains("content") && e["content"].is_string()) {
        eos = e["content"].get<std::string>();
      }
    }
    TORCH_CHECK(!eos.empty(), "actmem: HuggingFaceTokenizer: no eos_token in ", config_, " or ",
                map_, ": Megatron's end-of-document id is the tokenizer's eos token");
    for (const auto& t : s.added) {
      if (t.content == eos) return t.id;
    }
    const auto it = s.vocab.find(eos);
    TORCH_CHECK(it != s.vocab.end(), "actmem: HuggingFaceTokenizer: the eos_token ", eos,
                " is not in ", file_);
    return it->second;
  }

  std::string file_, config_, map_;
  json j_;
};

}  // namespace

std::unique_ptr<Tokenizer> make_hugging_face_tokenizer(const std::string& model) {
  return bpe::make_byte_level_bpe(HfLoader(model).spec());
}

}  // namespace actmem
