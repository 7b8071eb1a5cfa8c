// test_robustness.cpp — hostile input and hostile machines: outputs never destroy inputs, every
// write is checked and whole, corpora load in bounded memory, divergence stops the run, silent
// no-ops are refused or warned about, outputs are opened before the work, repeated flags take
// their last value, and the JSON log starts with the run's configuration.
#include "actmem/base/compat.h"
#include "actmem/base/output_file.h"
#include "actmem/config/activation_plan.h"
#include "actmem/data/data.h"
#include "actmem/memory/memory_model.h"
#include "actmem/model/activation_bytes.h"
#include "actmem/train/step_rounds.h"
#include "actmem/train/trainer.h"
#include "fixtures.h"
#include "test_util.h"

#include <torch/version.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <set>
#include <sstream>

namespace actmem {
namespace {

using actmem::testing::bitwise_equal;
using actmem::testing::expect_error_containing;
using actmem::testing::read_json_log;
using actmem::testing::run_actmem;

// A small model every command here trains in well under a second per step.
const std::string kTinyRun =
    " --num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
    "--micro-batch-size 2 --threads 1 ";

std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + name;
}

std::string write_file(const std::string& name, const std::string& content) {
  const std::string path = temp_path(name);
  std::ofstream(path, std::ios::binary) << content;
  return path;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

bool contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

// ---- outputs never destroy inputs (Note [Outputs never destroy inputs]) -----------------------

TEST(OutputsAndInputs, AnOutputNamingTheCorpusIsRefusedAndTheCorpusSurvives) {
  const std::string text(4096, 'a');
  const std::string data = write_file("corpus_guard.txt", text);
  const std::string link = temp_path("corpus_guard_link.txt");
  std::remove(link.c_str());
  ASSERT_EQ(::symlink(data.c_str(), link.c_str()), 0);
  // The same file by its name, through a symlink, and spelled with a "./" in its directory.
  const std::string dir = data.substr(0, data.rfind('/') + 1);
  for (const std::string& out : {data, link, dir + "./corpus_guard.txt"}) {
    for (const char* flag : {"--log-json", "--trace"}) {
      const auto r = run_actmem("train" + kTinyRun + "--train-iters 2 --data " + data + " " + flag +
                                " " + out);
      EXPECT_NE(r.exit_code, 0) << flag << " " << out;
      EXPECT_TRUE(contains(r.stderr_text,
                           std::string(flag) + " '" + out + "' names the same file as --data"))
          << r.stderr_text;
      EXPECT_EQ(read_file(data), text) << "the corpus was changed through " << flag << " " << out;
    }
  }
  const auto c =
      run_actmem("compare" + kTinyRun + "--strategies plain --iters 1 --warmup 0 --data " + data +
                 " --svg " + link);
  EXPECT_NE(c.exit_code, 0);
  EXPECT_TRUE(contains(c.stderr_text, "names the same file as --data")) << c.stderr_text;
  EXPECT_EQ(read_file(data), text);
}

TEST(OutputsAndInputs, TwoOutputsNamingOneFileAreRefused) {
  const std::string out = temp_path("two_outputs.json");
  std::remove(out.c_str());  // a file that does not exist yet is compared by directory and name
  auto r = run_actmem("train" + kTinyRun + "--train-iters 2 --log-json " + out + " --trace " + out);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(contains(r.stderr_text, "--trace '" + out + "' names the same file as --log-json"))
      << r.stderr_text;
  r = run_actmem("compare" + kTinyRun + "--strategies plain --iters 1 --warmup 0 --svg " + out +
                 " --json " + out);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(contains(r.stderr_text, "--json '" + out + "' names the same file as --svg"))
      << r.stderr_text;
}

TEST(OutputsAndInputs, CheckComparesIdentityNotSpelling) {
  const std::string a = write_file("identity_a.txt", "a");
  const std::string b = write_file("identity_b.txt", "b");
  check_distinct_files({{"--data", a}}, {{"--log-json", b}, {"--trace", ""}, {"--svg", "-"}});
  const std::string hard = temp_path("identity_hard.txt");
  std::remove(hard.c_str());
  ASSERT_EQ(::link(a.c_str(), hard.c_str()), 0);
  expect_error_containing(
      [&] {
        check_distinct_files({{"--data", a}}, {{"--log-json", hard}});
      },
      "names the same file as --data");
  expect_error_containing(
      [&] {
        check_distinct_files({}, {{"--log-json", "-"}, {"--trace", "-"}});
      },
      "both write to standard output");
}

// ---- every write checked; whole records only (Note [Whole records or nothing]) --------------

TEST(WriteErrors, DevFullIsAnErrorForEveryOutput) {
  struct Case {
    std::string args, message;
  };
  const std::vector<Case> cases = {
      {"train" + kTinyRun + "--train-iters 2 --log-json /dev/full",
       "writing --log-json '/dev/full' failed at the config record: No space left on device"},
      {"train" + kTinyRun + "--train-iters 3 --trace /dev/full",
       "writing --trace '/dev/full' failed at the trace of iteration 2"},
      {"compare" + kTinyRun + "--strategies plain --iters 1 --warmup 0 --svg /dev/full",
       "writing --svg '/dev/full' failed"},
      {"compare" + kTinyRun + "--strategies plain --iters 1 --warmup 0 --svg '' --json /dev/full",
       "writing --json '/dev/full' failed"},
      {"inspect" + kTinyRun + "> /dev/full", "writing to standard output failed"},
      {"estimate > /dev/full", "writing to standard output failed"},
  };
  for (const auto& c : cases) {
    const auto r = run_actmem(c.args);
    EXPECT_EQ(r.exit_code, 1) << c.args << "\n" << r.output;
    EXPECT_TRUE(contains(r.stderr_text, c.message)) << c.args << "\n" << r.stderr_text;
  }
}

TEST(WriteErrors, AFullFileSystemLeavesOnlyWholeLinesAndNamesTheLastIteration) {
  // RLIMIT_FSIZE stands in for a full file system: the write that crosses the limit is cut short
  // (a partial line), the next fails with EFBIG. SIGXFSZ is ignored so the write returns.
  const std::string log = temp_path("full_fs.jsonl");
  std::remove(log.c_str());
  const std::string cmd = "sh -c 'trap \"\" XFSZ; ulimit -f 16; exec " +
                          std::string(ACTMEM_BINARY) + " train" + kTinyRun +
                          "--train-iters 40 --eval-interval 0 --log-json " + log + "' 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) output.append(buf, n);
  const int status = pclose(pipe);
  ASSERT_TRUE(WIFEXITED(status)) << output;
  EXPECT_EQ(WEXITSTATUS(status), 1) << output;
  const std::string text = read_file(log);
  ASSERT_FALSE(text.empty());
  EXPECT_LE(text.size(), 16u * 512u);
  EXPECT_EQ(text.back(), '\n') << "the log ends in a partial line";
  const auto parsed = read_json_log(log);  // every line parses
  ASSERT_FALSE(parsed.iterations.empty());
  const int last = parsed.iterations.back()["iteration"].get<int>();
  EXPECT_EQ(last, static_cast<int>(parsed.iterations.size()));
  EXPECT_LT(last, 40);
  EXPECT_TRUE(contains(output, "failed at iteration " + std::to_string(last + 1) +
                                   ": File too large; the file holds records up to iteration " +
                                   std::to_string(last)))
      << output;
}

TEST(WriteErrors, OutputFileCutsAPartialRecordBack) {
  // The same through the class: a record that does not fit is removed entirely.
  const std::string path = temp_path("cut_back.txt");
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    signal(SIGXFSZ, SIG_IGN);
    rlimit lim{100, 100};
    setrlimit(RLIMIT_FSIZE, &lim);
    OutputFile f({"--log-json", path});
    f.write(std::string(60, 'a') + "\n", "record 1");
    try {
      f.write(std::string(60, 'b') + "\n", "record 2");
      _exit(2);
    } catch (const c10::Error& e) {
      const std::string msg = e.msg();
      _exit(msg.find("at record 2") != std::string::npos &&
                    msg.find("holds records up to record 1") != std::string::npos
                ? 0
                : 3);
    }
  }
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_EQ(read_file(path), std::string(60, 'a') + "\n");
}

// ---- corpora in bounded memory (Note [Corpus in bounded memory]) ------------------------------

// Runs the actmem binary with `args` as its own child and returns its peak resident set (KiB)
// from wait4, and its exit code.
std::pair<long, int> peak_rss_kib(const std::string& args) {
  const pid_t pid = fork();
  if (pid == 0) {
    const int null = ::open("/dev/null", O_WRONLY);
    ::dup2(null, STDOUT_FILENO);
    ::dup2(null, STDERR_FILENO);
    const std::string cmd = "exec " + std::string(ACTMEM_BINARY) + " " + args;
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = 0;
  rusage usage{};
  wait4(pid, &status, 0, &usage);
  return {usage.ru_maxrss, WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status)};
}

TEST(Corpus, AGigabyteFileTrainsInBoundedMemory) {
  // A sparse 1 GiB file: memory-mapped, the run touches only the windows it samples. Read into
  // memory as int64 tokens (as before), it took 8 GiB and more.
  const std::string big = temp_path("sparse_corpus.bin");
  {
    const int fd = ::open(big.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::ftruncate(fd, int64_t{1} << 30), 0);
    ::close(fd);
  }
  const std::string run = "train" + kTinyRun + "--train-iters 3 --eval-interval 0";
  const auto [baseline, rc0] = peak_rss_kib(run);
  const auto [with_big, rc1] = peak_rss_kib(run + " --data " + big);
  std::remove(big.c_str());
  ASSERT_EQ(rc0, 0);
  ASSERT_EQ(rc1, 0);
  // The built-in corpus is 1 MiB; the mapped gigabyte may add the pages the batches touched.
  EXPECT_LT(with_big, baseline + 64 * 1024) << "peak RSS " << with_big << " KiB with a 1 GiB "
                                            << "corpus, " << baseline << " KiB without";
}

TEST(Corpus, LoadsMappedAndNarrow) {
  const std::string path = write_file("mapped.txt", std::string(3000, 'q'));
  const Corpus c = load_corpus(path, "90,10", 16);
  EXPECT_TRUE(c.memory_mapped);
  EXPECT_EQ(c.resident_bytes(), 0);
  EXPECT_EQ(c.train.scalar_type(), at::kByte);  // one byte per token, no int64 copy
  EXPECT_EQ(c.bytes, 3000);
  BatchSampler sampler(c.train, 16, 2, 1);
  const auto batch = sampler.next();
  EXPECT_EQ(batch.first.scalar_type(), at::kLong);
  EXPECT_TRUE(at::all(batch.first == 'q').item<bool>());
  // The built-in corpus is not counted as device memory.
  const int64_t before = device_memory(at::kCPU).current_bytes();
  const Corpus builtin = load_corpus("", "95,5", 16);
  EXPECT_EQ(device_memory(at::kCPU).current_bytes(), before);
  EXPECT_FALSE(builtin.memory_mapped);
  EXPECT_EQ(builtin.resident_bytes(), static_cast<int64_t>(kBuiltinCorpusBytes));
}

TEST(Corpus, EndlessOrSizelessFilesAreBounded) {
  const auto start = std::chrono::steady_clock::now();
  const auto r = run_actmem("train" + kTinyRun + "--data /dev/zero");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(contains(r.stderr_text,
                       "'/dev/zero' is not a regular file and goes on beyond 256 "
                       "MiB"))
      << r.stderr_text;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 60);
  // A pipe with an end is read whole.
  const std::string fifo = temp_path("corpus.fifo");
  std::remove(fifo.c_str());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  const auto f = run_actmem("train" + kTinyRun + "--train-iters 1 --eval-interval 0 --data " +
                            fifo + " & head -c 100000 /dev/urandom > " + fifo + "; wait $!");
  EXPECT_EQ(f.exit_code, 0) << f.output;
  // --split 969,30,1 (Megatron's default) of 100000 tokens.
  EXPECT_TRUE(contains(f.output, "corpus " + fifo + " (96900 train / 3000 validation tokens)"))
      << f.output;
  std::remove(fifo.c_str());
}

TEST(MemoryPreCheck, CountsEverythingTheRunAllocates) {
  // The estimate is an upper bound of the measured peak for every kind of model and strategy.
  std::vector<TransformerConfig> configs(6, actmem::testing::shaped_model(2, 64, 4, 0, 64, 2));
  configs[1].gated_linear_unit = true;
  configs[1].normalization = "RMSNorm";
  configs[2].untie_embeddings_and_output_weights = true;
  configs[2].position_embedding_type = "rope";
  configs[3].recompute_granularity = "full";
  configs[3].recompute_method = "uniform";
  configs[3].recompute_num_layers = 1;
  configs[4].recompute_granularity = "selective";
  configs[4].recompute_modules = std::vector<std::string>{"core_attn", "mlp", "layernorm"};
  configs[5].seq_length = 256;  // the s^2 terms dominate
  configs[5].num_attention_heads = 8;
  TrainingConfig t;
  t.eval_interval = 0;
  // The same models at bf16: 16-bit weights and activations, fp32 main parameters and grads,
  // the transient 16-bit gradients, the fp32 loss.
  for (size_t i = 0, n = configs.size(); i < n; ++i) {
    configs.push_back(configs[i]);
    actmem::testing::set_precision(configs.back(), "bf16");
  }
  for (size_t i = 0; i < configs.size(); ++i) {
    Trainer trainer(configs[i], t);
    int64_t peak = 0;
    for (int s = 0; s < 2; ++s) peak = std::max(peak, trainer.train_step(false).peak_device_bytes);
    EXPECT_GE(predict_step_peak_bound(configs[i]), static_cast<double>(peak)) << "config " << i;
  }
  // So a limit the pre-check accepts is never hit later by an allocation.
  const auto r = run_actmem("train --train-iters 2 --eval-interval 0 --device-memory-limit 0.003");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(contains(r.stderr_text, "but the limit is")) << r.stderr_text;
  EXPECT_FALSE(contains(r.stderr_text, "out of memory")) << r.stderr_text;
}

// ---- divergence stops the run -------------------------------------------------------------------

TEST(Divergence, ANonFiniteLossOrGradientNormStopsBeforeTheOptimizerStep) {
  const TransformerConfig m = actmem::testing::shaped_model(1, 32, 2, 0, 16, 2);
  TrainingConfig t;
  t.lr = 1e30;
  t.lr_warmup_iters = 0;
  t.clip_grad = 0.0;
  t.eval_interval = 0;
  Trainer trainer(m, t);
  int64_t it = 0;
  std::vector<at::Tensor> before;
  try {
    for (it = 1; it <= 10; ++it) {
      before.clear();
      for (const auto& p : trainer.model().ordered_parameters()) before.push_back(p.clone());
      trainer.train_step(false);
    }
    FAIL() << "lr 1e30 trained 10 steps without a non-finite loss or gradient norm";
  } catch (const c10::Error& e) {
    EXPECT_TRUE(contains(e.msg(), "training diverged at iteration " + std::to_string(it)))
        << e.msg();
  }
  EXPECT_GE(it, 2);
  // The failing step did not touch the parameters.
  const auto after = trainer.model().ordered_parameters();
  for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(bitwise_equal(after[i], before[i])) << i;

  const auto r = run_actmem("train" + kTinyRun + "--train-iters 20 --lr 1e30 --lr-warmup-iters 0");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(contains(r.stderr_text, "error: actmem::Trainer: training diverged at iteration "))
      << r.stderr_text;
  EXPECT_FALSE(contains(r.output, "done:")) << r.output;
}

// ---- silent no-ops ------------------------------------------------------------------------------

TEST(SilentNoOps, AnOffloadThatMovesNothingWarnsOnceNamingTheLargestTensor) {
  for (const char* offload : {"--fine-grained-activation-offloading --offload-modules core_attn",
                              "--cpu-offloading-num-layers 1"}) {
    const std::string run =
        "train --num-layers 2 --hidden-size 32 --num-attention-heads 2 "
        "--seq-length 16 --micro-batch-size 2 --threads 1 --train-iters 3 "
        "--eval-interval 0 " +
        std::string(offload);
    const auto r = run_actmem(run);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const std::string w =
        "warning: offload moved 0 bytes in its warmup step: every saved tensor "
        "is below --min-offloaded-tensor-size 1048576 elements; the largest";
    EXPECT_TRUE(contains(r.stderr_text, w)) << offload << "\n" << r.stderr_text;
    EXPECT_EQ(r.stderr_text.find(w), r.stderr_text.rfind(w)) << "warned more than once";
    const auto moved = run_actmem(run + " --min-offloaded-tensor-size 64");
    ASSERT_EQ(moved.exit_code, 0) << moved.output;
    EXPECT_FALSE(contains(moved.stderr_text, "warning: offload moved 0 bytes")) << moved.output;
  }
}

TEST(SilentNoOps, CommandsRefuseFlagsTheyWouldIgnore) {
  for (const std::string& flag :
       {"--log-json x.jsonl", "--trace x.json", "--recompute-granularity full",
        "--recompute-activations", "--fine-grained-activation-offloading", "--train-iters 5",
        "--eval-interval 3", "--tensor-model-parallel-size 2"}) {
    const auto r = run_actmem("compare" + kTinyRun + flag);
    EXPECT_NE(r.exit_code, 0) << "compare accepted " << flag;
    EXPECT_TRUE(contains(r.stderr_text, "following argument") ||
                contains(r.stderr_text, "was not expected"))
        << flag << ": " << r.stderr_text;
  }
  for (const std::string& flag :
       {"--log-json x.jsonl", "--trace x.json", "--lr 0.1", "--train-iters 5", "--eval-iters 2"}) {
    const auto r = run_actmem("inspect" + kTinyRun + flag);
    EXPECT_NE(r.exit_code, 0) << "inspect accepted " << flag;
  }
}

TEST(SilentNoOps, OffloadSettingsWithoutOffloadAreRefused) {
  // --offload-modules without the switch was refused; its three settings were accepted and
  // ignored when nothing offloads.
  for (const std::string& flag : {"--offload-bandwidth-gbps 20", "--min-offloaded-tensor-size 64",
                                  "--fine-grained-offloading-max-inflight-offloads 0"}) {
    const auto r = run_actmem("train" + kTinyRun + flag);
    EXPECT_NE(r.exit_code, 0) << flag;
    EXPECT_TRUE(contains(r.stderr_text, flag.substr(0, flag.find(' ')) +
                                            " applies to activation offloading, which is off"))
        << flag << ": " << r.stderr_text;
    // With an offload on, the same setting is taken.
    const auto ok = run_actmem("train" + kTinyRun + flag +
                               " --num-layers 2 "
                               "--cpu-offloading-num-layers 1 --train-iters 1 --eval-interval 0");
    EXPECT_EQ(ok.exit_code, 0) << flag << ": " << ok.stderr_text;
  }
}

TEST(HelpTexts, ModuleListsComeFromTheOneTable) {
  // Every recompute and offload module actmem implements is named in the help and in compare's
  // message (hand-kept lists once left mla_up_proj out); the expert-parallel help describes it.
  const auto help = run_actmem("train --help");
  ASSERT_EQ(help.exit_code, 0);
  const auto bad = run_actmem("compare --strategies selective-nonsense");
  EXPECT_NE(bad.exit_code, 0);
  for (const auto& [module, name] : kRecomputeModuleNames) {
    EXPECT_TRUE(contains(help.output, std::string(name))) << name;
    EXPECT_TRUE(contains(bad.stderr_text, std::string(name))) << name << ": " << bad.stderr_text;
  }
  EXPECT_TRUE(contains(help.output, "mla_up_proj"));
  for (const auto& [module, name] : kOffloadModuleNames) {
    EXPECT_TRUE(contains(help.output, std::string(name))) << name;
  }
  EXPECT_FALSE(contains(help.output, "only 1 is implemented")) << help.output;
}

struct BadValue {
  const char* name;
  std::string args;
  const char* message;
};
void PrintTo(const BadValue& c, std::ostream* os) {
  *os << c.name;
}

class BadValues : public ::testing::TestWithParam<BadValue> {};

TEST_P(BadValues, AreOneClearError) {
  const auto start = std::chrono::steady_clock::now();
  const auto r = run_actmem(GetParam().args);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_LT(r.exit_code, 128) << r.output;
  EXPECT_TRUE(contains(r.stderr_text, GetParam().message)) << r.stderr_text;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 30);
}

INSTANTIATE_TEST_SUITE_P(
    Refused, BadValues,
    ::testing::Values(
        BadValue{"NegativeSeed", "train --seed -1", "--seed: expected an integer in [1, "},
        BadValue{"ZeroSeed", "train --seed 0", "--seed: expected an integer in [1, "},
        BadValue{"HugeSeed", "train --seed 99999999999999999999",
                 "--seed: expected an integer in [1, "},
        BadValue{"TinyBandwidth", "train --offload-bandwidth-gbps 1e-12",
                 "offload_bandwidth_gbps must be 0 (uncapped) or in [0.01, 100000] GB/s"},
        BadValue{"VanishingBandwidth", "train --offload-bandwidth-gbps 1e-30",
                 "offload_bandwidth_gbps must be 0 (uncapped) or in [0.01, 100000] GB/s"},
        BadValue{"TooManyThreads", "train --threads 100000", "--threads 100000 exceeds the"},
        BadValue{"PlanGpuWithoutPreset", "plan --gpu a100", "--gpu applies with --preset"},
        BadValue{"PlanDataParallelWithoutPreset", "plan --data-parallel-size 4",
                 "--data-parallel-size applies with --preset"},
        BadValue{"PlanUnknownGpu", "plan --preset 7b --gpu v100", "--gpu: v100 not in"},
        BadValue{"PlanPresetWithRunFlags", "plan --preset 7b --profile-steps 3",
                 "--profile-steps not used"},
        BadValue{"PlanPresetUnevenPipeline", "plan --preset 7b --pipeline-model-parallel-size 3",
                 "pipeline"},
        BadValue{"BucketWithoutOverlap", "train --ddp-bucket-size 1000",
                 "--ddp-bucket-size applies with --overlap-grad-reduce"},
        BadValue{"ZeroBucket", "train --overlap-grad-reduce --ddp-bucket-size 0",
                 "--ddp-bucket-size: expected a positive number, got '0'"},
        BadValue{"InfiniteSplit", "train --split inf,1", "--split must be 2 or 3 non-negative"},
        BadValue{"NaNLearningRate", "train --lr nan", "--lr: expected a positive number"},
        BadValue{"FractionalLayers", "train --num-layers 2.5", "--num-layers: expected an integer"},
        BadValue{"NegativePort", "launch --master-port -5 -- dist-check",
                 "--master-port: expected an integer in [1, 65535], got '-5'"},
        BadValue{"PortTooLarge", "launch --master-port 70000 -- dist-check",
                 "--master-port: expected an integer in [1, 65535], got '70000'"},
        BadValue{"InfiniteSequence", "estimate --seq-length inf",
                 "--seq-length: expected a positive number, got 'inf'"},
        BadValue{"TensorParallelNotDividingHeads", "estimate --tensor-model-parallel-size 3",
                 "num_attention_heads (32) must be divisible by tensor_model_parallel_size (3)"}),
    [](const auto& info) { return std::string(info.param.name); });

// ---- late checks: outputs are opened before the first step ------------------------------------

TEST(LateChecks, AnUnwritableOutputFailsBeforeTheFirstStep) {
  const std::string bad = "/nonexistent/dir/out";
  auto r = run_actmem("train" + kTinyRun + "--train-iters 2 --trace " + bad + ".json");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(contains(r.stderr_text, "cannot write --trace '" + bad + ".json'")) << r.output;
  EXPECT_FALSE(contains(r.output, "iter ")) << "a step ran before the check:\n" << r.output;
  r = run_actmem("compare" + kTinyRun + "--strategies plain --iters 1 --warmup 0 --svg " + bad +
                 ".svg");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(contains(r.stderr_text, "cannot write --svg '" + bad + ".svg'")) << r.output;
  EXPECT_FALSE(contains(r.stderr_text, "compare: round")) << r.output;
}

TEST(LateChecks, LaunchReportsTheWorkerThatFailedFirstWithItsMessage) {
  // Rank 0 alone opens the trace and fails; rank 1 fails afterwards, when its peer is gone.
  const auto r = run_actmem("launch --nproc-per-node 2 -- train --tensor-model-parallel-size 2" +
                            kTinyRun + "--train-iters 2 --trace /nonexistent/dir/t.json");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(contains(r.stderr_text,
                       "actmem launch: worker 0 failed (exit code 1): actmem: "
                       "cannot write --trace '/nonexistent/dir/t.json'"))
      << r.stderr_text;
  EXPECT_FALSE(contains(r.stderr_text, "worker 1 failed")) << r.stderr_text;
}

// ---- --attention-backend: which kernel ran and why, the seed's 4.3 warning, refusals --------

TEST(AttentionBackend, TheHeaderSaysWhichKernelRanAndWhyAndFlashWarnsAboutCoreAttnRecompute) {
  const std::string run = "train" + kTinyRun + "--train-iters 1 --eval-interval 0 ";
  const std::string warning =
      "For fused attention, you have no need to set 'core_attn' to recompute";
  // Megatron's default attention dropout (0.1): auto stays on the unfused path, and says why.
  auto r = run_actmem(run + "--recompute-activations");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output,
                       "attention unfused (auto: unfused, because the flash kernel "
                       "cannot drop attention probabilities (attention_dropout 0.1))"))
      << r.output;
  EXPECT_FALSE(contains(r.output, warning)) << r.output;
  // Without attention dropout auto runs flash; core_attn recompute then draws Megatron's warning.
  const std::string log = temp_path("flash.jsonl");
  r = run_actmem(run + "--attention-dropout 0 --recompute-activations --log-json " + log);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "attention flash (auto: flash, since the attention dropout is 0)"))
      << r.output;
  EXPECT_TRUE(contains(r.stderr_text, warning)) << r.stderr_text;
  const auto parsed = read_json_log(log);
  EXPECT_EQ(parsed.config["model"]["attention_backend"], "auto");
  EXPECT_EQ(parsed.config["model"]["attention_kernel"], "flash");
  // Asked for by name: unfused (no warning), local (unfused), flash.
  r = run_actmem(run + "--attention-dropout 0 --recompute-activations --attention-backend unfused");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "attention unfused (requested)")) << r.output;
  EXPECT_FALSE(contains(r.output, warning)) << r.output;
  r = run_actmem(run + "--attention-backend local");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "attention unfused (requested (local")) << r.output;
  r = run_actmem(run + "--attention-dropout 0 --attention-backend flash");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "attention flash (requested)")) << r.output;
  // What cannot run is refused with the reason, before anything is built.
  r = run_actmem(run + "--attention-backend flash");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(contains(r.stderr_text,
                       "attention_backend flash: the flash kernel cannot drop "
                       "attention probabilities (attention_dropout 0.1)"))
      << r.stderr_text;
  // Megatron's fused (Transformer Engine's cuDNN attention) is the same attention: accepted with
  // the notice of Megatron flags without an effect here (docs/megatron-flags.md).
  r = run_actmem(run + "--attention-backend fused");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "--attention-backend fused: Transformer Engine's cuDNN kernel"))
      << r.output;
  r = run_actmem(run + "--attention-backend sdpa");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.stderr_text, "--attention-backend")) << r.stderr_text;
}

// ---- Megatron habits: last value wins, --log-json -, the config record -------------------------

TEST(MegatronHabits, ARepeatedFlagTakesItsLastValue) {
  const std::string log = temp_path("repeated.jsonl");
  const auto r = run_actmem(
      "train --num-layers 3 --hidden-size 32 --num-attention-heads 2 "
      "--seq-length 16 --micro-batch-size 2 --threads 1 --train-iters 1 "
      "--eval-interval 0 --num-layers 1 --recompute-granularity selective "
      "--recompute-modules core_attn --recompute-modules mlp layernorm "
      "--seed 5 --seed=7 --log-json " +
      log);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto parsed = read_json_log(log);
  EXPECT_EQ(parsed.config["model"]["num_layers"], 1);
  EXPECT_EQ(parsed.config["model"]["seed"], 7);
  EXPECT_EQ(parsed.config["model"]["recompute_modules"],
            nlohmann::json(std::vector<std::string>{"mlp", "layernorm"}));
  EXPECT_TRUE(contains(r.output, "actmem train: 1 layers")) << r.output;
  EXPECT_TRUE(contains(r.output, "recompute selective: mlp layernorm")) << r.output;
}

TEST(MegatronHabits, LogJsonDashWritesTheLogToStandardOutput) {
  const auto r = run_actmem("train" + kTinyRun + "--train-iters 2 --eval-interval 0 --log-json -");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Standard output holds the records only; people's lines went to stderr.
  std::istringstream out(r.output.substr(0, r.output.size() - r.stderr_text.size()));
  std::string line;
  std::vector<nlohmann::json> records;
  while (std::getline(out, line)) records.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(records.size(), 3u);
  EXPECT_EQ(records[0]["record"], "config");
  EXPECT_EQ(records[2]["iteration"], 2);
  EXPECT_TRUE(contains(r.stderr_text, "actmem train:")) << r.stderr_text;
  EXPECT_TRUE(contains(r.stderr_text, "done: loss")) << r.stderr_text;
}

TEST(MegatronHabits, TheFirstRecordIsTheResolvedConfiguration) {
  const std::string log = temp_path("config_record.jsonl");
  const auto r = run_actmem("train" + kTinyRun +
                            "--train-iters 1 --eval-interval 0 --swiglu "
                            "--fine-grained-activation-offloading --offload-modules core_attn "
                            "--min-offloaded-tensor-size 64 --lr 0.002 --log-json " +
                            log);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto parsed = read_json_log(log);
  const auto& c = parsed.config;
  EXPECT_EQ(c["command"], "train");
  EXPECT_EQ(c["model"]["hidden_size"], 32);
  // --swiglu without --ffn-hidden-size: Megatron's validate_args, int((4h x 2/3) / 64) x 64.
  EXPECT_EQ(c["model"]["ffn_hidden_size"], 64);
  EXPECT_EQ(c["model"]["max_position_embeddings"], 16);
  EXPECT_EQ(c["model"]["gated_linear_unit"], true);
  EXPECT_EQ(c["model"]["offload_modules"], nlohmann::json(std::vector<std::string>{"core_attn"}));
  EXPECT_EQ(c["model"]["min_offloaded_tensor_size"], 64);
  EXPECT_TRUE(c["model"]["recompute_granularity"].is_null());
  EXPECT_EQ(c["training"]["lr"], 0.002);
  EXPECT_EQ(c["training"]["train_iters"], 1);
  EXPECT_EQ(c["runtime"]["threads"], 1);
  EXPECT_EQ(c["runtime"]["device"], "cpu");
  // What produced the log: the libtorch this test was compiled against, whether the CUDA paths
  // are in, the GPUs the run saw, the BLAS and its threads; the header says the same.
  const std::string torch_version = std::to_string(TORCH_VERSION_MAJOR) + "." +
                                    std::to_string(TORCH_VERSION_MINOR) + "." +
                                    std::to_string(TORCH_VERSION_PATCH);
  EXPECT_EQ(c["runtime"]["libtorch"], torch_version);
  EXPECT_FALSE(c["runtime"]["actmem"].get<std::string>().empty());
#ifdef ACTMEM_WITH_CUDA
  EXPECT_EQ(c["runtime"]["cuda"], true);
  EXPECT_EQ(c["runtime"]["cuda_version"].get<std::string>().find("."), 2u) << c["runtime"];
  EXPECT_TRUE(contains(r.output, "| libtorch " + torch_version + " | CUDA ")) << r.output;
  EXPECT_EQ(c["runtime"]["gpus"], compat::cuda_device_count());
#else
  EXPECT_EQ(c["runtime"]["cuda"], false);
  EXPECT_TRUE(contains(r.output, "| libtorch " + torch_version + " | CPU-only build")) << r.output;
  EXPECT_EQ(c["runtime"]["gpus"], 0);
#endif
  EXPECT_FALSE(c["runtime"]["blas"]["library"].get<std::string>().empty());
  EXPECT_EQ(c["runtime"]["blas"]["threads"], 1);
  EXPECT_TRUE(contains(r.output, "BLAS: ")) << r.output;
  if (c["runtime"]["blas"]["mkl"].get<bool>()) {
    // The program set MKL's strict reproducibility before its first product (Note
    // [Reproducible products] in blas.h), and MKL reports it in force.
    EXPECT_EQ(c["runtime"]["blas"]["reproducibility"], "AUTO,STRICT") << c["runtime"]["blas"];
  }
  EXPECT_EQ(c["corpus"]["source"], "built-in");
  EXPECT_EQ(parsed.iterations.size(), 1u);
  EXPECT_TRUE(contains(r.output, "offload modules: core_attn, tensors of at least 64 elements"))
      << r.output;
}

// ---- compare's timing (Note [Honest step ratios]) -----------------------------------------------

TEST(CompareTiming, EveryRoundHasANewOrderAndNoTrainerAlwaysFollowsTheSameOne) {
  // Note [Step round order]: a rotation by one left every trainer behind the same predecessor.
  for (const size_t n : {size_t{2}, size_t{3}, size_t{5}, size_t{12}}) {
    const int rounds = 8;
    const auto orders = round_orders(n, rounds);
    ASSERT_EQ(orders.size(), static_cast<size_t>(rounds));
    EXPECT_EQ(orders, round_orders(n, rounds));  // the same in every run
    std::vector<size_t> identity(n);
    std::iota(identity.begin(), identity.end(), size_t{0});
    EXPECT_EQ(orders[0], identity);
    std::vector<std::set<size_t>> predecessors(n);
    std::set<size_t> firsts;
    for (const auto& order : orders) {
      std::vector<size_t> sorted = order;
      std::sort(sorted.begin(), sorted.end());
      EXPECT_EQ(sorted, identity) << "not a permutation";
      firsts.insert(order[0]);
      for (size_t k = 1; k < n; ++k) predecessors[order[k]].insert(order[k - 1]);
    }
    EXPECT_GT(firsts.size(), 1u) << n;  // no trainer always first
    for (size_t i = 0; n > 2 && i < n; ++i) {
      EXPECT_GT(predecessors[i].size(), 1u)
          << "trainer " << i << " of " << n << " always ran after the same one";
    }
  }
}

TEST(CompareTiming, WarmUpIsExcludedAndTooFewStepsAreWarnedAbout) {
  const std::string json = temp_path("compare_timing.json");
  auto r = run_actmem("compare" + kTinyRun +
                      "--strategies plain selective --warmup 2 --iters 5 "
                      "--svg '' --json " +
                      json);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto j = nlohmann::json::parse(read_file(json));
  EXPECT_EQ(j["warmup_steps"], 2);
  EXPECT_EQ(j["timed_steps"], 5);
  for (const auto& s : j["strategies"]) {
    EXPECT_EQ(s["step_times_s"].size(), 5u);
    EXPECT_LE(s["step_time_ratio_min"].get<double>(), s["step_time_ratio"].get<double>());
    EXPECT_GE(s["step_time_ratio_max"].get<double>(), s["step_time_ratio"].get<double>());
  }
  EXPECT_EQ(j["strategies"][0]["name"], "plain");
  EXPECT_EQ(j["strategies"][0]["step_time_ratio"], 1.0);  // each round against itself
  EXPECT_FALSE(contains(r.output, "too few to trust")) << r.output;
  r = run_actmem("compare" + kTinyRun + "--strategies plain --iters 2 --svg ''");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "warning: 2 timed step(s) per strategy are too few to trust"))
      << r.output;
}

}  // namespace
}  // namespace actmem
