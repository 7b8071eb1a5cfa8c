// trainer.h — the training loop: micro-batches with gradient accumulation under the pipeline
// schedules, the optimizer step, validation, checkpoints, and the per-iteration measurements
// every later mechanism is judged by.
//
// The Trainer assembles parts that each do one job, as Megatron-LM's train_step calls them:
// the data (training_setup.h), the model (model.h), the parameters' groups and the gradient
// reductions (gradients.h), the optimizer and its schedule (optimizer.h), the checkpoint over a
// TrainState (checkpoint.h), the statistics (iteration_stats.cpp) and the loop with its log
// (run_loop.cpp). Memory is measured with the device tracker (memory_tracker.h). Gradients are
// allocated once at construction, so activation measurements never include first-touch gradient
// allocations.
#pragma once

#include "actmem/base/pipeline_event.h"
#include "actmem/base/report.h"
#include "actmem/config/config.h"
#include "actmem/data/data.h"
#include "actmem/memory/memory_tracker.h"
#include "actmem/model/model.h"
#include "actmem/recompute/rng.h"
#include "actmem/train/checkpoint.h"
#include "actmem/train/gradients.h"
#include "actmem/train/optimizer.h"

#include <nlohmann/json_fwd.hpp>

#include <functional>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>

namespace actmem {

class ActivationLedger;
class StepStatistics;
class LedgerScope;
class PipelineP2P;
struct TensorParallelGroup;
class MixedPrecisionOptimizer;
class ActivationOffloader;
class GradReducer;
class OptimizerShards;
struct ScheduleSpec;
struct ActivationPrediction;
class OutputFile;
class TraceRecorder;

/// Everything measured in one optimizer step.
struct IterationStats {
  int64_t iteration = 0;
  double loss = 0.0;        // mean over micro-batches
  double grad_norm = 0.0;   // global L2 norm before clipping
  std::string grad_digest;  // bytes of every parameter gradient, before the optimizer step
  double lr = 0.0;
  /// --decoupled-lr's group's rate for this step (the word embedding and output layer).
  std::optional<double> decoupled_lr;
  /// Training samples consumed after this step (Megatron's consumed_train_samples).
  int64_t consumed_samples = 0;
  /// The step's global batch (every data-parallel rank's micro-batches): constant, or from
  /// --step-batch-size-schedule.
  int64_t global_batch_size = 0;
  /// Seconds since run() started (0 outside run()).
  double elapsed_s = 0.0;
  /// The loss scale this step's backward used (1 without loss scaling).
  double loss_scale = 1.0;
  /// True when the gradients overflowed (inf/NaN under loss scaling) and the optimizer step was
  /// skipped, as Megatron's skipped iterations: parameters, moments and the learning-rate
  /// schedule are left as they were; grad_norm is NaN (null in JSON).
  bool skipped = false;
  double step_time_s = 0.0;  // forward, backward and optimizer step of all micro-batches
  double tokens_per_s = 0.0;
  int64_t peak_device_bytes = 0;  // tracker peak during the step
  /// Tracker peak from the end of the backward (gradient reductions, clipping, optimizer step) to
  /// the end of the step: the part of the step's peak no activation strategy changes.
  int64_t optimizer_peak_bytes = 0;
  int64_t activation_bytes =
      0;  // held at end of forward minus held before it (max over micro-batches)
  int64_t activation_peak_bytes = 0;  // peak during forward+backward minus held before forward
                                      // (max; with pipeline parallelism over the whole schedule)
  int64_t predicted_activation_bytes =
      0;  // the exact predictor for this config (activation_bytes.h)
  /// The most activation bytes held at once (at the end of a forward, every micro-batch in
  /// flight counted): activation_bytes without pipeline parallelism; under 1F1B up to
  /// min(p - stage, micro-batches) micro-batches (Note [Pipeline step] in schedules.cpp).
  int64_t inflight_activation_bytes = 0;
  int64_t predicted_inflight_activation_bytes = 0;
  int64_t offloaded_bytes = 0;  // device bytes copied to host this step (offload)
  int64_t host_peak_bytes = 0;  // peak host-buffer bytes in use this step
  double offload_wait_s = 0.0;  // time the compute waited for reloads this step
  double offload_copy_s = 0.0;  // copy-engine busy time this step, both directions
  // With tensor parallelism (t > 1), every rank's values, gathered to all ranks (rank order):
  std::vector<std::string> grad_digest_per_rank;  // when digests are computed
  std::vector<int64_t> activation_bytes_per_rank;
  std::vector<int64_t> activation_peak_bytes_per_rank;
  std::vector<int64_t> peak_device_bytes_per_rank;
  // With pipeline parallelism (p > 1), every stage's values (of this tensor-parallel rank),
  // gathered to all stages (stage order):
  std::vector<int64_t> inflight_activation_bytes_per_stage;
  std::vector<int64_t> predicted_inflight_activation_bytes_per_stage;
  std::vector<int64_t> peak_device_bytes_per_stage;
  /// Every stage's forwards and backwards in the order it ran them (stage order; times from the
  /// earliest stage's start of the schedule; Note [Pipeline step] in schedules.cpp).
  std::vector<std::vector<PipelineEvent>> pipeline_schedule_per_stage;
  std::optional<double> val_loss;  // when validation ran after this step
  /// MoE models only (docs/moe.md): the unscaled load-balancing loss and z-loss (mean over MoE
  /// layers of the mean over micro-batches, as Megatron logs them; unset when not computed), the
  /// busiest expert's routed token-expert pairs over the mean (1 = balanced, the worst layer;
  /// this rank's tokens), and the pairs the capacity dropped out of those routed (the whole
  /// global batch's: summed over the data-parallel ranks).
  bool moe = false;
  std::optional<double> load_balancing_loss;
  std::optional<double> z_loss;
  double expert_load_imbalance = 0.0;
  int64_t moe_routed_tokens = 0;
  int64_t moe_dropped_tokens = 0;
};

/// One JSON object with the fields above; doubles round-trip exactly.
nlohmann::json to_json(const IterationStats& stats);

class Trainer {
 public:
  /// Validates both configs, checks the model fits the device memory limit, loads the corpus and
  /// builds the model. Its dropout stream starts from model.seed (see rng_state()).
  Trainer(const TransformerConfig& model, const TrainingConfig& training);
  ~Trainer();

  /// One optimizer step (all micro-batches). compute_digest=false skips the gradient digest;
  /// under tensor parallelism every rank must pass the same value (it gathers the digests).
  /// Throws, before the optimizer step changes anything, when the loss or the gradient norm is
  /// not finite (training diverged; Megatron checks the gradient norm for NaN the same way).
  IterationStats train_step(bool compute_digest = true);
  /// Mean validation loss over eval_iters fixed micro-batches, in eval mode without grad.
  double evaluate();
  /// Where run() reports; every member is optional.
  struct RunOutput {
    std::ostream* progress = nullptr;  // progress lines, validation, the offload summary
    std::ostream* warnings = nullptr;  // "warning: ..." lines (e.g. an offload that moves nothing)
    /// The second step (the first after offload's warmup; the first if there is only one) is
    /// written here as a Chrome trace; opened by the caller before the run.
    OutputFile* trace = nullptr;
    /// With --exit-signal-handler: after the step in which it received a signal, run() saves
    /// (with --save) and returns early; every tensor-parallel rank stops at the same step.
    const ExitSignalHandler* exit_signals = nullptr;
  };
  /// train_iters steps with `on_step` per step and validation every eval_interval. Stops with a
  /// c10::Error naming the iteration when the loss or the gradient norm is not finite (see
  /// train_step()).
  /// Steps run from iteration() + 1 (after a load) to train_iters. With --save it saves every
  /// save_interval iterations and at the end. Returns the signal that stopped it early, or 0.
  /// (The loop is RunLoop's, run_loop.h.)
  int run(const RunOutput& out, const std::function<void(const IterationStats&)>& on_step,
          bool compute_digest = true);

  /// Writes the checkpoint of the current iteration into `dir` (save_checkpoint in
  /// checkpoint.h); collective. Returns the iteration directory.
  std::string save_checkpoint(const std::string& dir);
  /// Loads `dir`'s latest checkpoint (load_checkpoint in checkpoint.h; collective). Returns the
  /// iteration it holds, or nullopt when `dir` has none.
  std::optional<int64_t> load_checkpoint(const std::string& dir,
                                         const CheckpointLoadOptions& options = {});
  /// Samples the training data has consumed (Megatron's consumed_train_samples).
  int64_t consumed_train_samples() const;
  /// The global batch of every step (batch_schedule.h) and that of the next one.
  const GlobalBatchSchedule& batch_schedule() const { return batches_; }
  int64_t next_global_batch() const;
  /// Throws a clear error when a global batch the next `steps` steps reach cannot run on this
  /// layout: not whole micro-batches on every data-parallel rank, or (interleaved pipeline) not
  /// the micro-batch groups the schedule needs. run() checks its steps before the first.
  void check_batch_sizes(int64_t steps) const;

  GPTModel& model() { return *model_; }
  const Corpus& corpus() const { return corpus_; }
  int64_t iteration() const { return iteration_; }
  DeviceMemory& memory() { return memory_; }
  const at::Device& device() const { return device_; }
  /// The training settings in effect: train_iters derived from --train-samples.
  const TrainingConfig& config() const { return config_; }
  /// The learning rate the next step will run at (what Megatron logs as a step's
  /// "learning-rate": its scheduler has stepped by then).
  double next_learning_rate() const { return scheduler_.next_lr(); }
  /// The loss scale the next step runs at, with loss scaling (16-bit), else nullopt.
  std::optional<double> loss_scale() const;
  /// Records the saved tensors of the first micro-batch's forward of each following step into
  /// `ledger` (cleared per step; parameters, buffers and the batch excluded). nullptr stops.
  void set_ledger(ActivationLedger* ledger) { ledger_ = ledger; }
  /// Records the next train_step() as a Chrome trace into `recorder` (compute spans per layer
  /// forward and backward, and the copy streams' spans); nullptr stops.
  void set_trace(TraceRecorder* recorder) { trace_ = recorder; }
  /// The gradients each step reduces, clips and digests, one per ordered parameter: the
  /// parameters' own gradients in fp32, the fp32 (or 16-bit) main-grad buffers at 16 bits.
  const std::vector<at::Tensor>& gradients() const { return optimizer_->gradients(); }
  /// The mixed-precision optimizer (null in fp32 training).
  MixedPrecisionOptimizer* mixed_precision() { return optimizer_->mixed(); }
  /// This trainer's dropout stream: the default generators' states between its steps.
  const std::vector<at::Tensor>& rng_state() const { return rng_state_; }
  /// The layer-level offloader (null without cpu_offloading_num_layers).
  ActivationOffloader* offloader() { return offloader_.get(); }
  /// The overlapped data-parallel reduction (--overlap-grad-reduce with d > 1), else null.
  const GradReducer* grad_reducer() const { return grad_reducer_.get(); }
  /// The distributed optimizer's layout (--use-distributed-optimizer), else null.
  const OptimizerShards* optimizer_shards() const { return optimizer_->shards(); }
  /// The timeline of the last step's first micro-batch when record_timeline(true) was set.
  void record_timeline(bool on) { record_timeline_ = on; }
  const MemoryTimeline& last_timeline() const { return *timeline_; }

 private:
  // The dropout streams (Note [Trainer RNG stream]) and the named ones, seeded as Megatron seeds.
  void seed_random_streams();
  // Elements per gradient bucket (grad_reducer.h, distributed_optimizer.h); nullopt: one bucket.
  std::optional<int64_t> ddp_bucket_size() const;
  // The run's parts a checkpoint saves and restores.
  TrainState train_state();
  // The steps of train_step() (Note [The steps of a training step] in trainer.cpp).
  struct StepClock {
    double busy_s = 0.0;  // forward, backward and optimizer time
    int64_t peak = 0;     // device peak of the step
  };
  void forward_backward(IterationStats& st, StepClock& clock);
  // Unscale and check for inf/NaN at 16 bits; true when the step is skipped.
  bool found_inf();
  // This rank's next micro-batch (tokens, labels) on the device.
  std::pair<at::Tensor, at::Tensor> next_microbatch();
  // What a step does around the schedule's computations (Note [What a step observes] in
  // trainer.cpp): the offloader's forwards and prefetches, the measurements, the predictions,
  // and the three together.
  class OffloadDriver;
  class StepMeasurement;
  class StepPrediction;
  class StepObservers;
  // This stage's share of a pipeline schedule (Note [Pipeline step] in schedules.cpp) with the
  // stage's memory predicted for it; returns the mean loss (the last stage's, on every stage).
  double forward_backward_pipelined(IterationStats& st, StepClock& clock, const ScheduleSpec& spec);
  // Backward from `loss` (times the loss scale when a scaler is set: Megatron's grad_scale_func).
  void backward_from_loss(const at::Tensor& loss);
  // Sends and receives between this rank's pipeline neighbours.
  PipelineP2P pipeline_p2p() const;
  // The ledger's record of one forward (null without a ledger).
  std::unique_ptr<LedgerScope> open_ledger(const at::Tensor& tokens, const at::Tensor& labels);
  // The last pipeline stage's `value` on every stage (the value itself without a pipeline).
  double from_last_stage(double value) const;
  /// The global gradient norm (NaN-checked), after which the gradients are clipped.
  double clip_gradients(const IterationStats& st);
  // The step's time and memory over the ranks (stats_), the trace's compute spans, the
  // offloader's step.
  void finish_stats(IterationStats& st, const StepClock& clock);
  TransformerConfig model_config_;
  TrainingConfig config_;
  GlobalBatchSchedule batches_;
  // The model's activation plan, resolved from its flags once (Note [One plan] in
  // activation_plan.h): the model runs it, the prediction reads it.
  ActivationPlan plan_;
  at::Device device_;
  DeviceMemory& memory_;
  Corpus corpus_;
  std::unique_ptr<BatchSource> train_sampler_;
  std::unique_ptr<BatchSource> valid_sampler_;
  std::shared_ptr<GPTModel> model_;
  std::unique_ptr<ParameterGroups> groups_;
  std::unique_ptr<Optimizer> optimizer_;
  OptimizerParamScheduler scheduler_;
  std::unique_ptr<GradReducer> grad_reducer_;  // --overlap-grad-reduce with d > 1
  std::unique_ptr<MemoryTimeline> timeline_;
  // What a step measured, gathered over the ranks (iteration_stats.h).
  std::unique_ptr<StepStatistics> stats_;
  std::unique_ptr<ActivationOffloader> offloader_;
  bool record_timeline_ = false;
  // Micro-batches per data-parallel rank in the step running (its global batch / (micro x d)).
  int64_t step_microbatches_ = 1;
  // What each micro-batch is predicted to keep (training_setup.h).
  std::unique_ptr<ActivationPrediction> prediction_;
  ActivationLedger* ledger_ = nullptr;
  TraceRecorder* trace_ = nullptr;
  // Note [Trainer RNG stream]: see trainer.cpp.
  std::vector<at::Generator> generators_;  // CPU default, plus the device's default on CUDA
  std::vector<at::Tensor> rng_state_;
  RngStatesTracker tracker_;  // this trainer's named streams (swapped in per step)
  // This stage's share of the last pipelined step, times in seconds of the wall clock
  // (system_clock since its epoch); finish_stats gathers every stage's.
  std::vector<PipelineEvent> schedule_;
  int64_t iteration_ = 0;
};

}  // namespace actmem
