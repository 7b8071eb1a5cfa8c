// test_checkpoint.cpp — checkpoints: bitwise resume (also with another recompute or offload
// strategy, at fp32, bf16 and fp16, and under tensor parallelism), the crash-safe save protocol,
// refusals of checkpoints that do not fit, the load options, the exit-signal handler, and
// Python's torch.load reading what libtorch wrote.
#include "actmem/base/digest.h"
#include "actmem/train/checkpoint.h"
#include "actmem/train/mixed_precision.h"
#include "actmem/train/trainer.h"
#include "fixtures.h"
#include "test_util.h"

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

namespace actmem {
namespace {

using testing::expect_error_containing;
namespace fs = std::filesystem;

struct Steps {
  std::vector<double> loss, lr, loss_scale;
  std::vector<std::string> digest;
};

Steps run_steps(Trainer& trainer, int n) {
  Steps s;
  for (int i = 0; i < n; ++i) {
    const IterationStats st = trainer.train_step();
    s.loss.push_back(st.loss);
    s.lr.push_back(st.lr);
    s.loss_scale.push_back(st.loss_scale);
    s.digest.push_back(st.grad_digest);
  }
  return s;
}

std::vector<at::Tensor> parameters_of(Trainer& t) {
  return t.model().ordered_parameters();
}

TrainingConfig resume_training() {
  TrainingConfig t = testing::tiny_training();
  t.train_iters = 6;
  t.lr_warmup_iters = 2;
  return t;
}

TransformerConfig resume_model(const std::string& precision, TrainingConfig& training) {
  TransformerConfig c = testing::offload_model();
  testing::set_precision(c, training, precision);
  return c;
}

// What the second half of a resumed run may change: how activations are kept.
const std::pair<const char*, void (*)(TransformerConfig&)> kResumeStrategies[] = {
    {"same", [](TransformerConfig&) {}},
    {"full_uniform",
     [](TransformerConfig& c) {
       c.recompute_granularity = "full";
       c.recompute_method = "uniform";
       c.recompute_num_layers = 2;
     }},
    {"selective_all",
     [](TransformerConfig& c) {
       c.recompute_granularity = "selective";
       c.recompute_modules = std::vector<std::string>{"core_attn", "mlp", "layernorm"};
     }},
    {"layer_offload", [](TransformerConfig& c) { c.cpu_offloading_num_layers = 2; }},
    {"fine_grained_offload",
     [](TransformerConfig& c) {
       c.fine_grained_activation_offloading = true;
       c.offload_modules = {"core_attn", "mlp_norm"};
     }},
};

class ResumeTest : public ::testing::TestWithParam<std::tuple<const char*, size_t>> {};

TEST_P(ResumeTest, SaveHalfwayLoadAndContinueIsBitwiseTheUninterruptedRun) {
  const std::string precision = std::get<0>(GetParam());
  const auto& [name, apply] = kResumeStrategies[std::get<1>(GetParam())];
  TrainingConfig training = resume_training();
  const TransformerConfig model = resume_model(precision, training);
  training.global_batch_size = 2 * model.micro_batch_size;  // accumulation across micro-batches

  Trainer whole(model, training);
  const Steps ref = run_steps(whole, 6);

  const std::string dir = testing::fresh_temp_dir("resume");
  {
    Trainer first(model, training);
    const Steps half = run_steps(first, 3);
    ASSERT_EQ(half.digest, std::vector<std::string>(ref.digest.begin(), ref.digest.begin() + 3));
    EXPECT_EQ(first.save_checkpoint(dir), checkpoint_iteration_dir(dir, 3));
  }
  TransformerConfig changed = model;
  apply(changed);
  Trainer second(changed, training);
  ASSERT_EQ(second.load_checkpoint(dir), 3);
  EXPECT_EQ(second.iteration(), 3);
  EXPECT_EQ(second.consumed_train_samples(), 3 * training.global_batch_size);
  const Steps rest = run_steps(second, 3);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(rest.loss[i], ref.loss[3 + i]) << name << " iteration " << 4 + i;
    EXPECT_EQ(rest.lr[i], ref.lr[3 + i]) << name << " iteration " << 4 + i;
    EXPECT_EQ(rest.loss_scale[i], ref.loss_scale[3 + i]) << name << " iteration " << 4 + i;
    EXPECT_EQ(rest.digest[i], ref.digest[3 + i]) << name << " iteration " << 4 + i;
  }
  EXPECT_EQ(digest_of(parameters_of(second)), digest_of(parameters_of(whole))) << name;
  if (whole.mixed_precision() != nullptr) {
    EXPECT_EQ(digest_of(second.mixed_precision()->main_params()),
              digest_of(whole.mixed_precision()->main_params()))
        << name;
  }
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Strategies, ResumeTest,
                         ::testing::Combine(::testing::ValuesIn(testing::kPrecisions),
                                            ::testing::Range<size_t>(0,
                                                                     std::size(kResumeStrategies))),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param)) + "_" +
                                  kResumeStrategies[std::get<1>(info.param)].first;
                         });

TEST(CheckpointFiles, LayoutIsMegatrons) {
  EXPECT_EQ(checkpoint_iteration_dir("/d", 100), "/d/iter_0000100");
  EXPECT_EQ(checkpoint_file("/d", 7, 3), "/d/iter_0000007/mp_rank_03/model_optim_rng.pt");
  const std::string dir = testing::fresh_temp_dir("layout");
  Trainer t(testing::tiny_model(), testing::tiny_training());
  run_steps(t, 2);
  t.save_checkpoint(dir);
  std::ifstream latest(dir + "/" + kLatestCheckpointFile);
  std::string text((std::istreambuf_iterator<char>(latest)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "2");  // Megatron writes the number without a newline
  const auto ckpt = read_checkpoint_file(checkpoint_file(dir, 2, 0));
  for (const char* key : {"args", "checkpoint_version", "iteration", "model", "optimizer",
                          "opt_param_scheduler", "rng_state"}) {
    EXPECT_TRUE(ckpt.contains(key)) << key;
  }
  EXPECT_EQ(ckpt.at("iteration").toInt(), 2);
  const auto model = ckpt.at("model").toGenericDict();
  EXPECT_TRUE(model.contains("decoder.layers.0.self_attention.linear_qkv.weight"));
  EXPECT_TRUE(model.contains("embedding.word_embeddings.weight"));
  EXPECT_FALSE(model.contains("output_layer.weight"));  // tied to the word embedding
  // The random streams of Megatron's tracker are all there.
  const auto rng = ckpt.at("rng_state").toListRef()[0].toGenericDict();
  const auto streams = rng.at("rng_tracker_states").toGenericDict();
  for (const char* s : {kModelParallelRng, kExpertParallelRng, kDataParallelRng}) {
    EXPECT_TRUE(streams.contains(s)) << s;
  }
  fs::remove_all(dir);
}

TEST(CheckpointFiles, SavingTheSameIterationAgainReplacesItWhole) {
  const std::string dir = testing::fresh_temp_dir("resave");
  Trainer a(testing::tiny_model(), testing::tiny_training());
  run_steps(a, 2);
  a.save_checkpoint(dir);
  // A run resumed from 2 that saves at 2 again (e.g. after changing nothing).
  Trainer b(testing::tiny_model(), testing::tiny_training());
  ASSERT_EQ(b.load_checkpoint(dir), 2);
  b.save_checkpoint(dir);
  EXPECT_FALSE(fs::exists(checkpoint_iteration_dir(dir, 2) + ".tmp"));
  EXPECT_FALSE(fs::exists(checkpoint_iteration_dir(dir, 2) + ".old"));
  Trainer c(testing::tiny_model(), testing::tiny_training());
  ASSERT_EQ(c.load_checkpoint(dir), 2);
  EXPECT_EQ(digest_of(parameters_of(c)), digest_of(parameters_of(a)));
  fs::remove_all(dir);
}

TEST(CheckpointFiles, AMissingLatestFileLoadsNothing) {
  const std::string dir = testing::fresh_temp_dir("empty");
  Trainer t(testing::tiny_model(), testing::tiny_training());
  const std::string before = digest_of(parameters_of(t));
  EXPECT_FALSE(t.load_checkpoint(dir).has_value());
  EXPECT_FALSE(t.load_checkpoint(dir + "/does-not-exist").has_value());
  EXPECT_EQ(digest_of(parameters_of(t)), before);
  EXPECT_EQ(t.iteration(), 0);
  fs::remove_all(dir);
}

// Saves a tiny model's checkpoint after 2 steps into a fresh directory.
std::string saved_tiny(const TransformerConfig& model, const TrainingConfig& training) {
  const std::string dir = testing::fresh_temp_dir("saved");
  Trainer t(model, training);
  run_steps(t, 2);
  t.save_checkpoint(dir);
  return dir;
}

TEST(CheckpointFiles, RefusesAnotherShapeOrPrecisionNamingTheField) {
  const TransformerConfig model = testing::tiny_model();
  const std::string dir = saved_tiny(model, testing::tiny_training());
  struct Case {
    const char* field;
    void (*change)(TransformerConfig&);
    const char* needle;
  };
  const Case cases[] = {
      {"hidden_size", [](TransformerConfig& c) { c.hidden_size = 32; },
       "hidden_size = 64 but this run has hidden_size = 32"},
      {"num_layers", [](TransformerConfig& c) { c.num_layers = 3; },
       "num_layers = 2 but this run has num_layers = 3"},
      {"ffn_hidden_size", [](TransformerConfig& c) { c.ffn_hidden_size = 128; },
       "ffn_hidden_size = 256"},
      {"precision", [](TransformerConfig& c) { testing::set_precision(c, "bf16"); },
       "precision = \"fp32\" but this run has precision = \"bf16\""},
      {"gated_linear_unit", [](TransformerConfig& c) { c.gated_linear_unit = true; },
       "gated_linear_unit = false"},
      {"max_position_embeddings", [](TransformerConfig& c) { c.max_position_embeddings = 64; },
       "max_position_embeddings = 32"},
  };
  for (const auto& k : cases) {
    TransformerConfig other = model;
    k.change(other);
    Trainer t(other, testing::tiny_training());
    expect_error_containing([&] { t.load_checkpoint(dir); }, k.needle);
  }
  fs::remove_all(dir);
}

TEST(CheckpointFiles, RefusesAChangedScheduleUnlessOverridden) {
  const TrainingConfig training = testing::tiny_training();
  const std::string dir = saved_tiny(testing::tiny_model(), training);
  TrainingConfig other = training;
  other.lr = 1e-3;
  {
    Trainer t(testing::tiny_model(), other);
    expect_error_containing([&] { t.load_checkpoint(dir); },
                            "OptimizerParamScheduler: class input value 0.001 and checkpoint value "
                            "0.003 for learning rate do not match");
  }
  other = training;
  other.train_iters = 80;
  {
    Trainer t(testing::tiny_model(), other);
    expect_error_containing([&] { t.load_checkpoint(dir); }, "for total number of iterations");
    CheckpointLoadOptions o;
    o.override_scheduler = true;
    EXPECT_EQ(t.load_checkpoint(dir, o), 2);
    // The run's own schedule from the checkpoint's step: iteration 3 of an 80-step cosine.
    const IterationStats st = t.train_step(false);
    Trainer fresh(testing::tiny_model(), other);
    run_steps(fresh, 2);
    EXPECT_EQ(st.lr, fresh.train_step(false).lr);
  }
  fs::remove_all(dir);
}

TEST(CheckpointFiles, LoadOptionsRestoreWhatTheySay) {
  const TransformerConfig model = testing::tiny_model();
  const TrainingConfig training = testing::tiny_training();
  const std::string dir = saved_tiny(model, training);
  Trainer saved(model, training);
  const Steps ref = run_steps(saved, 3);  // step 3 of the uninterrupted run
  {
    // --finetune: the weights only, from iteration 0 with a fresh optimizer and streams.
    CheckpointLoadOptions o;
    o.finetune = true;
    Trainer t(model, training);
    EXPECT_EQ(t.load_checkpoint(dir, o), 0);
    EXPECT_EQ(t.iteration(), 0);
    EXPECT_EQ(t.consumed_train_samples(), 0);
    const auto ckpt = read_checkpoint_file(checkpoint_file(dir, 2, 0));
    const at::Tensor w =
        ckpt.at("model").toGenericDict().at("embedding.word_embeddings.weight").toTensor();
    EXPECT_TRUE(testing::bitwise_equal(t.model().word_embeddings, w));
    const IterationStats st = t.train_step(false);
    EXPECT_EQ(st.iteration, 1);
    EXPECT_EQ(st.lr, ref.lr[0]);  // the schedule's first step
  }
  // One step after loading with `o`.
  auto resumed_step = [&](const CheckpointLoadOptions& o) {
    Trainer t(model, training);
    EXPECT_EQ(t.load_checkpoint(dir, o), 2);
    return run_steps(t, 1);
  };
  CheckpointLoadOptions no_rng;
  no_rng.rng = false;
  // --no-load-rng: everything but the random streams, so dropout differs from the resumed run.
  const Steps without_rng = resumed_step(no_rng);
  EXPECT_EQ(without_rng.lr[0], ref.lr[2]);
  EXPECT_NE(without_rng.loss[0], ref.loss[2]);
  // --no-load-optim: fresh moments and the schedule from its first step (as Megatron); same
  // weights, data and dropout, so the same forward.
  CheckpointLoadOptions no_optim;
  no_optim.optimizer = false;
  const Steps without_optim = resumed_step(no_optim);
  EXPECT_EQ(without_optim.lr[0], ref.lr[0]);
  EXPECT_EQ(without_optim.loss[0], ref.loss[2]);
  fs::remove_all(dir);
}

TEST(CheckpointFiles, DamagedFilesAreClearErrors) {
  const std::string dir = saved_tiny(testing::tiny_model(), testing::tiny_training());
  const std::string file = checkpoint_file(dir, 2, 0);
  Trainer t(testing::tiny_model(), testing::tiny_training());
  {
    std::ofstream(dir + "/" + kLatestCheckpointFile) << "twelve";
    expect_error_containing([&] { t.load_checkpoint(dir); },
                            "should hold an iteration number, found 'twelve'");
    std::ofstream(dir + "/" + kLatestCheckpointFile) << "9";
    expect_error_containing([&] { t.load_checkpoint(dir); }, "names iteration 9 but");
    std::ofstream(dir + "/" + kLatestCheckpointFile) << "2";
  }
  fs::resize_file(file, fs::file_size(file) / 2);
  expect_error_containing([&] { t.load_checkpoint(dir); }, "is not a readable torch pickle");
  std::ofstream(file, std::ios::trunc) << "not a checkpoint";
  expect_error_containing([&] { t.load_checkpoint(dir); }, "is not a readable torch pickle");
  fs::remove_all(dir);
}

// Copies checkpoint `from` to `to` record by record (the container intact), passing each record's
// name and bytes through `edit` first; returns whether `edit` said it changed something.
bool rewrite_records(const std::string& from, const std::string& to,
                     const std::function<bool(const std::string&, std::string&)>& edit) {
  caffe2::serialize::PyTorchStreamReader reader(from);
  caffe2::serialize::PyTorchStreamWriter writer(to);
  bool changed = false;
  for (const std::string& name : reader.getAllRecords()) {
    if (name.rfind(".data/", 0) == 0 || name == "version" || name == ".format_version") continue;
    auto [data, size] = reader.getRecord(name);
    std::string bytes(static_cast<const char*>(data.get()), size);
    changed |= edit(name, bytes);
    writer.writeRecord(name, bytes.data(), bytes.size());
  }
  writer.writeEndOfFile();
  return changed;
}

// A record cut short inside an intact container (the zip rewritten with data/0 three bytes
// long): Note [Tensor records cover their tensors] refuses it, where the tensor used to be built
// over the 3 bytes and read past them.
TEST(CheckpointFiles, ATruncatedTensorRecordIsRefused) {
  const std::string dir = saved_tiny(testing::tiny_model(), testing::tiny_training());
  const std::string file = checkpoint_file(dir, 2, 0);
  const std::string cut = dir + "/cut.pt";
  ASSERT_TRUE(rewrite_records(file, cut, [](const std::string& name, std::string& bytes) {
    if (name != "data/0") return false;
    EXPECT_GT(bytes.size(), 3u);
    bytes.resize(3);
    return true;
  }));
  expect_error_containing([&] { read_checkpoint_file(cut); },
                          "needs 65536 bytes but its record holds 3");
  fs::remove_all(dir);
}

// Note [Pickle lengths are checked before the unpickler reads them]: a string length in the
// pickle far beyond the file (found by fuzz/fuzz_checkpoint.cpp, whose input is kept in
// fuzz/corpus/checkpoint/regression-pickle-length) is refused before libtorch's unpickler
// reserves it.
TEST(CheckpointFiles, PickleLengthsAndMemoIndicesBeyondTheFileAreRefusedBeforeAnyAllocation) {
  const std::string dir = saved_tiny(testing::tiny_model(), testing::tiny_training());
  const std::string file = checkpoint_file(dir, 2, 0);
  const std::string bad = dir + "/bad.pt";
  ASSERT_TRUE(rewrite_records(file, bad, [](const std::string& name, std::string& bytes) {
    if (name != "data.pkl") return false;
    // The first BINUNICODE ('X', u32 length, text): a dict key such as "args".
    for (size_t i = 0; i + 5 < bytes.size(); ++i) {
      uint32_t n = 0;
      std::memcpy(&n, bytes.data() + i + 1, 4);
      if (bytes[i] != 'X' || n == 0 || n > 64 || i + 5 + n > bytes.size()) continue;
      const uint32_t huge = 0x50000000u;  // 1.25 GiB
      std::memcpy(bytes.data() + i + 1, &huge, 4);
      return true;
    }
    return false;
  }));
  expect_error_containing([&] { read_checkpoint_file(bad); },
                          "states a string of 1342177280 bytes");
  // A memo index beyond the entries so far (the unpickler would size its memo table by it: an
  // index of 2^32 - 1 asked for 22 GB, fuzz/corpus/checkpoint/regression-memo-index).
  const std::string memo = dir + "/memo.pt";
  ASSERT_TRUE(rewrite_records(file, memo, [](const std::string& name, std::string& bytes) {
    // The pickle's first memo entry: BINPUT 0 after the first key, "args".
    const size_t at = bytes.find(std::string("argsq\x00", 6));
    if (name != "data.pkl" || at == std::string::npos) return false;
    bytes[at + 5] = static_cast<char>(200);
    return true;
  }));
  expect_error_containing([&] { read_checkpoint_file(memo); },
                          "puts memo entry 200 after 0 entries");
  fs::remove_all(dir);
}

TEST(CheckpointFiles, ArgsRoundTripThroughPickledValues) {
  const nlohmann::json j = {{"a", 1},    {"b", 2.5},       {"c", "x"},         {"d", nullptr},
                            {"e", true}, {"f", {1, 2, 3}}, {"g", {{"h", "i"}}}};
  EXPECT_EQ(ivalue_to_json(json_to_ivalue(j)), j);
}

TEST(CheckpointFiles, ArgsOfTheWrongTypeAreClearErrors) {
  // Found by fuzz_checkpoint: a field of another JSON type escaped as nlohmann's type_error.
  for (const auto& [key, value] :
       std::vector<std::pair<std::string, nlohmann::json>>{{"num_moe_experts", "many"},
                                                           {"hidden_size", "big"},
                                                           {"kv_channels", {1, 2}},
                                                           {"q_lora_rank", "x"},
                                                           {"normalization", 3}}) {
    nlohmann::json args = {{"num_layers", 2}, {"multi_latent_attention", true}};
    args[key] = value;
    testing::expect_error_containing([&] { config_from_args(args); },
                                     "the checkpoint's args field " + key + " is ");
  }
}

// ---- through the command line: the crash-safe protocol, the signal handler, TP and Python ---

const char* kTinyFlags =
    " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16"
    " --micro-batch-size 2 --eval-interval 0 --lr-warmup-iters 1 --threads 1";

struct LoggedStep {
  double loss;
  std::string digest;
};
std::map<int64_t, LoggedStep> logged_steps(const std::string& log) {
  std::map<int64_t, LoggedStep> out;
  for (const auto& it : testing::read_json_log(log).iterations) {
    std::string digest = it["grad_digest"].get<std::string>();
    if (it.contains("grad_digest_per_rank")) digest = it["grad_digest_per_rank"].dump();
    out[it["iteration"].get<int64_t>()] = {it["loss"].get<double>(), digest};
  }
  return out;
}

std::string latest_of(const std::string& dir) {
  const auto it = read_latest_checkpointed_iteration(dir);
  return it ? std::to_string(*it) : "none";
}

TEST(CheckpointCrash, AKillAtAnyPointOfASaveLeavesThePreviousCheckpointLoadable) {
  const std::string ref_log = testing::fresh_temp_dir("crash_ref") + "/ref.jsonl";
  auto r = testing::run_actmem(std::string("train") + kTinyFlags + " --train-iters 4 --log-json " +
                               ref_log);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto ref = logged_steps(ref_log);
  for (const char* stage : {"mid-file", "before-publish", "before-latest"}) {
    const std::string dir = testing::fresh_temp_dir(std::string("crash_") + stage);
    r = testing::run_actmem(std::string("train") + kTinyFlags + " --train-iters 4 --save " + dir +
                            " --save-interval 2");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    // Kill the process inside the save of iteration 4 (a fresh directory each time).
    const std::string crashed = dir + "/crashed";
    const std::string cmd = std::string("ACTMEM_CHECKPOINT_FAULT=") + stage + "@4 " +
                            ACTMEM_BINARY + " train" + kTinyFlags + " --train-iters 4 --save " +
                            crashed + " --save-interval 2 >/dev/null 2>&1";
    const int status = std::system(cmd.c_str());
    ASSERT_TRUE(WIFEXITED(status) || WIFSIGNALED(status));
    EXPECT_NE(status, 0) << stage << ": the fault point was not reached";
    EXPECT_EQ(latest_of(crashed), "2") << stage;
    if (std::string(stage) == "mid-file") {
      const auto f = fs::path(crashed) / "iter_0000004.tmp" / "mp_rank_00" / "model_optim_rng.pt";
      ASSERT_TRUE(fs::exists(f)) << stage;
      EXPECT_LT(fs::file_size(f), fs::file_size(checkpoint_file(dir, 4, 0))) << "not cut short";
    }
    if (std::string(stage) == "before-latest") {
      EXPECT_TRUE(fs::exists(checkpoint_file(crashed, 4, 0)));  // complete, but not yet named
    }
    // The previous checkpoint loads and continues as the uninterrupted run.
    const std::string log = dir + "/resumed.jsonl";
    r = testing::run_actmem(std::string("train") + kTinyFlags + " --train-iters 4 --load " +
                            crashed + " --save " + crashed + " --log-json " + log);
    ASSERT_EQ(r.exit_code, 0) << stage << "\n" << r.output;
    EXPECT_NE(r.output.find("loaded " + crashed + "/iter_0000002"), std::string::npos) << r.output;
    const auto resumed = logged_steps(log);
    ASSERT_EQ(resumed.size(), 2u) << stage;
    for (const auto& [it, step] : resumed) {
      EXPECT_EQ(step.loss, ref.at(it).loss) << stage << " iteration " << it;
      EXPECT_EQ(step.digest, ref.at(it).digest) << stage << " iteration " << it;
    }
    // The save that followed replaced the leftovers.
    EXPECT_EQ(latest_of(crashed), "4");
    EXPECT_FALSE(fs::exists(fs::path(crashed) / "iter_0000004.tmp")) << stage;
    fs::remove_all(dir);
  }
}

TEST(CheckpointCli, FlagsThatNeedALoadOrASaveAreRefused) {
  for (const char* flag :
       {"--no-load-optim", "--no-load-rng", "--finetune", "--override-opt_param-scheduler"}) {
    const auto r =
        testing::run_actmem(std::string("train") + kTinyFlags + " --train-iters 1 " + flag);
    EXPECT_NE(r.exit_code, 0) << flag;
    EXPECT_NE(
        r.stderr_text.find(std::string(flag) + " applies to loading a checkpoint; give --load DIR"),
        std::string::npos)
        << r.stderr_text;
  }
  const auto r =
      testing::run_actmem(std::string("train") + kTinyFlags + " --train-iters 1 --save-interval 5");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.stderr_text.find("needs a directory to save in (--save DIR)"), std::string::npos)
      << r.stderr_text;
}

// Runs `actmem <command> --save DIR/ckpt --exit-signal-handler --log-json DIR/log.jsonl`, long
// enough that it is still training when SIGTERM comes (after three iteration records). Returns
// the wait status and fills `text` with its output.
int train_until_sigterm(const std::string& command, const std::string& dir, std::string& text) {
  const std::string log = dir + "/log.jsonl", out = dir + "/out.txt";
  const std::string cmd = std::string(ACTMEM_BINARY) + " " + command +
                          " --train-iters 1000000 --save " + dir +
                          "/ckpt --exit-signal-handler --log-json " + log + " >" + out +
                          " 2>&1 & pid=$!; "
                          "for i in $(seq 600); do [ -f " +
                          log + " ] && [ $(wc -l < " + log +
                          ") -ge 4 ] && break; "
                          "sleep 0.05; done; kill -TERM $pid; wait $pid";
  const int status = std::system(cmd.c_str());
  std::ifstream o(out);
  text.assign((std::istreambuf_iterator<char>(o)), std::istreambuf_iterator<char>());
  return status;
}

TEST(CheckpointCli, SigtermSavesAfterTheCurrentStepAndExits) {
  const std::string dir = testing::fresh_temp_dir("sigterm");
  std::string text;
  const int status = train_until_sigterm(std::string("train") + kTinyFlags, dir, text);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status << "\n" << text;
  const auto steps = logged_steps(dir + "/log.jsonl");
  ASSERT_GE(steps.size(), 3u);
  const int64_t last = steps.rbegin()->first;
  EXPECT_LT(last, 1000000);
  EXPECT_NE(text.find("exiting after iteration " + std::to_string(last) + " on signal 15"),
            std::string::npos)
      << text;
  EXPECT_EQ(latest_of(dir + "/ckpt"), std::to_string(last));
  fs::remove_all(dir);
}

TEST(CheckpointCli, SigtermToTheLauncherSavesEveryRankAndExitsZero) {
  const std::string dir = testing::fresh_temp_dir("sigterm_tp");
  std::string text;
  const int status = train_until_sigterm(std::string("launch --nproc-per-node 2 -- train") +
                                             kTinyFlags + " --tensor-model-parallel-size 2",
                                         dir, text);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status << "\n" << text;
  const int64_t last = logged_steps(dir + "/log.jsonl").rbegin()->first;
  EXPECT_EQ(latest_of(dir + "/ckpt"), std::to_string(last));
  EXPECT_TRUE(fs::exists(checkpoint_file(dir + "/ckpt", last, 0)));
  EXPECT_TRUE(fs::exists(checkpoint_file(dir + "/ckpt", last, 1)));
  fs::remove_all(dir);
}

TEST(CheckpointCli, TensorParallelResumeIsBitwiseAndAnotherSizeIsRefused) {
  const std::string dir = testing::fresh_temp_dir("tp_resume");
  const std::string tp =
      std::string(kTinyFlags) + " --tensor-model-parallel-size 2 --train-iters 4";
  const std::string launch = "launch --nproc-per-node 2 -- train";
  auto r = testing::run_actmem(launch + tp + " --log-json " + dir + "/ref.jsonl");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Halfway: save at 2, and die inside the save of 4 (latest stays at 2).
  const std::string cmd = "ACTMEM_CHECKPOINT_FAULT=before-latest@4 " + std::string(ACTMEM_BINARY) +
                          " " + launch + tp + " --save " + dir +
                          "/ckpt --save-interval 2 >/dev/null 2>&1";
  EXPECT_NE(std::system(cmd.c_str()), 0);
  ASSERT_EQ(latest_of(dir + "/ckpt"), "2");
  EXPECT_TRUE(fs::exists(checkpoint_file(dir + "/ckpt", 2, 1)));  // one file per rank
  // Continue with another strategy (full recompute): bitwise, every rank.
  r = testing::run_actmem(launch + tp + " --load " + dir +
                          "/ckpt --recompute-granularity full "
                          "--recompute-method uniform --recompute-num-layers 1 --log-json " +
                          dir + "/resumed.jsonl");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto ref = logged_steps(dir + "/ref.jsonl"), resumed = logged_steps(dir + "/resumed.jsonl");
  ASSERT_EQ(resumed.size(), 2u);
  for (const auto& [it, step] : resumed) {
    EXPECT_EQ(step.loss, ref.at(it).loss) << "iteration " << it;
    EXPECT_EQ(step.digest, ref.at(it).digest) << "iteration " << it;  // every rank's
  }
  // One process cannot load the two-rank checkpoint.
  r = testing::run_actmem(std::string("train") + kTinyFlags + " --train-iters 4 --load " + dir +
                          "/ckpt");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.stderr_text.find("tensor_model_parallel_size = 2 but this run has "
                               "tensor_model_parallel_size = 1"),
            std::string::npos)
      << r.stderr_text;
  fs::remove_all(dir);
}

// `launch` + `flags` for 4 iterations (the reference, logged to DIR/ref.jsonl); then a run that
// saves to DIR/ckpt at 2 and dies inside the save of 4 (latest stays at 2); then a resume from
// it, whose iterations 3 and 4 must equal the reference's bitwise (loss and gradient digest).
void expect_bitwise_resume(const std::string& launch, const std::string& flags,
                           const std::string& dir) {
  auto r =
      testing::run_actmem(launch + flags + " --train-iters 4 --log-json " + dir + "/ref.jsonl");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string cmd = "ACTMEM_CHECKPOINT_FAULT=before-latest@4 " + std::string(ACTMEM_BINARY) +
                          " " + launch + flags + " --train-iters 4 --save " + dir +
                          "/ckpt --save-interval 2 >/dev/null 2>&1";
  EXPECT_NE(std::system(cmd.c_str()), 0);
  ASSERT_EQ(latest_of(dir + "/ckpt"), "2");
  r = testing::run_actmem(launch + flags + " --train-iters 4 --load " + dir + "/ckpt --log-json " +
                          dir + "/resumed.jsonl");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto ref = logged_steps(dir + "/ref.jsonl"), resumed = logged_steps(dir + "/resumed.jsonl");
  ASSERT_EQ(resumed.size(), 2u);
  for (const auto& [it, step] : resumed) {
    EXPECT_EQ(step.loss, ref.at(it).loss) << "iteration " << it;
    EXPECT_EQ(step.digest, ref.at(it).digest) << "iteration " << it;
  }
}

TEST(CheckpointCli, DataParallelResumeIsBitwiseAndLoadsIntoOneProcess) {
  // Two data-parallel replicas (dropout on): the first writes, both resume from it, and the
  // resumed iterations equal the uninterrupted run's bitwise on both ranks. The checkpoint holds
  // no data-parallel size: one process continues from it too (Megatron allows changing d).
  const std::string dir = testing::fresh_temp_dir("dp_resume");
  const std::string flags = std::string(kTinyFlags) + " --global-batch-size 4";
  const std::string launch = "launch --nproc-per-node 2 -- train";
  expect_bitwise_resume(launch, flags, dir);
  if (::testing::Test::HasFatalFailure()) return;
  const auto r = testing::run_actmem(std::string("train") + flags + " --train-iters 4 --load " +
                                     dir + "/ckpt");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("continuing at iteration 3, 8 samples consumed"), std::string::npos)
      << r.output;
  fs::remove_all(dir);
}

TEST(CheckpointCli, ExpertParallelResumeIsBitwiseWithOneFilePerExpertRank) {
  // Two expert-parallel ranks (dropout and expert dropout on): each writes its experts to its own
  // file (Megatron's mp_rank_TT_EEE), both resume bitwise; loading into another expert-parallel
  // size names the mismatch, and generate (single-process inference) refuses clearly.
  const std::string dir = testing::fresh_temp_dir("ep_resume");
  const std::string flags = std::string(kTinyFlags) +
                            " --global-batch-size 4 --num-experts 4 --moe-router-topk 2 "
                            "--moe-grouped-gemm --moe-aux-loss-coeff 0.01 --moe-expert-dropout 0.1 "
                            "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall";
  const std::string launch = "launch --nproc-per-node 2 -- train";
  expect_bitwise_resume(launch, flags, dir);
  if (::testing::Test::HasFatalFailure()) return;
  EXPECT_TRUE(fs::exists(checkpoint_file(dir + "/ckpt", 2, 0, 0)));
  EXPECT_TRUE(fs::exists(checkpoint_file(dir + "/ckpt", 2, 0, 1)));
  EXPECT_FALSE(fs::exists(checkpoint_file(dir + "/ckpt", 2, 0)));
  std::string one = flags;
  one.replace(one.find("--expert-model-parallel-size 2"), 30, "--expert-model-parallel-size 1");
  auto r = testing::run_actmem(launch + one + " --train-iters 4 --load " + dir + "/ckpt");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("expert_model_parallel_size = 2 but this run has "
                          "expert_model_parallel_size = 1"),
            std::string::npos)
      << r.output;
  r = testing::run_actmem("generate --load " + dir + "/ckpt --prompt ab --max-new-tokens 2");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("was saved with expert parallelism"), std::string::npos) << r.output;
  fs::remove_all(dir);
}

TEST(CheckpointCli, TensorAndExpertParallelResumeIsBitwiseWithOneFilePerRankPair) {
  // Tensor parallelism 2 x expert parallelism 2 (four processes, sequence parallelism, dropout and
  // expert dropout): each (tensor rank, expert rank) pair writes its slices to its own file,
  // mp_rank_TT_EEE, and all four resume bitwise.
  const std::string dir = testing::fresh_temp_dir("tp_ep_resume");
  const std::string flags = std::string(kTinyFlags) +
                            " --global-batch-size 4 --num-experts 4 --moe-router-topk 2 "
                            "--moe-grouped-gemm --moe-aux-loss-coeff 0.01 --moe-expert-dropout 0.1 "
                            "--tensor-model-parallel-size 2 --sequence-parallel "
                            "--expert-model-parallel-size 2";
  expect_bitwise_resume("launch --nproc-per-node 4 -- train", flags, dir);
  if (::testing::Test::HasFatalFailure()) return;
  for (int tp = 0; tp < 2; ++tp) {
    for (int ep = 0; ep < 2; ++ep) {
      EXPECT_TRUE(fs::exists(checkpoint_file(dir + "/ckpt", 2, tp, ep))) << tp << " " << ep;
    }
  }
  fs::remove_all(dir);
}

TEST(CheckpointCli, PipelineAndExpertParallelResumeIsBitwiseWithOneFilePerStageAndExpertRank) {
  // MoE under pipeline 2 x expert parallelism 2 with the interleaved schedule (four processes:
  // data parallel 2 carved into the expert-parallel pair, two model chunks per stage, dropout and
  // expert dropout on): each (stage, expert rank) pair writes its file (Megatron's
  // mp_rank_TT_PPP_EEE, both chunks in it) and all four resume bitwise; generate names both splits.
  const std::string dir = testing::fresh_temp_dir("pp_ep_resume");
  const std::string flags = std::string(kTinyFlags) +
                            " --global-batch-size 16 --num-experts 4 --moe-router-topk 2 "
                            "--moe-grouped-gemm --moe-aux-loss-coeff 0.01 --moe-expert-dropout 0.1 "
                            "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
                            "--pipeline-model-parallel-size 2 --num-layers 4 "
                            "--num-layers-per-virtual-pipeline-stage 1";
  expect_bitwise_resume("launch --nproc-per-node 4 -- train", flags, dir);
  if (::testing::Test::HasFatalFailure()) return;
  for (int pp = 0; pp < 2; ++pp) {
    for (int ep = 0; ep < 2; ++ep) {
      EXPECT_TRUE(fs::exists(checkpoint_file(dir + "/ckpt", 2, 0, ep, pp))) << pp << " " << ep;
    }
  }
  const auto r =
      testing::run_actmem("generate --load " + dir + "/ckpt --prompt ab --max-new-tokens 2");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("was saved with pipeline and expert parallelism"), std::string::npos)
      << r.output;
  fs::remove_all(dir);
}

TEST(CheckpointCli, PipelineResumeIsBitwiseWithOneFilePerStage) {
  // Pipeline 2 x data 2 under 1F1B (four processes, four micro-batches, the tied embedding kept
  // over the embedding group, dropout on): each stage of the first replica writes its layers to its
  // own file (Megatron's mp_rank_TT_PPP), every rank resumes from its stage's file, and the resumed
  // iterations equal the uninterrupted run's bitwise. Another pipeline size names the mismatch;
  // generate (single-process inference) refuses clearly.
  const std::string dir = testing::fresh_temp_dir("pp_resume");
  const std::string flags = std::string(kTinyFlags) +
                            " --global-batch-size 16 "
                            "--pipeline-model-parallel-size 2";
  expect_bitwise_resume("launch --nproc-per-node 4 -- train", flags, dir);
  if (::testing::Test::HasFatalFailure()) return;
  EXPECT_TRUE(fs::exists(checkpoint_file(dir + "/ckpt", 2, 0, -1, 0)));
  EXPECT_TRUE(fs::exists(checkpoint_file(dir + "/ckpt", 2, 0, -1, 1)));
  EXPECT_FALSE(fs::exists(checkpoint_file(dir + "/ckpt", 2, 0)));
  std::string one = flags;
  one.replace(one.find("--pipeline-model-parallel-size 2"), 32, "--pipeline-model-parallel-size 1");
  auto r = testing::run_actmem("launch --nproc-per-node 2 -- train" + one +
                               " --train-iters 4 --load " + dir + "/ckpt");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("pipeline_model_parallel_size = 2 but this run has "
                          "pipeline_model_parallel_size = 1"),
            std::string::npos)
      << r.output;
  r = testing::run_actmem("generate --load " + dir + "/ckpt --prompt ab --max-new-tokens 2");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("was saved with pipeline parallelism"), std::string::npos) << r.output;
  fs::remove_all(dir);
  // The interleaved schedule's resume: CheckpointCli.PipelineAndExpertParallelResumeIsBitwise...
}

// Python's torch.load reads the file as a dict of Megatron-named tensors with the same values.
TEST(CheckpointPython, TorchLoadReadsTheModelUnderMegatronNames) {
  if (std::system((std::string(ACTMEM_PYTHON) + " -c 'import torch' >/dev/null 2>&1").c_str()) !=
      0) {
    GTEST_SKIP() << ACTMEM_PYTHON << " has no torch";
  }
  TransformerConfig model = testing::tiny_model();
  testing::set_precision(model, "bf16");
  model.untie_embeddings_and_output_weights = true;
  const std::string dir = testing::fresh_temp_dir("python");
  Trainer t(model, testing::tiny_training());
  run_steps(t, 1);
  t.save_checkpoint(dir);
  const std::string script = dir + "/read.py", listing = dir + "/listing.txt";
  std::ofstream(script)
      << "import sys, torch\n"
         "d = torch.load(sys.argv[1])\n"
         "assert isinstance(d, dict), type(d)\n"
         "print('keys', ' '.join(sorted(d.keys())))\n"
         "print('iteration', d['iteration'], d['checkpoint_version'])\n"
         "for name, t in d['model'].items():\n"
         "    print(name, str(t.dtype), ' '.join(map(str, t.shape)),\n"
         "          ' '.join(float(x).hex() for x in t.float().flatten().tolist()))\n"
         "d['python'] = {'float': 1.5, 'text': 'caf\\u00e9', 'tuple': (1, None)}\n"
         "torch.save(d, sys.argv[2])\n";
  const std::string resaved = dir + "/resaved.pt";
  const std::string cmd = std::string(ACTMEM_PYTHON) + " " + script + " " +
                          checkpoint_file(dir, 1, 0) + " " + resaved + " > " + listing + " 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << std::ifstream(listing).rdbuf();
  std::ifstream in(listing);
  std::string line;
  std::getline(in, line);
  EXPECT_EQ(line,
            "keys args checkpoint_version iteration model opt_param_scheduler optimizer rng_state");
  std::getline(in, line);
  EXPECT_EQ(line, "iteration 1 3.0");
  const auto params = t.model().named_parameters(true);
  size_t seen = 0;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string name, dtype;
    ls >> name >> dtype;
    const at::Tensor* p = params.find(name);
    ASSERT_NE(p, nullptr) << "Python sees a parameter the model does not have: " << name;
    EXPECT_EQ(dtype, "torch.bfloat16") << name;
    std::vector<int64_t> shape(static_cast<size_t>(p->dim()));
    for (auto& s : shape) ls >> s;
    EXPECT_EQ(at::IntArrayRef(shape), p->sizes()) << name;
    const at::Tensor values = p->detach().to(at::kFloat).flatten();
    std::string hex;
    for (int64_t i = 0; i < values.numel(); ++i) {
      ls >> hex;
      ASSERT_EQ(std::strtod(hex.c_str(), nullptr), values[i].item<float>())
          << name << "[" << i << "]";
    }
    ++seen;
  }
  EXPECT_EQ(seen, params.size());
  EXPECT_NE(params.find("output_layer.weight"), nullptr);
  // What Python's pickler writes (torch.save of the loaded dict with values of its own) passes
  // the opcode check (Note [Pickle lengths are checked before the unpickler reads them]).
  const c10::impl::GenericDict back = read_checkpoint_file(resaved);
  EXPECT_TRUE(back.contains(c10::IValue("model")));
  EXPECT_TRUE(back.contains(c10::IValue("python")));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace actmem
