// test_trainer.cpp — the training loop: loss falls, runs are reproducible, measurements are
// consistent, JSON round-trips, and bad input from the command line is one clear line on stderr.
#include "actmem/base/digest.h"
#include "actmem/flags/train_options.h"
#include "actmem/train/trainer.h"
#include "fixtures.h"
#include "test_util.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <random>
#include <sstream>

namespace actmem {
namespace {

using actmem::testing::expect_error_containing;
using actmem::testing::run_actmem;
using actmem::testing::tiny_model;
using actmem::testing::tiny_training;

TEST(Trainer, LossFallsOnTheBuiltinCorpus) {
  Trainer trainer(tiny_model(), tiny_training());
  const double val_before = trainer.evaluate();
  std::vector<double> losses;
  for (int i = 0; i < 40; ++i) losses.push_back(trainer.train_step(false).loss);
  const double val_after = trainer.evaluate();
  EXPECT_NEAR(losses.front(), std::log(256.0), 0.3);  // starts near uniform over bytes
  const double tail = (losses[37] + losses[38] + losses[39]) / 3;
  EXPECT_LT(tail, losses.front() - 1.5)
      << "loss did not fall: " << losses.front() << " -> " << tail;
  EXPECT_LT(val_after, val_before - 1.5);
}

TEST(Trainer, RunsAreBitwiseReproducible) {
  TrainingConfig t = tiny_training();
  t.global_batch_size = 8;  // two micro-batches
  Trainer a(tiny_model(), t), b(tiny_model(), t);
  for (int i = 0; i < 3; ++i) {
    const auto sa = a.train_step(), sb = b.train_step();
    EXPECT_EQ(sa.loss, sb.loss);
    EXPECT_EQ(sa.grad_norm, sb.grad_norm);
    EXPECT_EQ(sa.grad_digest, sb.grad_digest);
    EXPECT_EQ(sa.grad_digest.size(), 32u);
  }
  // A different seed changes the run.
  TransformerConfig other = tiny_model();
  other.seed += 1;
  Trainer c(other, t);
  Trainer d(tiny_model(), t);
  EXPECT_NE(c.train_step().grad_digest, d.train_step().grad_digest);
}

// Note [Comparing different computations]
// Gradient accumulation over two micro-batches and one micro-batch of twice the size are
// different computations: the sums over tokens run in another order and OpenBLAS blocks its
// products differently for each shape (and differently again for each kernel family it picks on a
// given CPU). They agree up to fp32 rounding, not bitwise, and the check must hold for any kernel:
// - A sum of n terms computed in any order differs from the exact sum by at most (n - 1) u times
//   the sum of the terms' magnitudes (u = 2^-24; Higham, "Accuracy and Stability of Numerical
//   Algorithms", 2002, section 4.2). Every weight gradient here is a sum over b * s = 256 token
//   terms, so each gradient tensor is compared in norm with the bound 256 u of its own norm plus
//   the global gradient norm (the latter for tensors whose terms cancel to a small result).
//   Measured under the Prescott, Sandybridge, Haswell and SkylakeX kernels: at most 5.3e-8,
//   about u, so the bound holds with a margin of 300 and still fails for any real difference.
// - After AdamW steps parameters are no longer comparable element by element: Adam divides by
//   sqrt(v), so a gradient element that is rounding noise of one sign in one run and of the other
//   in the other moves its parameter by a full step in opposite directions. What holds for every
//   element is Adam's step bound: with bias correction, m_hat / sqrt(v_hat) is a weighted sum
//   of past gradients over the square root of a weighted sum of their squares, at most
//   c_t = sqrt(sum_i a_i^2 / b_i) by Cauchy-Schwarz (a_i, b_i the two weightings; c_t = 1 at
//   step 1, slightly above 1 later), plus AdamW's decay of lr * weight_decay * |p|. The loss,
//   whose gradient in those noisy directions is itself noise, stays equal to many more digits.
TEST(Trainer, GradientAccumulationMatchesOneLargeMicroBatch) {
  // Without dropout, two micro-batches of 4 accumulate to the same step as one micro-batch of 8
  // holding the same samples (sample k of step i is drawn from index i * gbs + k in both).
  TransformerConfig m4 = tiny_model(), m8 = tiny_model();
  m4.attention_dropout = m4.hidden_dropout = m8.attention_dropout = m8.hidden_dropout = 0.0;
  m4.micro_batch_size = 4;
  m8.micro_batch_size = 8;
  TrainingConfig t = tiny_training();
  t.global_batch_size = 8;
  t.clip_grad = 0.0;  // the gradients stay as the backward left them, for the comparison below
  Trainer acc(m4, t), big(m8, t);
  std::vector<at::Tensor> start;
  for (const auto& p : big.model().ordered_parameters()) start.push_back(p.detach().clone());
  const double n_terms = static_cast<double>(m8.micro_batch_size * m8.seq_length);
  const double u = std::ldexp(1.0, -24);
  // Adam's largest step per unit of lr at step t (Note [Comparing different computations]).
  auto adam_bound = [&](int step) {
    const double b1 = t.adam_beta1, b2 = t.adam_beta2;
    double sum = 0.0;
    for (int i = 1; i <= step; ++i) {
      const double a = (1 - b1) * std::pow(b1, step - i) / (1 - std::pow(b1, step));
      const double b = (1 - b2) * std::pow(b2, step - i) / (1 - std::pow(b2, step));
      sum += a * a / b;
    }
    return std::sqrt(sum);
  };
  std::vector<double> reach(start.size(), 0.0);  // bound on how far each tensor's elements moved
  for (int step = 1; step <= 3; ++step) {
    const auto a = acc.train_step(), b = big.train_step();
    EXPECT_NEAR(a.loss, b.loss, 1e-5 * std::abs(b.loss)) << "step " << step;
    for (size_t i = 0; i < start.size(); ++i) {
      const double p_max = start[i].abs().max().item<double>() + reach[i];
      reach[i] += b.lr * (adam_bound(step) + t.weight_decay * p_max);
    }
    if (step > 1) continue;
    // Step 1: both gradients were taken at the same parameters.
    EXPECT_NEAR(a.grad_norm, b.grad_norm, n_terms * u * b.grad_norm);
    const auto pa = acc.model().named_parameters(), pb = big.model().named_parameters();
    for (size_t i = 0; i < pa.size(); ++i) {
      const at::Tensor ga = pa[i].value().grad(), gb = pb[i].value().grad();
      EXPECT_LE((ga - gb).norm().item<double>(),
                n_terms * u * (gb.norm().item<double>() + b.grad_norm))
          << pa[i].key();
    }
  }
  const auto pa = acc.model().ordered_parameters(), pb = big.model().ordered_parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_LE((pa[i] - start[i]).abs().max().item<double>(), reach[i]) << "parameter " << i;
    EXPECT_LE((pb[i] - start[i]).abs().max().item<double>(), reach[i]) << "parameter " << i;
    EXPECT_LE((pa[i] - pb[i]).abs().max().item<double>(), 2 * reach[i]) << "parameter " << i;
  }
}

TEST(Trainer, MeasuresActivationsWithTheTracker) {
  Trainer trainer(tiny_model(), tiny_training());
  const auto st = trainer.train_step();
  const auto c = tiny_model();
  // The logits [s, b, v] in fp32 alone are held from forward to backward.
  const int64_t logits = c.seq_length * c.micro_batch_size * c.vocab_size * 4;
  EXPECT_GT(st.activation_bytes, logits);
  // The step releases what it held: the next step measures the same amount.
  const auto st2 = trainer.train_step();
  EXPECT_EQ(st2.activation_bytes, st.activation_bytes);
  // From step 2 on, the device holds parameters, gradients and both AdamW moments throughout,
  // and the step's peak sits on top of them.
  const int64_t state = 4 * 4 * trainer.model().num_parameters();
  EXPECT_GE(st2.peak_device_bytes, state + st2.activation_peak_bytes);
  EXPECT_LT(st2.peak_device_bytes, state + st2.activation_peak_bytes + (1 << 20));
}

TEST(Trainer, TimelineMarksEveryLayerForwardAndBackward) {
  Trainer trainer(tiny_model(), tiny_training());
  trainer.record_timeline(true);
  trainer.train_step(false);
  std::vector<std::string> labels;
  for (const auto& e : trainer.last_timeline().entries()) labels.push_back(e.label);
  const std::vector<std::string> want = {"fwd start",   "fwd embedding", "fwd layer 0",
                                         "fwd layer 1", "fwd loss",      "bwd head",
                                         "bwd layer 1", "bwd layer 0",   "bwd end"};
  ASSERT_EQ(labels, want);
  const auto& e = trainer.last_timeline().entries();
  EXPECT_GT(e[4].current_bytes, e[0].current_bytes);      // forward accumulates activations
  EXPECT_LT(e.back().current_bytes, e[4].current_bytes);  // backward releases them
}

TEST(Trainer, RefusesAModelThatCannotFit) {
  TransformerConfig m = tiny_model();
  m.hidden_size = 65536;
  m.num_attention_heads = 64;
  m.num_layers = 96;
  expect_error_containing([&] { Trainer t(m, tiny_training()); }, "of device memory");
  TrainingConfig t = tiny_training();
  t.device_memory_limit = 1 << 20;  // 1 MiB
  expect_error_containing([&] { Trainer tr(tiny_model(), t); }, "but the limit is 1.00 MiB");
}

TEST(IterationStats, JsonHasEveryFieldAndDoublesRoundTrip) {
  IterationStats st;
  st.iteration = 3;
  st.loss = 0.1 + 0.2;  // not representable in short decimal form
  st.grad_norm = 1.0 / 3.0;
  st.grad_digest = "00ff";
  st.step_time_s = 2.0 / 7.0;
  st.tokens_per_s = 12345.678901234567;
  st.peak_device_bytes = int64_t{1} << 40;
  st.activation_bytes = 7;
  st.activation_peak_bytes = 9;
  const std::string line = to_json(st).dump();
  const auto j = nlohmann::json::parse(line);
  for (const char* key : {"iteration", "loss", "grad_norm", "grad_digest", "lr", "step_time_s",
                          "tokens_per_s", "peak_device_bytes", "activation_bytes",
                          "activation_peak_bytes", "predicted_activation_bytes", "offloaded_bytes",
                          "host_peak_bytes", "offload_wait_s", "consumed_samples", "elapsed_s"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_EQ(j["loss"].get<double>(), st.loss);
  EXPECT_EQ(j["grad_norm"].get<double>(), st.grad_norm);
  EXPECT_EQ(j["step_time_s"].get<double>(), st.step_time_s);
  EXPECT_EQ(j["peak_device_bytes"].get<int64_t>(), st.peak_device_bytes);
  EXPECT_FALSE(j.contains("val_loss"));
}

TEST(Trainer, ConsumedSamplesCountEveryMicroBatch) {
  TrainingConfig t = tiny_training();
  t.global_batch_size = 3 * tiny_model().micro_batch_size;
  Trainer trainer(tiny_model(), t);
  EXPECT_EQ(trainer.train_step(false).consumed_samples, 3 * tiny_model().micro_batch_size);
  EXPECT_EQ(trainer.train_step(false).consumed_samples, 6 * tiny_model().micro_batch_size);
}

TEST(Report, DurationsForProgressLines) {
  EXPECT_EQ(format_duration(0.4), "0s");
  EXPECT_EQ(format_duration(42.5), "43s");
  EXPECT_EQ(format_duration(185), "3m05s");
  EXPECT_EQ(format_duration(2 * 3600 + 7 * 60 + 59), "2h07m");
  EXPECT_EQ(format_duration(-1), "?");
}

TEST(Report, QuantilesInterpolateBetweenOrderStatistics) {
  // Unsorted input; quantiles of 1..5 at q = k/4 are the order statistics, between them linear.
  const std::vector<double> v = {5, 1, 4, 2, 3};
  EXPECT_EQ(quantile(v, 0.0), 1.0);
  EXPECT_EQ(quantile(v, 0.25), 2.0);
  EXPECT_EQ(quantile(v, 1.0), 5.0);
  EXPECT_DOUBLE_EQ(quantile(v, 0.1), 1.4);
  EXPECT_EQ(median(v), 3.0);
  EXPECT_EQ(median({4, 1, 2, 3}), 2.5);  // even count: the mean of the middle two
  EXPECT_EQ(quantile({7}, 0.75), 7.0);
  EXPECT_THROW(median({}), c10::Error);
  EXPECT_THROW(quantile(v, 1.5), c10::Error);
}

// Note [Rounds until sure] in planner.cpp: the median's standard error from the interquartile
// range. Checked against the spread of the medians themselves: 4000 samples of 25 normal draws
// (a fixed seed), the estimate's mean within 10% of the medians' standard deviation.
TEST(Report, MedianStandardErrorMatchesTheSpreadOfMedians) {
  std::mt19937_64 rng(7);
  std::normal_distribution<double> draw(1.0, 0.05);
  std::vector<double> medians, estimates;
  for (int sample = 0; sample < 4000; ++sample) {
    std::vector<double> v(25);
    for (double& x : v) x = draw(rng);
    medians.push_back(median(v));
    estimates.push_back(median_standard_error(v));
  }
  double mean = 0, variance = 0, estimate = 0;
  for (const double m : medians) mean += m / medians.size();
  for (const double m : medians) variance += (m - mean) * (m - mean) / (medians.size() - 1);
  for (const double e : estimates) estimate += e / estimates.size();
  EXPECT_NEAR(estimate, std::sqrt(variance), 0.1 * std::sqrt(variance));
  // Four times the rounds, half the error.
  EXPECT_NEAR(median_standard_error({1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5}),
              median_standard_error({1, 2, 3, 4, 5}) / 2, 0.1);
  EXPECT_TRUE(std::isinf(median_standard_error({1.0, 2.0})));  // too few to judge a spread by
}

TEST(Digest, DetectsOneBitAndBoundaries) {
  at::Tensor a = at::arange(1000, at::kFloat);
  Digest d1, d2;
  d1.update(a);
  d2.update(a.clone());
  EXPECT_EQ(d1.hex(), d2.hex());
  at::Tensor b = a.clone();
  reinterpret_cast<uint32_t*>(b.data_ptr())[517] ^= 1u;  // flip the lowest bit of one float
  Digest d3;
  d3.update(b);
  EXPECT_NE(d1.hex(), d3.hex());
  Digest split1, split2;  // same bytes, different tensor boundaries
  split1.update(a.slice(0, 0, 500));
  split1.update(a.slice(0, 500));
  split2.update(a.slice(0, 0, 499));
  split2.update(a.slice(0, 499));
  EXPECT_NE(split1.hex(), split2.hex());
  Digest undefined;
  undefined.update(at::Tensor());
  EXPECT_NE(undefined.hex(), Digest().hex());
}

// ---- the command line -------------------------------------------------------------------------

TEST(Cli, RecomputeFlagsMapOntoTheConfig) {
  auto parse = [](std::vector<std::string> args) {
    CLI::App app;
    TrainOptions o;
    add_model_flags(app, o);
    add_training_flags(app, o);
    std::reverse(args.begin(), args.end());  // CLI11 parses a reversed vector
    app.parse(args);
    o.finalize();
    return o.model;
  };
  auto m = parse({"--recompute-activations"});
  EXPECT_EQ(m.recompute_granularity, "selective");
  EXPECT_TRUE(make_activation_plan(m).recomputes(RecomputeModule::kCoreAttn));
  m = parse({"--recompute-granularity", "selective", "--recompute-modules", "mlp", "layernorm"});
  ASSERT_TRUE(m.recompute_modules.has_value());
  EXPECT_EQ(*m.recompute_modules, (std::vector<std::string>{"mlp", "layernorm"}));
  m = parse({"--recompute-granularity", "full", "--recompute-method", "block",
             "--recompute-num-layers", "2"});
  EXPECT_TRUE(make_activation_plan(m).full_recompute());
  EXPECT_EQ(m.recompute_method, "block");
  EXPECT_EQ(m.recompute_num_layers.value_or(-1), 2);
}

TEST(Cli, TrainWritesOneJsonLinePerIteration) {
  const std::string log = ::testing::TempDir() + "train_log.jsonl";
  const auto r = run_actmem(
      "train --num-layers 1 --hidden-size 32 --num-attention-heads 2 "
      "--seq-length 16 --micro-batch-size 2 --global-batch-size 4 "
      "--train-iters 3 --eval-interval 2 --log-json " +
      log);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("iter 3/3"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("validation at iter 2"), std::string::npos) << r.output;
  const auto parsed = actmem::testing::read_json_log(log);
  int n = 0;
  for (const auto& j : parsed.iterations) {
    EXPECT_EQ(j["iteration"].get<int>(), ++n);
    EXPECT_GT(j["activation_bytes"].get<int64_t>(), 0);
    EXPECT_EQ(j.contains("val_loss"), n == 2 || n == 3);
  }
  EXPECT_EQ(n, 3);
}

struct BadInput {
  const char* name;
  std::string args;
  const char* message;
};
inline void PrintTo(const BadInput& c, std::ostream* os) {
  *os << c.name;
}

class CliErrors : public ::testing::TestWithParam<BadInput> {};

TEST_P(CliErrors, OneClearLineAndNonZeroExit) {
  const auto r = run_actmem(GetParam().args);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_LT(r.exit_code, 128) << "killed by a signal: " << r.output;
  EXPECT_NE(r.stderr_text.find(GetParam().message), std::string::npos) << r.stderr_text;
  EXPECT_EQ(r.stderr_text.find("Exception raised from"), std::string::npos) << r.stderr_text;
}

std::string empty_file() {
  const std::string path = ::testing::TempDir() + "cli_empty.txt";
  std::ofstream(path).close();
  return path;
}

std::string short_file() {
  const std::string path = ::testing::TempDir() + "cli_short.txt";
  std::ofstream(path) << "just a few words";
  return path;
}

INSTANTIATE_TEST_SUITE_P(
    Messages, CliErrors,
    ::testing::Values(
        BadInput{"NoSubcommand", "", "A subcommand is required"},
        BadInput{"UnknownFlag", "train --no-such-flag", "--no-such-flag"},
        BadInput{"NotANumber", "train --num-layers two", "--num-layers"},
        BadInput{"NegativeSize", "train --hidden-size -4",
                 "--hidden-size: expected a positive number, got '-4'"},
        BadInput{"HeadsDoNotDivide", "train --num-attention-heads 5",
                 "num_attention_heads (5) must divide hidden_size (128)"},
        BadInput{"DropoutOne", "train --hidden-dropout 1", "hidden_dropout must be in [0, 1)"},
        BadInput{"BadGlobalBatch", "train --global-batch-size 12",
                 "must be a multiple of micro_batch_size"},
        BadInput{"MissingData", "train --data /nonexistent/corpus.txt",
                 "cannot open '/nonexistent/corpus.txt'"},
        BadInput{"EmptyData", "train --data " + empty_file(), "is empty"},
        BadInput{"SequenceLongerThanCorpus", "train --data " + short_file(),
                 "needs at least seq_length + 1"},
        BadInput{"TooBigForMemory",
                 "train --num-layers 96 --hidden-size 65536 --num-attention-heads 64",
                 "of device memory"},
        BadInput{"TooBigForLimit", "train --device-memory-limit 0.001", "but the limit is"},
        BadInput{"BadDevice", "train --device tpu", "device must be cpu, cuda or cuda:N"},
        BadInput{"RemovedCheckpointActivations", "train --checkpoint-activations",
                 "--checkpoint-activations is no longer valid, use --recompute-activations"},
        BadInput{"BadGranularity", "train --recompute-granularity some", "--recompute-granularity"},
        BadInput{"FullWithoutMethod", "train --recompute-granularity full --recompute-num-layers 1",
                 "recompute_method must be \"block\" or \"uniform\""},
        BadInput{"SelectiveWithNumLayers", "train --recompute-activations --recompute-num-layers 1",
                 "recompute_num_layers must be None"},
        BadInput{"UnknownModule",
                 "train --recompute-granularity selective --recompute-modules core_attn qkv",
                 "Invalid choices for recompute_modules: {'qkv'}"},
        BadInput{"ModulesWithoutSelective", "train --recompute-modules mlp",
                 "recompute_modules only applies to recompute_granularity selective"},
        BadInput{"DistributeWithoutTP",
                 "train --recompute-granularity full --recompute-method uniform "
                 "--recompute-num-layers 1 --distribute-saved-activations",
                 "distribute_saved_activations requires tensor_model_parallel_size > 1"}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace actmem
