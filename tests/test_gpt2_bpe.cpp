// Megatron's GPT2BPETokenizer from --vocab-file/--merge-file, checked against Hugging Face's own
// byte-level BPE (the `tokenizers` package scripts/setup.sh installs for the tests), which is
// what Megatron's GPT2BPETokenizer runs.
#include "actmem/data/data.h"
#include "actmem/data/tokenizer.h"
#include "hf_bpe.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

namespace actmem {
namespace {

using actmem::testing::expect_error_containing;
using actmem::testing::run_actmem;

TEST(Tokenizer, GPT2BPEEncodesAsHuggingFacesByteLevelBPE) {
  const std::string dir = actmem::testing::fresh_temp_dir("gpt2_bpe");
  // Each of GPT-2's pattern's alternatives, Unicode letters and numbers, white space runs before
  // words and at the end, and the special token inside text.
  const std::vector<std::string> texts = {
      "The quick brown fox jumps over the lazy dog.",
      "It's a dog's life; I'm sure they're here, we've seen you'll he'd 'twas 'S 'Ve",
      "  two leading spaces, then   three\n\n\ttab\r\nand CRLF   ",
      "numbers 12345 and 3.14159 and \xd9\xa3\xd9\xa4 and \xc2\xbd and \xe2\x85\xab",
      "h\xc3\xa9llo w\xc3\xb6rld \xc3\x85\xce\xa9 \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e\xe3\x81\xae",
      "symbols!!! ... ---> {braces} [x] #tag @user $5 100%",
      "before<|endoftext|>after <|endoftext|><|endoftext|> end",
      "emoji \xf0\x9f\x99\x82\xf0\x9f\x99\x82 ok\xc2\xa0nbsp\xe3\x80\x80ideographic space",
      "a  b   c\n  d \n",
      "",
  };
  actmem::testing::hugging_face_bpe(dir, texts, 600);
  const auto hf = nlohmann::json::parse(std::ifstream(dir + "/ids.json"));
  const auto tok = make_gpt2_bpe_tokenizer(dir + "/vocab.json", dir + "/merges.txt");
  EXPECT_EQ(tok->type(), "GPT2BPETokenizer");
  EXPECT_EQ(tok->vocab_size(), hf["size"].get<int64_t>());
  EXPECT_EQ(tok->eod(), hf["eod"].get<int64_t>());
  for (size_t i = 0; i < texts.size(); ++i) {
    const auto ids = tok->tokenize(texts[i]);
    EXPECT_EQ(ids, hf["ids"][i].get<std::vector<int64_t>>()) << "text " << i << ": " << texts[i];
    if (texts[i].find("<|endoftext|>") == std::string::npos) {
      EXPECT_EQ(tok->detokenize(ids), texts[i]) << "text " << i;
    }
  }
  // Bytes that are not UTF-8 still encode, one symbol per byte, and decode back.
  const std::string bad = "ok\xff\xfe then \xc3(";
  EXPECT_EQ(tok->detokenize(tok->tokenize(bad)), bad);
  std::filesystem::remove_all(dir);
}

TEST(Tokenizer, GPT2BPEFilesAreCheckedAndTrainSetsTheVocabulary) {
  const std::string dir = actmem::testing::fresh_temp_dir("gpt2_bpe_files");
  actmem::testing::hugging_face_bpe(dir, {"x"}, 300);
  const std::string vocab = dir + "/vocab.json", merges = dir + "/merges.txt";
  expect_error_containing([&] { make_gpt2_bpe_tokenizer(vocab, ""); },
                          "needs --vocab-file (vocab.json) and --merge-file (merges.txt)");
  expect_error_containing([&] { make_gpt2_bpe_tokenizer(dir + "/none.json", merges); },
                          "cannot read --vocab-file");
  std::ofstream(dir + "/bad.json") << "{\"a\": 0,";
  expect_error_containing([&] { make_gpt2_bpe_tokenizer(dir + "/bad.json", merges); },
                          "is not JSON");
  std::ofstream(dir + "/noeod.json") << "{\"a\": 0}";
  expect_error_containing([&] { make_gpt2_bpe_tokenizer(dir + "/noeod.json", merges); },
                          "has no <|endoftext|>");
  std::ofstream(dir + "/badmerges.txt") << "#version: 0.2\na b c\n";
  expect_error_containing([&] { make_gpt2_bpe_tokenizer(vocab, dir + "/badmerges.txt"); },
                          "line 2 is not a pair");
  // `train`: Megatron's vocabulary rule (the vocab.json's entries, padded to a multiple of
  // 128 x tensor-parallel size), and pretrain_gpt.py's default tokenizer when the files are given.
  const auto size = make_gpt2_bpe_tokenizer(vocab, merges)->vocab_size();
  const std::string log = dir + "/log.jsonl";
  auto r = run_actmem(
      "train --num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
      "--micro-batch-size 2 --threads 1 --eval-interval 0 --train-iters 1 --mock-data "
      "--vocab-file " +
      vocab + " --merge-file " + merges + " --log-json " + log);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto cfg = actmem::testing::read_json_log(log).config;
  EXPECT_EQ(cfg["model"]["vocab_size"], (size + 127) / 128 * 128);
  EXPECT_EQ(cfg["training"]["tokenizer_type"], "GPT2BPETokenizer");
  r = run_actmem("train --train-iters 1 --vocab-file " + vocab);
  EXPECT_NE(r.stderr_text.find("needs --vocab-file (vocab.json) and --merge-file"),
            std::string::npos)
      << r.output;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace actmem
