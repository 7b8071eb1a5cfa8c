// test_data.cpp — tokenizer, built-in corpus, file loading, split and sampler edge cases.
#include "actmem/data/data.h"
#include "test_util.h"

#include <ATen/CPUGeneratorImpl.h>

#include <fstream>
#include <set>

namespace actmem {
namespace {

using actmem::testing::bitwise_equal;
using actmem::testing::expect_error_containing;

std::string write_temp(const std::string& name, const std::string& content) {
  const std::string path = ::testing::TempDir() + name;
  std::ofstream(path, std::ios::binary) << content;
  return path;
}

TEST(ByteTokenizer, RoundTripsEveryByte) {
  std::string all;
  for (int i = 0; i < 256; ++i) all.push_back(static_cast<char>(i));
  const at::Tensor t = ByteTokenizer::encode(all);
  ASSERT_EQ(t.numel(), 256);
  EXPECT_EQ(t[0].item<int64_t>(), 0);
  EXPECT_EQ(t[255].item<int64_t>(), 255);  // no sign extension of char
  EXPECT_EQ(ByteTokenizer::decode(t), all);
  expect_error_containing([] { ByteTokenizer::decode(at::full({1}, 300, at::kLong)); },
                          "token 300 outside [0, 256)");
}

TEST(BuiltinCorpus, IsDeterministicAndSized) {
  const std::string a = builtin_corpus(50000), b = builtin_corpus(50000);
  EXPECT_EQ(a.size(), 50000u);
  EXPECT_EQ(a, b);
  EXPECT_EQ(builtin_corpus(1000), a.substr(0, 1000));  // a prefix of the longer text
  std::set<char> chars(a.begin(), a.end());
  EXPECT_GT(chars.size(), 20u);  // letters, spaces, punctuation
  EXPECT_LT(chars.size(), 60u);  // but a small alphabet a model can learn fast
}

TEST(ReadTextFile, MissingFileIsAClearError) {
  expect_error_containing([] { read_text_file("/nonexistent/dir/x.txt"); },
                          "cannot open '/nonexistent/dir/x.txt'");
}

TEST(ReadTextFile, EmptyFileIsAClearError) {
  const std::string path = write_temp("empty.txt", "");
  expect_error_containing([&] { read_text_file(path); }, "is empty");
}

TEST(ReadTextFile, DirectoryIsAClearError) {
  expect_error_containing([] { read_text_file("/tmp"); }, "'/tmp' is a directory");
}

TEST(LoadCorpus, SplitsFileInProportion) {
  const std::string path = write_temp("text.txt", std::string(1000, 'x'));
  const Corpus c = load_corpus(path, "90,10", 16);
  EXPECT_EQ(c.train.numel(), 900);
  EXPECT_EQ(c.valid.numel(), 100);
  EXPECT_EQ(c.source, path);
  const Corpus c3 = load_corpus(path, "969,30,1", 16);
  EXPECT_EQ(c3.train.numel(), 969);
  EXPECT_EQ(c3.valid.numel(), 30);
}

TEST(LoadCorpus, SequenceLongerThanCorpusIsAClearError) {
  const std::string path = write_temp("short.txt", "hello world, this is short");
  expect_error_containing([&] { load_corpus(path, "95,5", 64); },
                          "each needs at least seq_length + 1 = 65");
  // The validation share is checked too, not only the whole file.
  const std::string mid = write_temp("mid.txt", std::string(200, 'y'));
  expect_error_containing([&] { load_corpus(mid, "95,5", 64); }, "the validation part 10");
}

TEST(LoadCorpus, MalformedSplitIsAClearError) {
  const at::Tensor tokens = at::zeros({1000}, at::kLong);
  for (const char* bad : {"95", "a,b", "95,5,0,0", "-1,5", "95,0", "", "9x,5"}) {
    expect_error_containing([&] { split_corpus(tokens, bad, 8, "t"); }, "--split");
  }
}

TEST(BatchSampler, LabelsAreTokensShiftedByOne) {
  const at::Tensor stream = at::arange(500, at::kLong);
  BatchSampler sampler(stream, 32, 4, 7);
  const auto [tokens, labels] = sampler.next();
  ASSERT_EQ(tokens.sizes(), (at::IntArrayRef{4, 32}));
  EXPECT_TRUE(at::equal(labels, tokens + 1));
  // Windows are contiguous runs of the stream and stay inside it.
  EXPECT_TRUE(at::equal(tokens.select(1, 31) - tokens.select(1, 0), at::full({4}, 31, at::kLong)));
  EXPECT_LE(labels.max().item<int64_t>(), 499);
}

TEST(BatchSampler, IsAPureFunctionOfSeedAndIndexAndLeavesGlobalRngAlone) {
  const at::Tensor stream = at::arange(10000, at::kLong);
  BatchSampler a(stream, 64, 8, 1), b(stream, 64, 8, 1), c(stream, 64, 8, 2);
  const auto& gen = at::detail::getDefaultCPUGenerator();
  const at::Tensor before = gen.get_state();
  const auto a1 = a.next(), a2 = a.next();
  const auto b1 = b.next(), b2 = b.next();
  const auto c1 = c.next();
  EXPECT_TRUE(bitwise_equal(gen.get_state(), before));
  EXPECT_TRUE(at::equal(a1.first, b1.first));
  EXPECT_TRUE(at::equal(a2.first, b2.first));
  EXPECT_FALSE(at::equal(a1.first, a2.first));
  EXPECT_FALSE(at::equal(a1.first, c1.first));
  EXPECT_EQ(a.batches_drawn(), 2);
}

TEST(BatchSampler, ExactMinimumStreamWorks) {
  const at::Tensor stream = at::arange(9, at::kLong);  // exactly seq + 1
  BatchSampler sampler(stream, 8, 2, 3);
  const auto [tokens, labels] = sampler.next();
  EXPECT_TRUE(at::equal(tokens[0], at::arange(8, at::kLong)));
  EXPECT_TRUE(at::equal(labels[1], at::arange(1, 9, at::kLong)));
  expect_error_containing([] { BatchSampler(at::arange(8, at::kLong), 8, 2, 3); },
                          "shorter than seq_length + 1 = 9");
}

TEST(BatchSampler, FixedBatchesAreStableAndSpread) {
  const at::Tensor stream = at::arange(1000, at::kLong);
  BatchSampler sampler(stream, 10, 2, 0);
  const auto first = sampler.fixed(0, 4), again = sampler.fixed(0, 4), last = sampler.fixed(3, 4);
  EXPECT_TRUE(at::equal(first.first, again.first));
  EXPECT_EQ(first.first[0][0].item<int64_t>(), 0);
  EXPECT_GT(last.first[1][0].item<int64_t>(), 800);
  EXPECT_LE(last.second.max().item<int64_t>(), 999);
  expect_error_containing([&] { sampler.fixed(4, 4); }, "expected 0 <= i < count");
}

}  // namespace
}  // namespace actmem
