// TikTokenizer and HuggingFaceTokenizer (a local byte-level BPE tokenizer.json), and the regex
// subset that cuts text for them, each checked against the library Megatron runs for it: OpenAI's
// tiktoken and Hugging Face's tokenizers (bpe_reference.h).
#include "../src/data/piece_regex.h"
#include "../src/data/unicode_text.h"
#include "actmem/data/data.h"
#include "actmem/data/tokenizer.h"
#include "bpe_reference.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

namespace actmem {
namespace {

using actmem::testing::expect_error_containing;
using actmem::testing::run_actmem;
using nlohmann::json;
using namespace actmem::testing;  // the published patterns (bpe_reference.h)

// Megatron's tiktoken patterns, copied from megatron/core/tokenizers/text/libraries/
// tiktoken_tokenizer.py (_PATTERN_TIKTOKEN_V1, _PATTERN_TIKTOKEN_V2).
const char* const kMegatronV1 =
    R"([^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+)";
const char* const kMegatronV2 =
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+|"
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*|"
    "\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
// Texts that reach every alternative of those patterns: contractions in both cases (and the long
// s that (?i) folds onto s), letter case runs, marks, digit runs, white space before words, at
// the end and around line breaks, punctuation runs with line breaks and slashes, CJK, emoji.
std::vector<std::string> tricky_texts() {
  return {
      "The quick brown fox jumps over the lazy dog.",
      "It's a dog's LIFE; I'M sure THEY'RE here, we'VE seen you'll he'd 'twas 'S '\xc5\xbf",
      "  two leading spaces, then   three\n\n\ttab\r\nand CRLF   ",
      "numbers 12345 and 3.14159 and \xd9\xa3\xd9\xa4 and \xc2\xbd and \xe2\x85\xab 1234567",
      "h\xc3\xa9llo w\xc3\xb6rld \xc3\x85\xce\xa9 \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e\xe3\x81\xae "
      "\xed\x95\x9c\xea\xb5\xad\xec\x96\xb4",
      "CamelCaseWords HTTPServer iPhone x\xcc\x81y e\xcc\x81t\xc3\xa9 \xc7\x85ungla",
      "symbols!!! ... ---> {braces} [x] #tag @user $5 100% a/b/c//\n//\n",
      "emoji \xf0\x9f\x99\x82\xf0\x9f\x99\x82 ok\xc2\xa0nbsp\xe3\x80\x80ideographic space",
      "a  b   c\n  d \n  \n\n",
      "\xef\xbc\x81\xef\xbc\x9f full width\xe3\x80\x82 \xe2\x80\x9cquoted\xe2\x80\x9d",
      // Decomposed letters, a reordering, Hangul jamo, the Angstrom sign, a composition
      // exclusion (U+0958): what NFC changes.
      "cafe\xcc\x81 A\xcc\x8angstr\xc3\xb6m e\xcc\x82\xcc\xa3 \xe1\x84\x80\xe1\x85\xa1\xe1\x86\xa8 "
      "\xe2\x84\xab \xe0\xa5\x98",
      "",
  };
}

std::vector<uint32_t> code_points(const std::string& s) {
  std::vector<uint32_t> out;
  for (const text::Char& c : text::decode_utf8(s)) out.push_back(c.cp);
  return out;
}

TEST(PieceRegex, SplitsAsHuggingFacesSplit) {
  const std::string dir = actmem::testing::fresh_temp_dir("piece_regex");
  std::vector<std::string> patterns = {kGpt2, kLlama3, kQwen2, kMegatronV1, kMegatronV2};
  for (const auto& p : kDeepSeekSplits) patterns.push_back(p);
  // Lazy and bounded repeats, a repeated group, a lookahead, an escaped class, and $.
  patterns.push_back(R"(\d{2,3}?|(?:ab)+|\w+(?=\s)|[\^\-\]]+|x$)");
  const auto texts = tricky_texts();
  std::ofstream(dir + "/patterns.json") << json(patterns).dump();
  std::ofstream(dir + "/texts.json") << json(texts).dump();
  actmem::testing::run_reference_script(dir, "split.py", actmem::testing::kSplitScript);
  const auto expected = json::parse(std::ifstream(dir + "/pieces.json"));
  for (size_t p = 0; p < patterns.size(); ++p) {
    const text::PieceRegex regex(patterns[p]);
    for (size_t t = 0; t < texts.size(); ++t) {
      const auto cps = code_points(texts[t]);
      const auto chars = text::decode_utf8(texts[t]);
      std::vector<std::string> pieces;
      for (const auto& [b, e] : regex.pieces(cps, /*with_gaps=*/true)) {
        pieces.push_back(texts[t].substr(chars[b].begin, chars[e - 1].end - chars[b].begin));
      }
      EXPECT_EQ(pieces, expected[p][t].get<std::vector<std::string>>())
          << "pattern " << patterns[p] << "\ntext " << texts[t];
    }
  }
  std::filesystem::remove_all(dir);
}

TEST(UnicodeText, NfcIsPythonsUnicodedataNfc) {
  const std::string dir = actmem::testing::fresh_temp_dir("nfc");
  std::ofstream(dir + "/nfc_in.json") << json(tricky_texts()).dump();
  actmem::testing::run_reference_script(dir, "nfc.py", actmem::testing::kNfcScript);
  const auto ref = json::parse(std::ifstream(dir + "/nfc_out.json"));
  ASSERT_GT(ref["in"].size(), 8000u);
  size_t wrong = 0;
  for (size_t i = 0; i < ref["in"].size(); ++i) {
    const std::string in = ref["in"][i].get<std::string>();
    const std::string got = text::nfc(in), want = ref["out"][i].get<std::string>();
    if (got != want && ++wrong <= 10)
      ADD_FAILURE() << "NFC of '" << in << "': " << got << " != " << want;
  }
  EXPECT_EQ(wrong, 0u);
  const std::string bad = "e\xcc\x81\xff";  // a byte that is not UTF-8 stays
  EXPECT_EQ(text::nfc(bad), "\xc3\xa9\xff");
  std::filesystem::remove_all(dir);
}

TEST(PieceRegex, ConstructsOutsideTheSubsetAreRefusedByName) {
  expect_error_containing([] { text::PieceRegex(R"(\p{Han}+)"); }, "\\p{Han}");
  expect_error_containing([] { text::PieceRegex(R"((?<=a)b)"); }, "lookbehind");
  expect_error_containing([] { text::PieceRegex(R"(\bword)"); }, "the escape \\b");
  expect_error_containing([] { text::PieceRegex(R"([a[b]])"); }, "nested class");
  expect_error_containing([] { text::PieceRegex(R"((ab)"); }, "missing ')'");
  expect_error_containing([] { text::PieceRegex(R"(+a)"); }, "nothing to repeat");
  expect_error_containing([] { text::PieceRegex(R"(a{3,2})"); }, "n < m");
  // The limits that keep matching off the stack's end: errors, not crashes.
  expect_error_containing(
      [] { text::PieceRegex(std::string(40, '(') + "a" + std::string(40, ')')); },
      "nests groups more than 32 deep");
  expect_error_containing([] { text::PieceRegex(std::string(2000, 'a')); },
                          "has more than 1024 elements");
  const text::PieceRegex repeated("(?:ab)+");
  std::string abs;
  for (int i = 0; i < 1000; ++i) abs += "ab";
  expect_error_containing([&] { repeated.pieces(code_points(abs), true); },
                          "repeats more than 500 times in a row");
  EXPECT_EQ(repeated.pieces(code_points("ababx"), true).size(), 2u);
  // Catastrophic backtracking (the fuzzer's find, fuzz/corpus/piece_regex/regression-backtracking):
  // a nested quantifier on a run of spaces not followed by what it needs: 2^40 ways to fail.
  const text::PieceRegex nested(R"((?:\s+)+x)");
  expect_error_containing([&] { nested.pieces(code_points(std::string(40, ' ') + "y"), true); },
                          "backtracks more than 1000000 steps");
}

// Four Hugging Face tokenizers trained on the built-in corpus: Llama 3's shape (its Split
// pattern, ByteLevel without regex, ignore_merges, <|begin_of_text|> prepended), DeepSeek-V2's
// (six Splits), Qwen2/Qwen3's (NFC, its Split) and GPT-2's (ByteLevel with its regex and a
// prefix space, an added token).
json hf_spec() {
  json llama = {
      {"name", "llama3"},
      {"splits", {kLlama3}},
      {"use_regex", false},
      {"add_prefix_space", false},
      {"ignore_merges", true},
      {"vocab", 700},
      {"specials", {"<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>"}},
      {"bos", "<|begin_of_text|>"},
      {"eos", "<|end_of_text|>"}};
  json deepseek = {{"name", "deepseek"},
                   {"splits", kDeepSeekSplits},
                   {"use_regex", false},
                   {"add_prefix_space", false},
                   {"vocab", 600},
                   {"specials", {"<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"}},
                   {"bos", "<｜begin▁of▁sentence｜>"},
                   {"eos", "<｜end▁of▁sentence｜>"}};
  json qwen = {{"name", "qwen"},
               {"splits", {kQwen2}},
               {"use_regex", false},
               {"add_prefix_space", false},
               {"nfc", true},
               {"vocab", 600},
               {"specials", {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}},
               {"eos", "<|endoftext|>"}};
  json gpt2 = {{"name", "gpt2"},      {"splits", json::array()},
               {"use_regex", true},   {"add_prefix_space", true},
               {"vocab", 500},        {"specials", {"<|endoftext|>"}},
               {"added", {"[user]"}}, {"eos", "<|endoftext|>"}};
  return json::array({llama, deepseek, qwen, gpt2});
}

class BpeTokenizers : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(actmem::testing::fresh_temp_dir("bpe_tokenizers"));
    auto texts = tricky_texts();
    texts.push_back("<s>special</s> <SPECIAL_12> <|begin_of_text|>x<|end_of_text|> [user] hi");
    actmem::testing::train_reference_tokenizers(*dir_, hf_spec(), texts,
                                                {{"v1", kMegatronV1}, {"v2", kMegatronV2}});
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*dir_);
    delete dir_;
  }
  static std::vector<std::string> texts() {
    return json::parse(std::ifstream(*dir_ + "/texts.json")).get<std::vector<std::string>>();
  }
  static std::string* dir_;
};
std::string* BpeTokenizers::dir_ = nullptr;

TEST_F(BpeTokenizers, HuggingFaceTokenizerEncodesAsTokenizersDoes) {
  const auto all = texts();
  for (const std::string name : {"llama3", "deepseek", "qwen", "gpt2"}) {
    SCOPED_TRACE(name);
    const auto hf = json::parse(std::ifstream(*dir_ + "/" + name + "/hf_ids.json"));
    TokenizerSpec spec;
    spec.type = "HuggingFaceTokenizer";
    spec.model = *dir_ + "/" + name;
    const auto tok = make_tokenizer(spec);
    EXPECT_EQ(tok->type(), "HuggingFaceTokenizer");
    EXPECT_EQ(tok->vocab_size(), hf["size"].get<int64_t>());
    EXPECT_EQ(tok->eod(), hf["eos"].get<int64_t>());
    for (size_t i = 0; i < all.size(); ++i) {
      const auto ids = tok->tokenize(all[i]);
      EXPECT_EQ(ids, hf["ids"][i].get<std::vector<int64_t>>()) << "text " << i << ": " << all[i];
    }
    // The tokenizer.json file itself names the same tokenizer.
    spec.model += "/tokenizer.json";
    EXPECT_EQ(make_tokenizer(spec)->tokenize(all[1]), hf["ids"][1].get<std::vector<int64_t>>());
  }
  // Decoding gives the text back (after the template's <|begin_of_text|>).
  TokenizerSpec spec;
  spec.type = "HuggingFaceTokenizer";
  spec.model = *dir_ + "/llama3";
  const auto tok = make_tokenizer(spec);
  const std::string text = all[3] + all[4] + all[5];
  EXPECT_EQ(tok->detokenize(tok->tokenize(text)), "<|begin_of_text|>" + text);
}

TEST_F(BpeTokenizers, TikTokenizerEncodesAsMegatronsTiktokenEncoding) {
  const auto all = texts();
  const auto tt = json::parse(std::ifstream(*dir_ + "/tt_ids.json"));
  for (const std::string pattern : {"v1", "v2"}) {
    SCOPED_TRACE(pattern);
    TokenizerSpec spec;
    spec.type = "TikTokenizer";
    spec.model = *dir_ + "/tiktoken.json";
    spec.vocab_size = tt["size"].get<int64_t>();
    spec.tiktoken_pattern = pattern;
    const auto tok = make_tokenizer(spec);
    EXPECT_EQ(tok->type(), "TikTokenizer");
    EXPECT_EQ(tok->vocab_size(), spec.vocab_size);
    EXPECT_EQ(tok->eod(), 2);  // </s>
    for (size_t i = 0; i < all.size(); ++i) {
      const auto ids = tok->tokenize(all[i]);
      EXPECT_EQ(ids, tt[pattern][i].get<std::vector<int64_t>>()) << "text " << i << ": " << all[i];
      if (all[i].find('<') == std::string::npos) EXPECT_EQ(tok->detokenize(ids), all[i]);
    }
  }
  // A smaller --vocab-size keeps the file's first tokens: every id stays below it.
  TokenizerSpec spec;
  spec.type = "TikTokenizer";
  spec.model = *dir_ + "/tiktoken.json";
  spec.vocab_size = 1000 + 300;
  const auto small = make_tokenizer(spec);
  for (const int64_t id : small->tokenize(all[0] + all[4])) EXPECT_LT(id, 1300);
  EXPECT_EQ(small->detokenize(small->tokenize(all[0] + all[4])), all[0] + all[4]);
}

TEST_F(BpeTokenizers, UnusableFilesAndSettingsAreClearErrors) {
  const std::string d = *dir_;
  auto tik = [&](const std::string& file, int64_t vocab) {
    TokenizerSpec spec;
    spec.type = "TikTokenizer";
    spec.model = file;
    spec.vocab_size = vocab;
    return spec;
  };
  expect_error_containing([&] { make_tokenizer(tik("", 0)); }, "needs --tokenizer-model");
  expect_error_containing([&] { make_tokenizer(tik(d + "/x.txt", 0)); }, "must be a .json");
  expect_error_containing([&] { make_tokenizer(tik(d + "/tiktoken.json", 0)); },
                          "needs 130072");  // 2^17 less 1000 specials
  std::ofstream(d + "/rank.json") << R"([{"rank": 1, "token_bytes": "AA==", "token_str": ""}])";
  expect_error_containing([&] { make_tokenizer(tik(d + "/rank.json", 1001)); },
                          "entry 0 has rank 1");
  std::ofstream(d + "/keys.json") << R"([{"rank": 0, "token_bytes": "AA=="}])";
  expect_error_containing([&] { make_tokenizer(tik(d + "/keys.json", 1001)); }, "entry 0 must be");
  std::ofstream(d + "/byte.json") << R"([{"rank": 0, "token_bytes": "AQ==", "token_str": ""}])";
  expect_error_containing([&] { make_tokenizer(tik(d + "/byte.json", 1001)); },
                          "the first 256 tokens must be the single bytes");
  std::ofstream(d + "/b64.json") << R"([{"rank": 0, "token_bytes": "A!==", "token_str": ""}])";
  expect_error_containing([&] { make_tokenizer(tik(d + "/b64.json", 1001)); }, "not base64");
  auto s = tik(d + "/tiktoken.json", 1300);
  s.special_tokens = {"<s>", "</s>"};
  expect_error_containing([&] { make_tokenizer(s); }, "must include <unk>");
  s = tik(d + "/tiktoken.json", 1300);
  s.tiktoken_pattern = "v3";
  expect_error_containing([&] { make_tokenizer(s); }, "must be v1 or v2");
  s = tik(d + "/tiktoken.json", 900);
  expect_error_containing([&] { make_tokenizer(s); }, "< --vocab-size (900)");

  auto hf = [&](const std::string& model) {
    TokenizerSpec spec;
    spec.type = "HuggingFaceTokenizer";
    spec.model = model;
    return spec;
  };
  expect_error_containing([&] { make_tokenizer(hf("")); }, "does not download from the hub");
  expect_error_containing([&] { make_tokenizer(hf("meta-llama/Meta-Llama-3-8B")); },
                          "is neither a directory nor a file");
  // A tokenizer.json changed one way at a time: each is named.
  const auto base = json::parse(std::ifstream(d + "/llama3/tokenizer.json"));
  auto variant = [&](const std::string& name, const std::function<void(json&)>& change) {
    std::filesystem::create_directories(d + "/" + name);
    json j = base;
    change(j);
    std::ofstream(d + "/" + name + "/tokenizer.json") << j.dump();
    std::filesystem::copy_file(d + "/llama3/tokenizer_config.json",
                               d + "/" + name + "/tokenizer_config.json",
                               std::filesystem::copy_options::overwrite_existing);
    return hf(d + "/" + name);
  };
  expect_error_containing(
      [&] {
        make_tokenizer(variant("nfkc", [](json& j) { j["normalizer"] = {{"type", "NFKC"}}; }));
      },
      "the normalizer NFKC is not supported");
  expect_error_containing(
      [&] { make_tokenizer(variant("wp", [](json& j) { j["model"]["type"] = "WordPiece"; })); },
      "the model WordPiece");
  expect_error_containing(
      [&] {
        make_tokenizer(variant("meta", [](json& j) {
          j["pre_tokenizer"] = {{"type", "Metaspace"}};
        }));
      },
      "the pre-tokenizer Metaspace is not supported");
  expect_error_containing(
      [&] {
        make_tokenizer(variant("han", [](json& j) {
          j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\p{Han}+";
        }));
      },
      "\\p{Han}");
  expect_error_containing(
      [&] {
        make_tokenizer(variant("lstrip", [](json& j) { j["added_tokens"][0]["lstrip"] = true; }));
      },
      "lstrip");
  expect_error_containing(
      [&] {
        make_tokenizer(variant("bert", [](json& j) {
          j["post_processor"] = {{"type", "BertProcessing"}};
        }));
      },
      "the post-processor BertProcessing");
  std::filesystem::create_directories(d + "/noeos");
  std::filesystem::copy_file(d + "/llama3/tokenizer.json", d + "/noeos/tokenizer.json",
                             std::filesystem::copy_options::overwrite_existing);
  expect_error_containing([&] { make_tokenizer(hf(d + "/noeos")); }, "no eos_token");
  // The tiktoken settings belong to TikTokenizer.
  auto g = hf(d + "/llama3");
  g.tiktoken_pattern = "v1";
  expect_error_containing([&] { make_tokenizer(g); },
                          "are TikTokenizer's, not HuggingFaceTokenizer's");
}

// preprocess -> train -> generate with each tokenizer: the data, the model's vocabulary (the
// tokenizer's, padded as Megatron pads it) and the checkpoint's args that generate rebuilds it
// from.
TEST_F(BpeTokenizers, PreprocessTrainAndGenerateWithEachTokenizer) {
  const std::string d = *dir_;
  std::ofstream(d + "/docs.jsonl")
      << json({{"text", tricky_texts()[0] + " " + tricky_texts()[4]}}).dump() << "\n"
      << json({{"text", tricky_texts()[5]}}).dump() << "\n";
  const auto tt = json::parse(std::ifstream(d + "/tt_ids.json"));
  const std::string tiktoken_flags =
      "--tokenizer-type TikTokenizer --tokenizer-model " + d + "/tiktoken.json --vocab-size " +
      std::to_string(tt["size"].get<int64_t>()) + " --tiktoken-pattern v1";
  const std::string hf_flags =
      "--tokenizer-type HuggingFaceTokenizer --tokenizer-model " + d + "/llama3";
  for (const auto& [name, flags] : std::vector<std::pair<std::string, std::string>>{
           {"tik", tiktoken_flags}, {"hf", hf_flags}}) {
    SCOPED_TRACE(name);
    auto r = run_actmem("preprocess --input " + d + "/docs.jsonl --output-prefix " + d + "/" +
                        name + " --append-eod " + flags);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const std::string log = d + "/" + name + ".jsonl";
    r = run_actmem(
        "train --num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 8 "
        "--micro-batch-size 2 --threads 1 --eval-interval 0 --train-iters 2 --split 1,0,0 "
        "--data-path " +
        d + "/" + name + "_text_document " + flags + " --save " + d + "/ckpt_" + name +
        " --log-json " + log);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto cfg = actmem::testing::read_json_log(log).config;
    TokenizerSpec spec;
    spec.type = name == "tik" ? "TikTokenizer" : "HuggingFaceTokenizer";
    spec.model = name == "tik" ? d + "/tiktoken.json" : d + "/llama3";
    if (name == "tik") {
      spec.vocab_size = tt["size"].get<int64_t>();
      spec.tiktoken_pattern = "v1";
    }
    const int64_t size = make_tokenizer(spec)->vocab_size();
    EXPECT_EQ(cfg["model"]["vocab_size"], (size + 127) / 128 * 128);
    EXPECT_EQ(cfg["training"]["tokenizer_type"], spec.type);
    r = run_actmem("generate --load " + d + "/ckpt_" + name +
                   " --prompt 'The quick' --max-new-tokens 3 --greedy");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.stderr_text.find(spec.type), std::string::npos) << r.output;
  }
}

}  // namespace
}  // namespace actmem
