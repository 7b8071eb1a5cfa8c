// test_megatron_flags.cpp — Megatron's training flags beyond the model and schedule: accepted
// without an effect (one notice lists them), refused with their reasons (a line each), Megatron's
// own rules on them, --no-position-embedding and --position-embedding-type none, --exit-interval
// and --exit-duration-in-mins, and torchrun's spellings of `actmem launch`
// (docs/megatron-flags.md).
#include "actmem/data/tokenizer.h"
#include "actmem/parallel/distributed.h"
#include "actmem/train/tensorboard.h"
#include "test_util.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <map>
#include <set>

#include <filesystem>
#include <fstream>
#include <string>

namespace actmem {
namespace {

using actmem::testing::run_actmem;

// A model every run here trains in well under a second per step.
const std::string kTiny =
    "train --num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
    "--micro-batch-size 2 --threads 1 --eval-interval 0 ";

TEST(MegatronFlags, FlagsWithoutAnEffectAreAcceptedWithOneNotice) {
  const auto r = run_actmem(kTiny +
                            "--train-iters 1 --use-mcore-models --no-masked-softmax-fusion "
                            "--no-rope-fusion --no-bias-swiglu-fusion --cross-entropy-loss-fusion "
                            "--manual-gc --num-workers 1 --empty-unused-memory-level 1 "
                            "--no-mmap-bin-files --ckpt-format torch_dist "
                            "--context-parallel-size 1 --attention-backend fused "
                            "--tiktoken-pattern v2 --rampup-batch-size 16 16 100");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("notice: 14 Megatron flags accepted with no effect here:"),
            std::string::npos)
      << r.output;
  for (const char* line :
       {"    --use-mcore-models: deprecated in Megatron and ignored there too",
        "    --no-masked-softmax-fusion: chooses whether a fused kernel computes the same function",
        "    --manual-gc: controls Python's garbage collector",
        "    --num-workers 1: sets the PyTorch DataLoader's worker processes",
        "    --ckpt-format torch_dist: asks for Megatron's distributed checkpoint",
        "    --context-parallel-size 1: is Megatron's default",
        "    --attention-backend fused: Transformer Engine's cuDNN kernel of the same attention",
        "    --rampup-batch-size 16 16 100: deprecated in Megatron and ignored there"}) {
    EXPECT_NE(r.output.find(line), std::string::npos) << line << "\n" << r.output;
  }
}

TEST(MegatronFlags, UnimplementedFlagsAreRefusedEachWithItsReason) {
  const auto r = run_actmem(kTiny +
                            "--train-iters 1 --fp8-param-gather --context-parallel-size 2 "
                            "--wandb-project p --ckpt-format torch_dcp");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  const std::string& e = r.stderr_text;
  EXPECT_NE(e.find("error: actmem train: 4 Megatron flags ask for what actmem does not "
                   "implement:\n"),
            std::string::npos)
      << e;
  for (const char* line :
       {"\n  --fp8-param-gather: keeps the GEMMs' weights as FP8 tensors",
        "\n  --context-parallel-size 2: context parallelism (each rank holding a slice of the "
        "sequence",
        "\n  --wandb-project p: Weights & Biases logs to a service over the network",
        "\n  --ckpt-format torch_dcp: needs --use-torch-fsdp2 in Megatron"}) {
    EXPECT_NE(e.find(line), std::string::npos) << line << "\n" << e;
  }
  EXPECT_EQ(e.find("not expected"), std::string::npos) << e;
}

TEST(MegatronFlags, MegatronsOwnRulesApplyToAcceptedFlags) {
  // arguments.py validate_args, the same messages.
  auto r = run_actmem(kTiny + "--train-iters 1 --overlap-param-gather");
  EXPECT_NE(r.stderr_text.find("--overlap-param-gather only supported with distributed optimizer"),
            std::string::npos)
      << r.output;
  r = run_actmem(kTiny + "--train-iters 1 --overlap-param-gather --use-distributed-optimizer");
  EXPECT_NE(r.stderr_text.find("Must use --overlap-param-gather with --overlap-grad-reduce"),
            std::string::npos)
      << r.output;
  r = run_actmem(kTiny + "--train-iters 1 --empty-unused-memory-level 3");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.stderr_text.find("--empty-unused-memory-level"), std::string::npos) << r.output;
  r = run_actmem(kTiny + "--train-iters 1 --no-position-embedding");
  EXPECT_NE(r.stderr_text.find("--no-position-embedding is deprecated, use "
                               "--position-embedding-type"),
            std::string::npos)
      << r.output;
  // With rope it changes nothing (Mixtral's script passes both).
  r = run_actmem(kTiny + "--train-iters 1 --position-embedding-type rope --no-position-embedding");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("RoPE"), std::string::npos) << r.output;
}

TEST(MegatronFlags, PositionEmbeddingTypeNoneHasNoPositionWeights) {
  // Megatron's none: no embedding of positions at all; the model has s x h fewer parameters
  // than with learned absolute positions (--max-position-embeddings defaults to seq 16).
  auto params = [](const std::string& type) {
    const auto r = run_actmem(kTiny + "--train-iters 1 --position-embedding-type " + type);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    const size_t at = r.output.find("parameters ");
    return at == std::string::npos ? -1 : std::stoll(r.output.substr(at + 11));
  };
  const long long learned = params("learned_absolute"), none = params("none");
  EXPECT_EQ(learned - none, 16 * 32);
}

TEST(MegatronFlags, ExitIntervalAndDurationSaveAndStop) {
  const std::string dir = actmem::testing::fresh_temp_dir("exit_flags");
  auto r = run_actmem(kTiny + "--train-iters 10 --exit-interval 3 --save " + dir + "/a");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("exiting program at iteration 3 (--exit-interval 3)"), std::string::npos)
      << r.output;
  std::ifstream latest(dir + "/a/latest_checkpointed_iteration.txt");
  std::string it;
  latest >> it;
  EXPECT_EQ(it, "3");
  // A limit already passed when the first step ends: one step, saved, exit 0.
  r = run_actmem(kTiny + "--train-iters 10 --exit-duration-in-mins 0 --save " + dir + "/b");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("exiting program after "), std::string::npos) << r.output;
  EXPECT_TRUE(std::filesystem::exists(dir + "/b/iter_0000001")) << r.output;
  EXPECT_FALSE(std::filesystem::exists(dir + "/b/iter_0000002")) << r.output;
}

TEST(MegatronFlags, LaunchTakesTorchrunsSpellingsAndPretrainGptPy) {
  // Megatron's example scripts: torchrun --nproc_per_node N --master_addr A --master_port P
  // pretrain_gpt.py FLAGS (no "--"); pretrain_gpt.py stands for train.
  const std::string port = std::to_string(free_loopback_port());
  auto r = run_actmem(
      "launch --nproc_per_node 2 --nnodes 1 --node_rank 0 --master_addr "
      "127.0.0.1 --master_port " +
      port + " pretrain_gpt.py " + kTiny.substr(6) +
      "--train-iters 1 --tensor-model-parallel-size 2");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("tensor parallel 2 ranks"), std::string::npos) << r.output;
  r = run_actmem("launch --help");
  EXPECT_NE(r.output.find("--nproc-per-node,--nproc_per_node"), std::string::npos) << r.output;
  r = run_actmem("launch --nproc_per_node 1 examples/other.py --train-iters 1");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.stderr_text.find("examples/other.py is a Python script"), std::string::npos)
      << r.output;
}

TEST(MegatronFlags, NullTokenizerAndMegatronsSentencePieceSpellings) {
  // Megatron's NullTokenizer (null_tokenizer.py): --vocab-size ids, the last one ends documents,
  // a text is its ids in decimal; the vocabulary padded as any tokenizer's (300 -> 384).
  const auto null = make_null_tokenizer(10);
  EXPECT_EQ(null->vocab_size(), 10);
  EXPECT_EQ(null->eod(), 9);
  EXPECT_EQ(null->tokenize("1 2 9"), (std::vector<int64_t>{1, 2, 9}));
  EXPECT_EQ(null->detokenize({3, 4}), "3 4");
  actmem::testing::expect_error_containing([&] { null->tokenize("1 10"); },
                                           "NullTokenizer reads ids written in decimal below 10");
  const std::string log = actmem::testing::fresh_temp_dir("null_tokenizer") + "/log.jsonl";
  auto r = run_actmem(kTiny +
                      "--train-iters 1 --tokenizer-type NullTokenizer --vocab-size 300 "
                      "--log-json " +
                      log);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(actmem::testing::read_json_log(log).config["model"]["vocab_size"], 384);
  r = run_actmem(kTiny + "--train-iters 1 --tokenizer-type NullTokenizer");
  EXPECT_NE(r.stderr_text.find("--tokenizer-type NullTokenizer needs --vocab-size"),
            std::string::npos)
      << r.output;
  // Llama2Tokenizer and GPTSentencePieceTokenizer are SentencePiece (build_tokenizer's
  // SP_TOKENIZERS).
  for (const char* type : {"Llama2Tokenizer", "GPTSentencePieceTokenizer"}) {
    actmem::testing::expect_error_containing(
        [&] { make_tokenizer(type, "/nonexistent.model"); },
        "cannot read the SentencePiece model /nonexistent.model");
  }
}

TEST(MegatronFlags, MockDataTrainsOnMegatronsGeneratedDocuments) {
  const std::string dir = actmem::testing::fresh_temp_dir("mock_data");
  auto r = run_actmem(kTiny +
                      "--train-iters 2 --mock-data --tokenizer-type NullTokenizer --vocab-size 300 "
                      "--eval-interval 1 --eval-iters 1 --data-cache-path " +
                      dir + " --log-json " + dir + "/log.jsonl");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("data --mock-data (Megatron's MockGPTDataset, NullTokenizer vocabulary "
                          "300, eod 299) (100000 documents"),
            std::string::npos)
      << r.output;
  const auto log = actmem::testing::read_json_log(dir + "/log.jsonl");
  EXPECT_EQ(log.config["corpus"]["documents"], 100000);
  EXPECT_EQ(log.config["corpus"]["memory_mapped"], false);
  EXPECT_EQ(log.config["training"]["mock_data"], true);
  // `generate` rebuilds the NullTokenizer from the checkpoint's args (its --vocab-size there).
  r = run_actmem(kTiny +
                 "--train-iters 1 --mock-data --tokenizer-type NullTokenizer "
                 "--vocab-size 300 --save " +
                 dir + "/ckpt");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_actmem("generate --load " + dir + "/ckpt --prompt '1 2 3' --max-new-tokens 2");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.rfind("1 2 3 ", 0), 0u) << r.output;
  std::filesystem::remove_all(dir + "/ckpt");
  // The indices are cached only where --data-cache-path says (Megatron's rule for a mock).
  int cached = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    cached +=
        e.path().filename().string().find("-GPTDataset-train-description.txt") != std::string::npos;
  }
  EXPECT_EQ(cached, 1);
  // Megatron's validate_args: one data source; a mock needs a tokenizer's vocabulary and eod.
  r = run_actmem(kTiny + "--train-iters 1 --mock-data --data " + dir + "/log.jsonl");
  EXPECT_NE(r.stderr_text.find("a single data source must be provided"), std::string::npos)
      << r.output;
  r = run_actmem(kTiny + "--train-iters 1 --mock-data");
  EXPECT_NE(r.stderr_text.find("--mock-data needs a tokenizer"), std::string::npos) << r.output;
  std::filesystem::remove_all(dir);
}

std::string hex(const std::string& bytes) {
  std::string out;
  char b[3];
  for (const unsigned char c : bytes) {
    std::snprintf(b, sizeof(b), "%02x", c);
    out += b;
  }
  return out;
}

TEST(TensorBoard, ScalarRecordIsTorchSummaryWritersBytes) {
  // torch.utils.tensorboard.SummaryWriter().add_scalar('lm loss', 2.5, 7, walltime=1700000002.0)
  // wrote this record (length, its masked CRC-32C, the Event, the Event's masked CRC-32C).
  EXPECT_EQ(hex(event_record(scalar_event("lm loss", 2.5, 7, 1700000002.0))),
            "1d00000000000000602fdf230900008040fc54d94110072a100a0e0a076c6d206c6f7373150000"
            "20407080d974");
  // CRC-32C's check value (RFC 3720): "123456789" -> 0xE3069283.
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
}

TEST(TensorBoard, EventFilesAreReadByTensorBoardsOwnReader) {
  // The scalars Megatron's training_log and evaluate_and_print_results write, under its tag
  // names, read back by TensorBoard's EventAccumulator (the Python package, no TensorFlow).
  const std::string dir = actmem::testing::fresh_temp_dir("tensorboard");
  const auto r = run_actmem(
      "train --num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
      "--micro-batch-size 2 --threads 1 --train-iters 4 --eval-interval 2 --eval-iters 1 "
      "--log-interval 2 --lr-warmup-iters 2 --tensorboard-dir " +
      dir + "/tb --log-json " + dir +
      "/log.jsonl --log-validation-ppl-to-tensorboard --log-timers-to-tensorboard "
      "--log-memory-to-tensorboard");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string script = dir + "/read.py";
  std::ofstream(script)
      << "import json, sys\n"
         "from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n"
         "ea = EventAccumulator(sys.argv[1], size_guidance={'scalars': 0})\n"
         "ea.Reload()\n"
         "print(json.dumps({t: [[e.step, e.value] for e in ea.Scalars(t)] "
         "for t in ea.Tags()['scalars']}))\n";
  const std::string cmd = std::string(ACTMEM_PYTHON) + " " + script + " " + dir + "/tb > " + dir +
                          "/scalars.json 2> " + dir + "/read.err";
  ASSERT_EQ(std::system(cmd.c_str()), 0)
      << "TensorBoard's reader failed (is tensorboard installed in " << ACTMEM_PYTHON
      << "? scripts/setup.sh installs it)";
  std::ifstream in(dir + "/scalars.json");
  const nlohmann::json tb = nlohmann::json::parse(in);
  std::set<std::string> tags;
  for (const auto& [tag, events] : tb.items()) tags.insert(tag);
  const std::set<std::string> expected = {"learning-rate",
                                          "learning-rate vs samples",
                                          "batch-size",
                                          "batch-size vs samples",
                                          "lm loss",
                                          "lm loss vs samples",
                                          "loss-scale",
                                          "loss-scale vs samples",
                                          "grad-norm",
                                          "grad-norm vs samples",
                                          "lm loss validation",
                                          "lm loss validation vs samples",
                                          "lm loss validation ppl",
                                          "lm loss validation ppl vs samples",
                                          "iteration-time",
                                          "mem-reserved-bytes",
                                          "mem-allocated-bytes",
                                          "mem-max-allocated-bytes",
                                          "mem-allocated-count"};
  EXPECT_EQ(tags, expected);
  const auto log = actmem::testing::read_json_log(dir + "/log.jsonl");
  ASSERT_EQ(log.iterations.size(), 4u);
  auto series = [&](const std::string& tag) {
    std::map<int64_t, float> m;
    for (const auto& e : tb.at(tag)) m[e[0].get<int64_t>()] = e[1].get<float>();
    return m;
  };
  const auto loss = series("lm loss"), loss_vs = series("lm loss vs samples"),
             lr = series("learning-rate"), val = series("lm loss validation"),
             ppl = series("lm loss validation ppl"), batch = series("batch-size");
  for (size_t i = 0; i < 4; ++i) {
    const auto& it = log.iterations[i];
    const int64_t k = it["iteration"].get<int64_t>();
    EXPECT_EQ(loss.at(k), static_cast<float>(it["loss"].get<double>())) << k;
    EXPECT_EQ(loss_vs.at(it["consumed_samples"].get<int64_t>()), loss.at(k)) << k;
    EXPECT_EQ(batch.at(k), 2.0f);
    // Megatron logs the rate its scheduler has stepped to: the next iteration's.
    if (i + 1 < 4) {
      EXPECT_EQ(lr.at(k), static_cast<float>(log.iterations[i + 1]["lr"].get<double>())) << k;
    }
    if (it.contains("val_loss")) {
      const double v = it["val_loss"].get<double>();
      EXPECT_EQ(val.at(k), static_cast<float>(v)) << k;
      EXPECT_EQ(ppl.at(k), static_cast<float>(std::exp(std::min(20.0, v)))) << k;
    }
  }
  EXPECT_EQ(val.size(), 2u);  // iterations 2 and 4
  EXPECT_EQ(series("iteration-time").size(), 2u);
  // --log-memory-to-tensorboard: every iteration, the tracking allocator's numbers, which hold
  // together as CUDA's do: the blocks held cover the bytes in use, the maximum never falls and
  // covers them, and tensors are alive.
  const auto reserved = series("mem-reserved-bytes"), allocated = series("mem-allocated-bytes"),
             max_allocated = series("mem-max-allocated-bytes"),
             count = series("mem-allocated-count");
  ASSERT_EQ(allocated.size(), 4u);
  float previous_max = 0.0f;
  for (const auto& [k, bytes] : allocated) {
    EXPECT_GT(bytes, 50000.0f) << k;  // at least the model's parameters
    EXPECT_GT(reserved.at(k), bytes) << k;
    EXPECT_GE(max_allocated.at(k), bytes) << k;
    EXPECT_GE(max_allocated.at(k), previous_max) << k;
    previous_max = max_allocated.at(k);
    EXPECT_GT(count.at(k), 10.0f) << k;
  }
}

}  // namespace
}  // namespace actmem
