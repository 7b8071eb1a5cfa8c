// test_generate.cpp — the KV cache computes the model's logits, sampling does what its options
// say, and `actmem generate` continues a prompt from a saved checkpoint.
#include "actmem/model/model.h"
#include "actmem/train/checkpoint.h"
#include "actmem/train/generate.h"
#include "actmem/train/trainer.h"
#include "fixtures.h"
#include "test_util.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <set>

namespace actmem {
namespace {

using testing::expect_error_containing;
namespace fs = std::filesystem;

std::vector<int64_t> some_tokens(int64_t n, int64_t vocab, uint64_t seed) {
  std::vector<int64_t> t;
  for (int64_t i = 0; i < n; ++i) {
    seed = splitmix64(seed);
    t.push_back(static_cast<int64_t>(seed % static_cast<uint64_t>(vocab)));
  }
  return t;
}

struct Variant {
  const char* name;
  void (*apply)(TransformerConfig&);
};
const Variant kVariants[] = {
    {"gpt_fp32", [](TransformerConfig&) {}},
    {"llama_fp32",
     [](TransformerConfig& c) {
       c.normalization = "RMSNorm";
       c.gated_linear_unit = true;
       c.position_embedding_type = "rope";
       c.untie_embeddings_and_output_weights = true;
       c.add_bias_linear = false;
     }},
    {"gpt_bf16", [](TransformerConfig& c) { testing::set_precision(c, "bf16"); }},
    // Grouped-query attention: the cache keeps the 2 key/value groups, not the 4 heads.
    {"llama_gqa_fp32",
     [](TransformerConfig& c) {
       c.normalization = "RMSNorm";
       c.gated_linear_unit = true;
       c.position_embedding_type = "rope";
       c.num_query_groups = 2;
     }},
    // Qwen3-Next's attention: heads wider than h / a, q/k norms, the output gate, partial RoPE,
    // zero-centred RMSNorm (SelfAttention::project and apply_output_gate at each position).
    {"qwen3_next_attention_fp32",
     [](TransformerConfig& c) {
       c.normalization = "RMSNorm";
       c.gated_linear_unit = true;
       c.position_embedding_type = "rope";
       c.num_query_groups = 2;
       c.kv_channels_arg = 2 * c.hidden_size / c.num_attention_heads;
       c.qk_layernorm = true;
       c.attention_output_gate = true;
       c.rotary_percent = 0.5;
       c.layernorm_zero_centered_gamma = true;
     }},
    {"mla_yarn_fp32",
     [](TransformerConfig& c) {
       // DeepSeek-style attention: compressed queries, normed latents, YaRN with a factor > 1.
       c.multi_latent_attention = true;
       c.q_lora_rank = 12;
       c.kv_lora_rank = 8;
       c.qk_head_dim = 6;
       c.qk_pos_emb_head_dim = 4;
       c.v_head_dim = 5;
       c.qk_layernorm = true;
       c.normalization = "RMSNorm";
       c.rotary_scaling_factor = 4.0;
       c.mscale = 1.0;
       c.mscale_all_dim = 0.5;
     }},
};

class KVCacheTest : public ::testing::TestWithParam<size_t> {};

TEST_P(KVCacheTest, IncrementalLogitsEqualTheFullForward) {
  TransformerConfig c = testing::tiny_model();
  kVariants[GetParam()].apply(c);
  GPTModel model(c);
  model.eval();
  const auto tokens = some_tokens(24, c.vocab_size, 5);
  at::Tensor full;
  {
    at::NoGradGuard no_grad;
    full = model.logits(at::tensor(tokens, at::kLong).view({1, -1})).squeeze(1).to(at::kFloat);
  }
  // A prompt of 10, then one token at a time: 15 more feeds reading the cache.
  KVCache cache(model);
  std::vector<at::Tensor> rows;
  rows.push_back(cache.feed(std::vector<int64_t>(tokens.begin(), tokens.begin() + 10)));
  for (size_t i = 10; i < tokens.size(); ++i) rows.push_back(cache.feed({tokens[i]}));
  const at::Tensor incremental = at::cat(rows, 0);
  ASSERT_EQ(incremental.sizes(), full.sizes());
  EXPECT_EQ(cache.length(), 24);
  EXPECT_EQ(cache.bytes(), KVCache::bytes_for(model));  // the size `generate` reports
  if (c.grouped_query_attention()) {
    // [positions, groups, head dim] of keys and values per layer, 4-byte elements.
    EXPECT_EQ(cache.bytes(),
              c.num_layers * c.max_positions() * c.query_groups() * 2 * c.kv_channels() * 4);
  }
  // Different summation order (a row at a time vs the whole square): close, not bitwise.
  const double tol = c.bf16 ? 5e-2 : 1e-4;
  EXPECT_TRUE(at::allclose(incremental, full, tol, tol))
      << kVariants[GetParam()].name << ": max difference "
      << (incremental - full).abs().max().item<double>();
  // A cached continuation is not a fresh start: the same token at position 0 gives other logits.
  KVCache fresh(model);
  EXPECT_FALSE(at::allclose(fresh.feed({tokens.back()}), full[23].unsqueeze(0), tol, tol));
}

INSTANTIATE_TEST_SUITE_P(Models, KVCacheTest, ::testing::Range<size_t>(0, std::size(kVariants)),
                         [](const auto& info) { return std::string(kVariants[info.param].name); });

TEST(KVCache, RefusesMorePositionsThanTheModelHas) {
  TransformerConfig c = testing::tiny_model();  // 32 positions
  GPTModel model(c);
  KVCache cache(model);
  cache.feed(some_tokens(30, 256, 1));
  expect_error_containing([&] { cache.feed(some_tokens(3, 256, 2)); },
                          "33 positions exceed the model's max_position_embeddings 32");
  expect_error_containing([&] { cache.feed({300}); }, "token 300 outside the vocabulary");
}

TEST(KVCache, RefusesGatedDeltaNetLayers) {
  // A hybrid's GatedDeltaNet layers would carry a recurrent state, which the mixer part does not
  // implement for generation: the cache refuses the model when it is built.
  TransformerConfig c = testing::tiny_model();
  c.experimental_attention_variant = "gdn";
  c.linear_attention_freq = "2";
  c.gated_linear_unit = true;
  c.linear_num_key_heads = 2;
  c.linear_num_value_heads = 2;
  c.linear_key_head_dim = 8;
  c.linear_value_head_dim = 8;
  GPTModel model(c);
  expect_error_containing([&] { KVCache cache(model); },
                          "generation with GatedDeltaNet layers (their recurrent state instead "
                          "of a key/value cache) is not implemented");
}

TEST(Sampling, OptionsDoWhatTheySay) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const at::Tensor logits = at::tensor({0.1f, 2.0f, 1.5f, -1.0f, 1.9f});
  SamplingOptions greedy;
  greedy.greedy = true;
  EXPECT_EQ(sample_token(logits, greedy, gen), 1);
  SamplingOptions top1;
  top1.top_k = 1;
  SamplingOptions tiny_p;
  tiny_p.top_p = 1e-6;
  SamplingOptions top2;
  top2.top_k = 2;
  SamplingOptions nucleus;
  nucleus.top_p = 0.5;  // probabilities ~ .36 .33 .22 ...: the first two reach 0.5
  std::set<int64_t> seen_top2, seen_nucleus, seen_all;
  for (int i = 0; i < 300; ++i) {
    EXPECT_EQ(sample_token(logits, top1, gen), 1);
    EXPECT_EQ(sample_token(logits, tiny_p, gen), 1);
    seen_top2.insert(sample_token(logits, top2, gen));
    seen_nucleus.insert(sample_token(logits, nucleus, gen));
    seen_all.insert(sample_token(logits, SamplingOptions{}, gen));
  }
  EXPECT_EQ(seen_top2, (std::set<int64_t>{1, 4}));
  EXPECT_EQ(seen_nucleus, (std::set<int64_t>{1, 4}));
  EXPECT_EQ(seen_all.size(), 5u);
  // A vocabulary of 4 (the fifth logit a padding row's, the largest): never drawn.
  const at::Tensor padded = at::tensor({0.1f, 2.0f, 1.5f, -1.0f, 9.0f});
  SamplingOptions four;
  four.vocab_size = 4;
  SamplingOptions four_greedy = four;
  four_greedy.greedy = true;
  EXPECT_EQ(sample_token(padded, four_greedy, gen), 1);
  EXPECT_EQ(sample_token(padded, greedy, gen), 4);
  std::set<int64_t> seen_four;
  for (int i = 0; i < 300; ++i) seen_four.insert(sample_token(padded, four, gen));
  EXPECT_EQ(seen_four, (std::set<int64_t>{0, 1, 2, 3}));
  SamplingOptions bad;
  bad.temperature = 0.0;
  expect_error_containing([&] { sample_token(logits, bad, gen); },
                          "--temperature must be positive");
  // The same seed, the same text.
  GPTModel model(testing::tiny_model());
  SamplingOptions s;
  s.max_new_tokens = 12;
  const auto a = generate(model, {1, 2, 3}, s), b = generate(model, {1, 2, 3}, s);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.size(), 12u);
  s.seed = 99;
  EXPECT_NE(generate(model, {1, 2, 3}, s), a);
  s.stop_token = a[2];
  s.seed = 1234;
  EXPECT_EQ(generate(model, {1, 2, 3}, s).size(), 3u);  // stops after the stop token
}

TEST(GenerateCli, ContinuesAPromptFromASavedRunAndRefusesWhatItCannotLoad) {
  const std::string dir = testing::fresh_temp_dir("generate");
  auto r = testing::run_actmem(
      "train --num-layers 1 --hidden-size 64 --num-attention-heads 2 "
      "--seq-length 64 --micro-batch-size 8 --train-iters 150 "
      "--eval-interval 0 --save " +
      dir + "/ckpt");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = testing::run_actmem("generate --load " + dir +
                          "/ckpt --prompt 'The engineer ' "
                          "--max-new-tokens 40 --greedy --log-json " +
                          dir + "/gen.json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.rfind("The engineer ", 0), 0u) << r.output;  // the prompt, then more
  std::ifstream in(dir + "/gen.json");
  const auto j = nlohmann::json::parse(in);
  EXPECT_EQ(j["tokens"].size(), 40u);
  EXPECT_EQ(j["iteration"], 150);
  // 150 steps on the built-in corpus: the greedy text is made of the corpus's words and spaces.
  const std::string text = j["text"].get<std::string>();
  int letters = 0;
  for (const char ch : text) letters += std::isalpha(static_cast<unsigned char>(ch)) || ch == ' ';
  EXPECT_GT(letters, 30) << text;
  r = testing::run_actmem("generate --load " + dir + "/nothing --prompt x");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.stderr_text.find("has no latest_checkpointed_iteration.txt"), std::string::npos)
      << r.stderr_text;
  r = testing::run_actmem(
      "launch --nproc-per-node 2 -- train --num-layers 1 --hidden-size 64 "
      "--num-attention-heads 2 --seq-length 32 --micro-batch-size 2 "
      "--train-iters 1 --eval-interval 0 --tensor-model-parallel-size 2 "
      "--save " +
      dir + "/tp");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = testing::run_actmem("generate --load " + dir + "/tp --prompt x");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.stderr_text.find("tensor-parallel shards"), std::string::npos) << r.stderr_text;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace actmem
