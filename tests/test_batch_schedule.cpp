// test_batch_schedule.cpp — --step-batch-size-schedule: the schedule read, the sizes, the
// iterations and the learning rate as Megatron's own code gives them; training across a change
// of batch size bitwise equal to constant-batch runs joined by a checkpoint; the checkpoint at the
// change, the resume, and the refusals.
//
// Expected values marked "Megatron:" were printed by Megatron-LM's code (d98e8a64dd) run on CPU:
// StepBatchsizeNumMicroBatchesCalculator (megatron/core/num_microbatches_calculator.py; its
// `.schedule`, `update` then `get_current_global_batch_size`), the update_train_iters loop of
// megatron/training/training.py, and OptimizerParamScheduler
// (megatron/core/optimizer_param_scheduler.py) stepped by each step's global batch.
#include "actmem/base/digest.h"
#include "actmem/config/batch_schedule.h"
#include "actmem/train/optimizer.h"
#include "actmem/train/trainer.h"
#include "fixtures.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace actmem {
namespace {

using testing::expect_error_containing;
using Entries = std::vector<std::pair<int64_t, int64_t>>;

Entries entries_of(const GlobalBatchSchedule& s) {
  Entries out;
  for (const auto& e : s.entries()) out.emplace_back(e.from_sample, e.batch_size);
  return out;
}

TEST(GlobalBatchSchedule, ReadsTheTextAsMegatronsCalculator) {
  // Megatron: StepBatchsizeNumMicroBatchesCalculator(...).schedule for (text, seq_length).
  const std::vector<std::pair<std::pair<std::string, int64_t>, Entries>> cases = {
      {{"0:768 250B:1536 500B:3072 750B:6144", 4096},
       {{0, 768}, {61035156, 1536}, {122070312, 3072}, {183105468, 6144}}},
      {{"0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536", 2048},
       {{0, 16}, {1171875, 320}, {2343750, 624}, {3515625, 928}, {4687500, 1232}, {5859375, 1536}}},
      {{"0:4, 1.5K:8 3k:16", 32}, {{0, 4}, {46, 8}, {93, 16}}},
      {{"4K:16 0:4 1K:8", 64}, {{0, 4}, {15, 8}, {62, 16}}},
      {{"0:2 128:4", 32}, {{0, 2}, {4, 4}}},
      {{" 0:1.5k\t2.5e3:2e3 ", 10}, {{0, 1500}, {250, 2000}}},
      // 16 tokens of 32 per sample: the first threshold is sample 0.
      {{"16:4", 32}, {{0, 4}}},
  };
  for (const auto& [input, want] : cases) {
    const GlobalBatchSchedule s = GlobalBatchSchedule::parse(input.first, input.second);
    EXPECT_TRUE(s.stepped());
    EXPECT_EQ(entries_of(s), want) << input.first;
  }
}

TEST(GlobalBatchSchedule, SizesAndIterationsAreMegatronsUpdateLoop) {
  const GlobalBatchSchedule s = GlobalBatchSchedule::parse("0:4, 1.5K:8 3k:16", 32);
  // Megatron: update(consumed) then get_current_global_batch_size().
  const Entries at = {{0, 4}, {45, 4}, {46, 8}, {47, 8}, {92, 8}, {93, 16}, {1000, 16}};
  for (const auto& [consumed, want] : at) EXPECT_EQ(s.at(consumed), want) << consumed;
  // Megatron: update_train_iters' loop for --train-samples N: (iterations, consumed at the end).
  const std::vector<std::pair<int64_t, std::pair<int64_t, int64_t>>> runs = {
      {1, {1, 4}},    {4, {1, 4}},      {46, {12, 48}},   {47, {12, 48}},
      {48, {12, 48}}, {100, {19, 112}}, {200, {25, 208}}, {1001, {75, 1008}}};
  for (const auto& [samples, want] : runs) {
    EXPECT_EQ(s.iterations_for(samples), want.first) << samples;
    EXPECT_EQ(s.samples_after(want.first), want.second) << samples;
  }
  // Megatron: the samples consumed after k steps from 0.
  const Entries after = {{0, 0}, {1, 4}, {11, 44}, {12, 48}, {13, 56}, {20, 128}};
  for (const auto& [k, want] : after) EXPECT_EQ(s.samples_after(k), want) << k;
  // From the middle (a resumed run): 3 steps from sample 44 run at 4, 8, 8.
  EXPECT_EQ(s.samples_after(3, 44), 64);
  EXPECT_EQ(s.sizes_used(3, 44), (std::vector<int64_t>{4, 8}));
  EXPECT_EQ(s.sizes_used(30, 0), (std::vector<int64_t>{4, 8, 16}));
  EXPECT_EQ(s.largest(), 16);
  // One batch size: update_train_iters' train_samples // global_batch_size (the last partial
  // batch is not run), where a schedule of the same single size runs until N are consumed.
  EXPECT_EQ(GlobalBatchSchedule(4).iterations_for(10), 2);
  EXPECT_EQ(GlobalBatchSchedule::parse("0:4", 1).iterations_for(10), 3);
  EXPECT_FALSE(GlobalBatchSchedule(4).stepped());
}

TEST(GlobalBatchSchedule, RefusesWhatMegatronRefusesNamingTheEntry) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      // Megatron: AssertionError "schedule thresholds must be strictly increasing, got 0 before 0".
      {"0:4 31:8", "schedule thresholds must be strictly increasing, got 0 before 0 samples"},
      // Megatron: AssertionError "batch size must be positive, got 0".
      {"0:0", "batch size must be positive, got 0"},
      // Megatron: ValueError "could not convert string to float: 'X'".
      {"0:4 x:8", "the threshold of entry \"x:8\" is not a number"},
      {"0:4 64:8q", "the batch size of entry \"64:8q\" is not a number"},
      {"0:4 64:inf", "the batch size of entry \"64:inf\" is not a number"},
      // Megatron: ValueError 'Invalid schedule entry "0-4". Expected format: ...'.
      {"0-4", "invalid schedule entry \"0-4\"; expected THRESHOLD:BATCH_SIZE"},
      // Megatron: AssertionError "schedule must have at least one entry".
      {" , ", "the schedule must have at least one entry"},
      // Megatron: AssertionError "first schedule entry must have threshold 0, got 2".
      {"64:4 128:8", "the first schedule entry must have threshold 0, got 2 samples"},
      // Megatron asserts in its train loop when the micro-batches decrease; refused up front.
      {"0:8 64:4", "the batch size decreases from 8 to 4 at sample 2"},
      {"0:4 -64:8", "is negative"},
      {"0:4 1e30:8", "out of range"},
  };
  for (const auto& [text, message] : cases) {
    expect_error_containing([&] { GlobalBatchSchedule::parse(text, 32); }, message);
  }
}

TEST(GlobalBatchSchedule, LearningRatesAreMegatronsSchedulerSteppedByEachBatch) {
  TransformerConfig model = testing::tiny_model();  // seq 32
  model.micro_batch_size = 2;
  TrainingConfig t;
  t.step_batch_size_schedule = "0:4, 1.5K:8 3k:16";
  t.lr = 1e-3;
  t.min_lr = 1e-4;
  t.lr_decay_style = "cosine";
  // Sample-based: --train-samples 200 --lr-decay-samples 200 --lr-warmup-samples 40.
  t.train_samples = 200;
  t.lr_decay_samples = 200;
  t.lr_warmup_samples = 40;
  t.validate(model);
  t.resolve_train_iters(t.batch_schedule(model, 2));
  EXPECT_EQ(t.train_iters, 25);  // Megatron: update_train_iters
  OptimizerParamScheduler scheduler(t, t.batch_schedule(model, 2));
  // Megatron: (step, the learning rate it ran with).
  const std::vector<std::pair<int64_t, double>> want = {{1, 0.0},
                                                        {4, 0.00030000000000000003},
                                                        {11, 0.001},
                                                        {12, 0.0009986128001799076},
                                                        {13, 0.000994459753267812},
                                                        {18, 0.000814503363531613},
                                                        {19, 0.000754295724882796},
                                                        {20, 0.000620395509268104},
                                                        {25, 0.00010554024673218806}};
  size_t w = 0;
  for (int64_t k = 1; k <= 25; ++k) {
    if (w < want.size() && want[w].first == k) {
      EXPECT_DOUBLE_EQ(scheduler.next_lr(), want[w].second) << "step " << k;
      EXPECT_DOUBLE_EQ(scheduler.lr_at(k), want[w].second) << "step " << k;
      ++w;
    }
    scheduler.step(t.batch_schedule(model, 2).at(scheduler.num_samples()));
  }
  EXPECT_EQ(scheduler.num_samples(), 208);

  // Iteration-based (--train-iters 12 --lr-decay-iters 12 --lr-warmup-iters 2): the warmup and
  // decay are the samples of those steps of the schedule, 8 and 48. Megatron multiplies the
  // iterations by its args.global_batch_size (micro-batch x data-parallel size under a schedule:
  // 4 here by chance of this layout, 2 x 12 = 24 at data-parallel size 1), so its decay would end
  // half-way through the run; deliberately not copied (docs/train.md). Megatron's scheduler with
  // lr_warmup_steps 8 and lr_decay_steps 48 gives these.
  TrainingConfig it = t;
  it.train_samples.reset();
  it.lr_decay_samples.reset();
  it.lr_warmup_samples = 0;
  it.train_iters = 12;
  it.lr_decay_iters = 12;
  it.lr_warmup_iters = 2;
  it.validate(model);
  const OptimizerParamScheduler by_iterations(it, it.batch_schedule(model, 2));
  EXPECT_EQ(by_iterations.steps().decay, 48);
  EXPECT_EQ(by_iterations.steps().warmup, 8.0);
  const std::vector<std::pair<int64_t, double>> want_it = {
      {1, 0.0},     {2, 0.0005},
      {3, 0.001},   {4, 0.0009779754323328191},
      {8, 0.00055}, {12, 0.00012202456766718092}};
  for (const auto& [k, lr] : want_it) EXPECT_DOUBLE_EQ(by_iterations.lr_at(k), lr) << "step " << k;
}

TEST(GlobalBatchSchedule, ExcludesGlobalBatchSizeAsMegatronDoes) {
  TransformerConfig model = testing::tiny_model();
  TrainingConfig t = testing::tiny_training();
  t.step_batch_size_schedule = "0:4 256:8";
  t.global_batch_size = 8;
  // Megatron: ValueError from validate_args.
  expect_error_containing([&] { t.validate(model); },
                          "Cannot specify both --step-batch-size-schedule and --global-batch-size");
  t.global_batch_size = 0;
  t.validate(model);
  // What global_batch() reads then is Megatron's args.global_batch_size: micro x data-parallel.
  EXPECT_EQ(t.global_batch(model.micro_batch_size, 2), 2 * model.micro_batch_size);
}

// --- Training across a change of batch size -------------------------------------------------

struct ScheduleSteps {
  std::vector<double> loss, lr;
  std::vector<std::string> digest;
  std::vector<int64_t> batch, consumed;
};

void record_step(ScheduleSteps& s, const IterationStats& st) {
  s.loss.push_back(st.loss);
  s.lr.push_back(st.lr);
  s.digest.push_back(st.grad_digest);
  s.batch.push_back(st.global_batch_size);
  s.consumed.push_back(st.consumed_samples);
}

ScheduleSteps run_schedule_steps(Trainer& trainer, int n) {
  ScheduleSteps s;
  for (int i = 0; i < n; ++i) record_step(s, trainer.train_step());
  return s;
}

// tiny_model: micro-batch 4, seq 32, dropout 0.1. 256 tokens are 8 samples: two steps of 4, then
// steps of 8. Sample-based, so that runs of either constant size share the schedule's samples.
TrainingConfig schedule_training() {
  TrainingConfig t = testing::tiny_training();
  t.train_samples = 40;
  t.lr_decay_samples = 40;
  t.lr_warmup_iters = 0;
  t.lr_warmup_samples = 4;
  t.lr_decay_style = "cosine";
  return t;
}

TEST(StepBatchSizeSchedule, TrainsBitwiseAsConstantBatchRunsJoinedByACheckpoint) {
  const TransformerConfig model = testing::tiny_model();
  ASSERT_GT(model.hidden_dropout, 0.0);
  TrainingConfig stepped = schedule_training();
  stepped.step_batch_size_schedule = "0:4 256:8";
  Trainer whole(model, stepped);
  EXPECT_EQ(whole.config().train_iters, 6);  // 2 x 4 + 4 x 8 = 40 samples
  const ScheduleSteps ref = run_schedule_steps(whole, 6);
  EXPECT_EQ(ref.batch, (std::vector<int64_t>{4, 4, 8, 8, 8, 8}));
  EXPECT_EQ(ref.consumed, (std::vector<int64_t>{4, 8, 16, 24, 32, 40}));

  // Two steps at a constant 4, saved; loaded into a run at a constant 8 for the other four.
  const std::string dir = testing::fresh_temp_dir("batch_schedule");
  TrainingConfig four = schedule_training();
  four.global_batch_size = 4;
  ScheduleSteps joined;
  {
    Trainer first(model, four);
    joined = run_schedule_steps(first, 2);
    first.save_checkpoint(dir);
  }
  TrainingConfig eight = schedule_training();
  eight.global_batch_size = 8;
  Trainer second(model, eight);
  ASSERT_EQ(second.load_checkpoint(dir), 2);
  const ScheduleSteps rest = run_schedule_steps(second, 4);
  for (size_t i = 0; i < 4; ++i) {
    joined.loss.push_back(rest.loss[i]);
    joined.lr.push_back(rest.lr[i]);
    joined.digest.push_back(rest.digest[i]);
  }
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(joined.loss[i], ref.loss[i]) << "step " << i + 1;
    EXPECT_EQ(joined.lr[i], ref.lr[i]) << "step " << i + 1;
    EXPECT_EQ(joined.digest[i], ref.digest[i]) << "step " << i + 1;
  }
  EXPECT_EQ(digest_of(second.model().ordered_parameters()),
            digest_of(whole.model().ordered_parameters()));
  std::filesystem::remove_all(dir);
}

TEST(StepBatchSizeSchedule, RunSavesBeforeTheFirstStepAtANewSizeAndResumesOnTheSchedule) {
  const TransformerConfig model = testing::tiny_model();
  const std::string dir = testing::fresh_temp_dir("batch_schedule_run");
  TrainingConfig t = schedule_training();
  t.step_batch_size_schedule = "0:4 256:8";
  t.save = dir;
  ScheduleSteps ref;
  std::ostringstream progress;
  {
    Trainer whole(model, t);
    Trainer::RunOutput out;
    out.progress = &progress;
    EXPECT_EQ(whole.run(out, [&](const IterationStats& st) { record_step(ref, st); }), 0);
  }
  EXPECT_EQ(ref.batch, (std::vector<int64_t>{4, 4, 8, 8, 8, 8}));
  // Megatron's train loop: a checkpoint when the number of micro-batches changes, before the
  // step at the new size; and at the end.
  EXPECT_TRUE(std::filesystem::exists(checkpoint_iteration_dir(dir, 2)));
  EXPECT_TRUE(std::filesystem::exists(checkpoint_iteration_dir(dir, 6)));
  EXPECT_FALSE(std::filesystem::exists(checkpoint_iteration_dir(dir, 3)));
  EXPECT_NE(progress.str().find("global batch size 4 -> 8 at 8 consumed samples"),
            std::string::npos)
      << progress.str();
  EXPECT_NE(progress.str().find("| global batch size 8 |"), std::string::npos) << progress.str();

  // Resumed from the checkpoint at the change: the schedule goes on from 8 consumed samples.
  TrainingConfig again = t;
  again.save.clear();
  Trainer resumed(model, again);
  {
    // Megatron's tracker file pointed back at the checkpoint of the change.
    std::ofstream latest(dir + "/latest_checkpointed_iteration.txt", std::ios::trunc);
    latest << 2;
  }
  ASSERT_EQ(resumed.load_checkpoint(dir), 2);
  EXPECT_EQ(resumed.next_global_batch(), 8);
  const ScheduleSteps rest = run_schedule_steps(resumed, 4);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(rest.batch[i], 8);
    EXPECT_EQ(rest.loss[i], ref.loss[2 + i]) << "step " << i + 3;
    EXPECT_EQ(rest.lr[i], ref.lr[2 + i]) << "step " << i + 3;
    EXPECT_EQ(rest.digest[i], ref.digest[2 + i]) << "step " << i + 3;
  }
  std::filesystem::remove_all(dir);
}

TEST(StepBatchSizeSchedule, ASizeTheLayoutCannotRunIsRefusedBeforeTheRun) {
  const TransformerConfig model = testing::tiny_model();  // micro-batch 4
  TrainingConfig t = schedule_training();
  t.step_batch_size_schedule = "0:4 256:6";  // 6 is not whole micro-batches
  Trainer trainer(model, t);
  expect_error_containing(
      [&] { trainer.run({}, nullptr); },
      "--step-batch-size-schedule reaches a global batch of 6 within the 8 steps from sample 0");
  EXPECT_EQ(trainer.iteration(), 0);  // refused before the first step
  // train_step alone runs the steps at 4 and refuses the first at 6.
  trainer.train_step(false);
  trainer.train_step(false);
  expect_error_containing([&] { trainer.train_step(false); },
                          "is not divisible by micro batch size (4)");
  EXPECT_EQ(trainer.iteration(), 2);
}

}  // namespace
}  // namespace actmem
