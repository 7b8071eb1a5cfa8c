// Megatron-LM's own example scripts (d98e8a64dd), their flags as bash passes them to torchrun,
// each run through `actmem launch` with only the sizes scaled down: every script trains, or stops
// naming flags of class 3 (docs/megatron-flags.md) only; without those it trains, and the notice
// lists its class-2 flags.
#include "actmem/parallel/distributed.h"
#include "bpe_reference.h"
#include "hf_bpe.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

namespace actmem {
namespace {

using actmem::testing::run_actmem;

// One flag with its values, as the script passes it (values already quoted for the shell).
using Flag = std::vector<std::string>;

struct Script {
  std::string name;
  int nproc = 1;
  std::vector<Flag> flags;
  // The flags actmem refuses (class 3), each named in the refusal.
  std::set<std::string> refused;
  // Megatron flags accepted with the notice (class 2): how many the notice lists.
  int notices = 0;
};

std::string command(const Script& s, const std::set<std::string>& left_out) {
  std::string c = "launch --nproc_per_node " + std::to_string(s.nproc) +
                  " --nnodes 1 --node_rank 0 --master_addr 127.0.0.1 --master_port " +
                  std::to_string(free_loopback_port()) + " pretrain_gpt.py";
  for (const Flag& f : s.flags) {
    if (left_out.count(f[0])) continue;
    for (const auto& w : f) c += " " + w;
  }
  return c;
}

// Runs the script; while it stops, the flags its error names must be the script's class-3 ones:
// they are left out and it runs again (a later check may name another). It must then train, with
// the notice listing class 2.
testing::CommandResult expect_trains_or_refuses_class_three(Script s) {
  SCOPED_TRACE(s.name);
  std::set<std::string> named;
  testing::CommandResult r;
  for (int round = 0; round < 4; ++round) {
    r = run_actmem(command(s, named));
    if (r.exit_code == 0) break;
    const std::string& e = r.stderr_text;
    EXPECT_EQ(e.find("not expected"), std::string::npos) << e;
    std::set<std::string> now;
    for (const auto& f : s.refused) {
      if (!named.count(f) && e.find(f) != std::string::npos) now.insert(f);
    }
    EXPECT_FALSE(now.empty()) << "stopped naming none of its class-3 flags:\n" << e;
    if (now.empty()) return r;
    named.insert(now.begin(), now.end());
  }
  EXPECT_EQ(r.exit_code, 0) << command(s, named) << "\n" << r.output;
  if (r.exit_code != 0) return r;
  EXPECT_EQ(named, s.refused) << "class-3 flags that were not refused";
  EXPECT_NE(r.output.find("iter 2/2"), std::string::npos) << r.output;
  if (s.notices > 0) {
    EXPECT_NE(r.output.find("notice: " + std::to_string(s.notices) +
                            " Megatron flags accepted with no effect here:"),
              std::string::npos)
        << r.output;
  }
  return r;
}

class ExampleScripts : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = actmem::testing::fresh_temp_dir("example_scripts"); }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string dir_;
};

TEST_F(ExampleScripts, Gpt3_175bTrainsOnAGpt2BpeDatasetOrStopsWithClassThreeOnly) {
  // examples/gpt3/train_gpt3_175b_distributed.sh: GPT-2 BPE files and a dataset made with them
  // (`actmem preprocess`, as Megatron's tools/preprocess_data.py makes it); --fp16 included
  // (libtorch's Half kernels run on CPU), the schedule quoted as one word (the script passes it
  // unquoted, six words, which Megatron's own argparse refuses) and scaled to 2 samples, then 4
  // from 64 tokens (2 samples of 32). The script's --global-batch-size 1536 beside it stops
  // Megatron's validate_args, and actmem, with the same error (checked first); without it the
  // script trains across the change of batch size.
  actmem::testing::hugging_face_bpe(dir_, {"x"}, 400);
  const std::string bpe =
      " --vocab-file " + dir_ + "/vocab.json --merge-file " + dir_ + "/merges.txt";
  auto r = run_actmem("preprocess --builtin-corpus --tokenizer-type GPT2BPETokenizer" + bpe +
                      " --append-eod --output-prefix " + dir_ + "/gpt2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  Script s{"gpt3",
           2,
           {{"--num-layers", "4"},
            {"--hidden-size", "32"},
            {"--num-attention-heads", "4"},
            {"--seq-length", "32"},
            {"--max-position-embeddings", "32"},
            {"--attention-backend", "auto"},
            {"--micro-batch-size", "1"},
            {"--global-batch-size", "4"},
            {"--step-batch-size-schedule", "'0:2 64:4'"},
            {"--train-iters", "2"},
            {"--weight-decay", "0.1"},
            {"--adam-beta1", "0.9"},
            {"--adam-beta2", "0.95"},
            {"--init-method-std", "0.006"},
            {"--clip-grad", "1.0"},
            {"--fp16"},
            {"--lr", "6.0e-5"},
            {"--lr-decay-style", "cosine"},
            {"--min-lr", "6.0e-6"},
            {"--lr-warmup-fraction", ".001"},
            {"--lr-decay-iters", "2"},
            {"--tensor-model-parallel-size", "1"},
            {"--pipeline-model-parallel-size", "2"},
            {"--data-path", dir_ + "/gpt2_text_document"},
            {"--vocab-file", dir_ + "/vocab.json"},
            {"--merge-file", dir_ + "/merges.txt"},
            {"--split", "949,50,1"},
            {"--log-interval", "1"},
            {"--save-interval", "2"},
            {"--eval-interval", "2"},
            {"--save", dir_ + "/ckpt"},
            {"--load", dir_ + "/ckpt"},
            {"--eval-iters", "1"},
            {"--tensorboard-dir", dir_ + "/tb"}},
           {},
           0};
  const auto both = run_actmem(command(s, {}));
  EXPECT_NE(both.exit_code, 0);
  EXPECT_NE(both.stderr_text.find(
                "Cannot specify both --step-batch-size-schedule and --global-batch-size"),
            std::string::npos)
      << both.output;
  s.flags.erase(std::find_if(s.flags.begin(), s.flags.end(),
                             [](const Flag& f) { return f[0] == "--global-batch-size"; }));
  expect_trains_or_refuses_class_three(s);
  // Saved before the first step at 4 (Megatron's checkpoint when the micro-batches change), and
  // at the end.
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/ckpt/iter_0000001"));
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/ckpt/iter_0000002"));
}

TEST_F(ExampleScripts, Llama3_8bFp8TrainsOnMockDataOrStopsWithClassThreeOnly) {
  // examples/llama/train_llama3_8b_h100_fp8.sh, literal quotes of its --split '99,1,0' included.
  Script s{"llama3",
           2,
           {{"--use-mcore-models"},
            {"--num-layers", "2"},
            {"--hidden-size", "64"},
            {"--ffn-hidden-size", "160"},
            {"--num-attention-heads", "4"},
            {"--group-query-attention"},
            {"--num-query-groups", "2"},
            {"--kv-channels", "16"},
            {"--seq-length", "32"},
            {"--max-position-embeddings", "32"},
            {"--position-embedding-type", "rope"},
            {"--rotary-base", "1000000"},
            {"--rotary-percent", "1.0"},
            {"--attention-dropout", "0.0"},
            {"--hidden-dropout", "0.0"},
            {"--swiglu"},
            {"--normalization", "RMSNorm"},
            {"--init-method-std", "0.0134"},
            {"--attention-backend", "fused"},
            {"--apply-layernorm-1p"},
            {"--untie-embeddings-and-output-weights"},
            {"--disable-bias-linear"},
            {"--micro-batch-size", "1"},
            {"--global-batch-size", "4"},
            {"--train-samples", "8"},
            {"--lr-decay-samples", "6"},
            {"--lr-warmup-samples", "2"},
            {"--lr", "0.00015"},
            {"--min-lr", "0.00001"},
            {"--decoupled-lr", "5.0e-4"},
            {"--decoupled-min-lr", "4.5e-5"},
            {"--lr-decay-style", "cosine"},
            {"--clip-grad", "1.0"},
            {"--weight-decay", "0.1"},
            {"--adam-beta1", "0.9"},
            {"--adam-beta2", "0.95"},
            {"--bf16"},
            {"--grad-reduce-in-bf16"},
            {"--cross-entropy-loss-fusion"},
            {"--calculate-per-token-loss"},
            {"--manual-gc"},
            {"--empty-unused-memory-level", "1"},
            {"--exit-duration-in-mins", "235"},
            {"--use-distributed-optimizer"},
            {"--overlap-grad-reduce"},
            {"--overlap-param-gather"},
            {"--fp8-format", "hybrid"},
            {"--fp8-amax-history-len", "1024"},
            {"--fp8-amax-compute-algo", "max"},
            {"--fp8-param-gather"},
            {"--tensor-model-parallel-size", "1"},
            {"--context-parallel-size", "1"},
            {"--sequence-parallel"},
            {"--mock-data"},
            {"--tokenizer-type", "NullTokenizer"},
            {"--vocab-size", "1000"},
            {"--data-cache-path", dir_ + "/cache"},
            {"--tiktoken-pattern", "v2"},
            {"--split", "\"'99,1,0'\""},
            {"--no-create-attention-mask-in-dataloader"},
            {"--no-mmap-bin-files"},
            {"--num-workers", "1"},
            {"--log-interval", "1"},
            {"--eval-iters", "1"},
            {"--eval-interval", "100"},
            {"--save-interval", "1000"},
            {"--log-throughput"},
            {"--profile"},
            {"--profile-step-start", "4"},
            {"--profile-step-end", "6"},
            {"--ckpt-format", "torch_dist"},
            {"--distributed-timeout-minutes", "60"},
            {"--save", dir_ + "/ckpt"},
            {"--load", dir_ + "/ckpt"},
            {"--tensorboard-dir", dir_ + "/tb"}},
           {"--fp8-param-gather"},
           15};
  // Its FP8 flags train: hybrid E4M3/E5M2 with delayed scaling over a window of 1024 (amaxes
  // reduced over the two data-parallel ranks).
  const auto r = expect_trains_or_refuses_class_three(s);
  EXPECT_NE(r.output.find("FP8 GEMMs (hybrid, delayed scaling: history 1024, max, margin 0)"),
            std::string::npos)
      << r.output;
}

TEST_F(ExampleScripts, Mixtral8x7bTrainsOnASentencePieceDatasetOrStopsWithClassThreeOnly) {
  // examples/mixtral/train_mixtral_8x7b_distributed.sh: pipeline 2 x expert 2 over 4 ranks (the
  // script's 4 x 8 needs 32), a Llama2Tokenizer (SentencePiece) model and a dataset made with it
  // (the built-in corpus's 3777 documents: --split 90,8,2, as 99990,8,2 leaves validation none).
  // (`actmem preprocess --vocab-size` trains the SentencePiece model, then tokenizes.)
  auto r = run_actmem(
      "preprocess --builtin-corpus --tokenizer-type SentencePieceTokenizer "
      "--vocab-size 128 --append-eod --output-prefix " +
      dir_ + "/sp");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string model = dir_ + "/sp.model";
  Script s{"mixtral",
           4,
           {{"--use-mcore-models"},
            {"--disable-bias-linear"},
            {"--seq-length", "32"},
            {"--max-position-embeddings", "64"},
            {"--num-layers", "2"},
            {"--hidden-size", "32"},
            {"--ffn-hidden-size", "64"},
            {"--num-attention-heads", "4"},
            {"--init-method-std", "0.01"},
            {"--attention-dropout", "0.0"},
            {"--hidden-dropout", "0.0"},
            {"--normalization", "RMSNorm"},
            {"--position-embedding-type", "rope"},
            {"--swiglu"},
            {"--untie-embeddings-and-output-weights"},
            {"--group-query-attention"},
            {"--num-query-groups", "2"},
            {"--no-masked-softmax-fusion"},
            {"--no-position-embedding"},
            {"--rotary-base", "1000000"},
            {"--num-experts", "4"},
            {"--moe-router-topk", "2"},
            {"--moe-router-load-balancing-type", "aux_loss"},
            {"--moe-aux-loss-coeff", "1e-2"},
            {"--moe-grouped-gemm"},
            {"--moe-token-dispatcher-type", "alltoall"},
            {"--overlap-param-gather"},
            {"--overlap-grad-reduce"},
            {"--tokenizer-type", "Llama2Tokenizer"},
            {"--tokenizer-model", model},
            {"--data-path", dir_ + "/sp_text_document"},
            {"--split", "90,8,2"},
            {"--micro-batch-size", "1"},
            {"--global-batch-size", "4"},
            {"--lr", "1e-4"},
            {"--train-iters", "2"},
            {"--lr-decay-iters", "2"},
            {"--lr-decay-style", "cosine"},
            {"--min-lr", "1.0e-5"},
            {"--weight-decay", "0.1"},
            {"--lr-warmup-iters", "1"},
            {"--clip-grad", "1.0"},
            {"--bf16"},
            {"--tensor-model-parallel-size", "1"},
            {"--pipeline-model-parallel-size", "2"},
            {"--expert-model-parallel-size", "2"},
            {"--use-distributed-optimizer"},
            {"--sequence-parallel"},
            {"--log-interval", "1"},
            {"--save-interval", "10000"},
            {"--eval-interval", "1000"},
            {"--eval-iters", "1"},
            {"--save", dir_ + "/ckpt"},
            {"--load", dir_ + "/ckpt"},
            {"--tensorboard-dir", dir_ + "/ckpt/tensorboard"},
            {"--no-load-optim"},
            {"--no-load-rng"}},
           {},
           3};
  expect_trains_or_refuses_class_three(s);
}

// The post-training conf files hold a model's MODEL_ARGS only; the test adds what train.sh
// would (a learning rate, a length, data, --save for their --save-interval) with the mock dataset
// and a NullTokenizer in place of the Hugging Face tokenizer, which is refused (it needs the
// transformers library).
// A Hugging Face tokenizer in the shape the post-training file's model ships (bpe_reference.h),
// trained on the built-in corpus: DIR/NAME holds its tokenizer.json and tokenizer_config.json.
std::string hf_tokenizer(const std::string& dir, const std::string& name) {
  nlohmann::json spec = {
      {"name", name}, {"use_regex", false}, {"add_prefix_space", false}, {"vocab", 400}};
  if (name == "deepseek") {
    spec["splits"] = testing::kDeepSeekSplits;
    spec["specials"] = {"<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"};
    spec["bos"] = "<｜begin▁of▁sentence｜>";
    spec["eos"] = "<｜end▁of▁sentence｜>";
  } else {  // Qwen3's: NFC, its Split
    spec["splits"] = {testing::kQwen2};
    spec["nfc"] = true;
    spec["specials"] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
    spec["eos"] = "<|endoftext|>";
  }
  testing::train_reference_tokenizers(dir, nlohmann::json::array({spec}), {"x"},
                                      nlohmann::json::object());
  return dir + "/" + name;
}

std::vector<Flag> post_training_args(const std::string& dir) {
  return {{"--lr", "5.0e-5"},       {"--train-iters", "2"},  {"--global-batch-size", "2"},
          {"--mock-data"},          {"--log-interval", "1"}, {"--eval-interval", "0"},
          {"--save", dir + "/ckpt"}};
}

TEST_F(ExampleScripts, DeepSeekV2LiteModelArgsTrainOrStopWithClassThreeOnly) {
  // examples/post_training/modelopt/conf/deepseek-ai/DeepSeek-V2-Lite.sh's MODEL_ARGS.
  Script s{"dsv2",
           2,
           {{"--save-interval", "100000"},
            {"--attention-dropout", "0.0"},
            {"--hidden-dropout", "0.0"},
            {"--micro-batch-size", "1"},
            {"--bf16"},
            {"--no-masked-softmax-fusion"},
            {"--disable-bias-linear"},
            {"--untie-embeddings-and-output-weights"},
            {"--position-embedding-type", "rope"},
            {"--no-rope-fusion"},
            {"--normalization", "RMSNorm"},
            {"--norm-epsilon", "1e-6"},
            {"--swiglu"},
            {"--num-layers", "3"},
            {"--hidden-size", "32"},
            {"--ffn-hidden-size", "64"},
            {"--num-attention-heads", "4"},
            {"--kv-channels", "8"},
            {"--multi-latent-attention"},
            {"--kv-lora-rank", "16"},
            {"--v-head-dim", "8"},
            {"--qk-head-dim", "8"},
            {"--qk-layernorm"},
            {"--qk-pos-emb-head-dim", "4"},
            {"--num-experts", "4"},
            {"--moe-layer-freq", "'([0]+[1]*2)'"},
            {"--moe-ffn-hidden-size", "16"},
            {"--moe-grouped-gemm"},
            {"--moe-router-score-function", "softmax"},
            {"--moe-router-topk", "2"},
            {"--moe-router-topk-scaling-factor", "1.0"},
            {"--moe-router-pre-softmax"},
            {"--moe-shared-expert-intermediate-size", "32"},
            {"--moe-aux-loss-coeff", "1e-3"},
            {"--moe-token-dispatcher-type", "alltoall"},
            {"--moe-token-drop-policy", "probs"},
            {"--moe-router-load-balancing-type", "seq_aux_loss"},
            {"--seq-length", "32"},
            {"--max-position-embeddings", "32"},
            {"--tokenizer-type", "HuggingFaceTokenizer"},
            {"--tokenizer-model", hf_tokenizer(dir_, "deepseek")},
            {"--make-vocab-size-divisible-by", "3200"},
            {"--attention-softmax-in-fp32"},
            {"--use-mcore-models"},
            {"--rotary-percent", "1.0"},
            {"--rotary-base", "10000"},
            {"--rotary-scaling-factor", "40"},
            {"--mscale", "0.707"},
            {"--mscale-all-dim", "0.707"},
            {"--sequence-parallel"},
            {"--tensor-model-parallel-size", "2"}},
           {},
           3};
  for (auto f : post_training_args(dir_)) s.flags.push_back(f);
  // As written: the tokenizer is a local DeepSeek-shaped tokenizer.json, the load balancing
  // DeepSeek-V2's per-sequence loss, logged under Megatron's name.
  const auto r = run_actmem(command(s, {}));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("seq_load_balancing_loss"), std::string::npos) << r.output;
  expect_trains_or_refuses_class_three(s);
}

TEST_F(ExampleScripts, Qwen3_30bA3bModelArgsTrainOrStopWithClassThreeOnly) {
  // examples/post_training/modelopt/conf/Qwen/Qwen3-30B-A3B.sh's MODEL_ARGS.
  Script s{"qwen3",
           2,
           {{"--save-interval", "100000"},
            {"--micro-batch-size", "1"},
            {"--bf16"},
            {"--no-masked-softmax-fusion"},
            {"--disable-bias-linear"},
            {"--untie-embeddings-and-output-weights"},
            {"--position-embedding-type", "rope"},
            {"--no-rope-fusion"},
            {"--normalization", "RMSNorm"},
            {"--swiglu"},
            {"--num-layers", "2"},
            {"--hidden-size", "32"},
            {"--ffn-hidden-size", "64"},
            {"--num-attention-heads", "4"},
            {"--group-query-attention"},
            {"--num-query-groups", "2"},
            {"--kv-channels", "16"},
            {"--qk-layernorm"},
            {"--num-experts", "8"},
            {"--moe-ffn-hidden-size", "16"},
            {"--moe-router-topk", "4"},
            {"--moe-router-dtype", "fp32"},
            {"--moe-aux-loss-coeff", "1e-3"},
            {"--moe-token-dispatcher-type", "alltoall"},
            {"--moe-router-load-balancing-type", "aux_loss"},
            {"--seq-length", "32"},
            {"--max-position-embeddings", "64"},
            {"--tokenizer-type", "HuggingFaceTokenizer"},
            {"--tokenizer-model", hf_tokenizer(dir_, "qwen")},
            {"--make-vocab-size-divisible-by", "1187"},
            {"--use-mcore-models"},
            {"--rotary-percent", "1.0"},
            {"--rotary-base", "1000000"},
            {"--no-bias-swiglu-fusion"},
            {"--sequence-parallel"},
            {"--tensor-model-parallel-size", "2"}},
           {},
           4};
  for (auto f : post_training_args(dir_)) s.flags.push_back(f);
  expect_trains_or_refuses_class_three(s);
}

}  // namespace
}  // namespace actmem
