// optimizer.h — the optimizer behind one interface, and the learning-rate schedule beside it.
//
// As Megatron-LM's train_step calls optimizer.step() and opt_param_scheduler.step() without
// knowing which optimizer it holds (megatron/core/optimizer/: FP32Optimizer,
// Float16OptimizerWithFloat16Params, DistributedOptimizer; megatron/core/
// optimizer_param_scheduler.py), the Trainer steps an Optimizer that is AdamW in fp32 training,
// the mixed-precision optimizer at 16 bits (mixed_precision.h), either over this rank's shards with
// --use-distributed-optimizer (distributed_optimizer.h).
#pragma once

#include "actmem/config/config.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

namespace torch::optim {
class AdamW;
}

namespace actmem {

class AdamWGroups;
class MixedPrecisionOptimizer;
class OptimizerShards;

/// Megatron's OptimizerParamScheduler (megatron/core/optimizer_param_scheduler.py) for the
/// learning rate, with the steps of get_optimizer_param_scheduler (lr_schedule_steps): it counts
/// samples, each successful step adding its global batch (Megatron's step(increment)); a step
/// runs at the samples counted before it, so a warmup's first step runs at --lr-warmup-init (0
/// by default), as Megatron's does. Warmup is linear from lr_warmup_init to lr, then constant,
/// linear or cosine decay to min_lr at the decay's end, min_lr after it. A skipped step
/// (loss-scale overflow) does not advance it.
class OptimizerParamScheduler {
 public:
  OptimizerParamScheduler(const TrainingConfig& config, GlobalBatchSchedule batches)
      : config_(config),
        batches_(std::move(batches)),
        steps_(lr_schedule_steps(config, batches_)) {}
  /// The learning rate of the optimizer step `step` (1-based) of a run without skipped steps.
  double lr_at(int64_t step) const { return lr_at(step, config_.lr, config_.min_lr); }
  /// get_lr of a parameter group with its own max_lr and min_lr (the same warmup and decay).
  double lr_at(int64_t step, double max_lr, double min_lr) const {
    return lr_at_sample(batches_.samples_after(step - 1), max_lr, min_lr);
  }
  /// get_lr at `samples` counted.
  double lr_at_sample(int64_t samples, double max_lr, double min_lr) const;
  /// The learning rate of the next step.
  double next_lr() const { return lr_at_sample(num_samples_, config_.lr, config_.min_lr); }
  /// --decoupled-lr's group (the word embedding and output layer): its rate for the next step,
  /// from decoupled_lr to decoupled_min_lr (min_lr without it); unset without --decoupled-lr.
  std::optional<double> next_decoupled_lr() const {
    if (!config_.decoupled_lr) return std::nullopt;
    return lr_at_sample(num_samples_, *config_.decoupled_lr,
                        config_.decoupled_min_lr.value_or(config_.min_lr));
  }
  /// A successful optimizer step of `global_batch` samples.
  void step(int64_t global_batch) { num_samples_ += global_batch; }
  /// Samples counted (Megatron's num_steps, what a checkpoint records).
  int64_t num_samples() const { return num_samples_; }
  void set_num_samples(int64_t samples) { num_samples_ = samples; }
  const TrainingConfig& config() const { return config_; }
  /// The warmup and decay in samples.
  const LrScheduleSteps& steps() const { return steps_; }

 private:
  TrainingConfig config_;
  GlobalBatchSchedule batches_;
  LrScheduleSteps steps_;
  int64_t num_samples_ = 0;
};

class Optimizer {
 public:
  /// `params`: the model's parameters in order (their gradients are allocated here, once, for
  /// the whole run). `shards`: the distributed optimizer's layout, or null.
  /// `decoupled`: per parameter, whether it follows --decoupled-lr (empty: none does).
  Optimizer(const std::vector<at::Tensor>& params, const TransformerConfig& model,
            const TrainingConfig& training, std::unique_ptr<OptimizerShards> shards,
            const std::vector<bool>& decoupled = {});
  ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  /// One gradient per parameter: the parameters' own in fp32, the main-grad buffers at 16 bits
  /// (what reductions, the norm, the clip and the digest work on).
  const std::vector<at::Tensor>& gradients() const { return grads_; }
  /// Sets the learning rates of the coming step (decoupled_lr: the decoupled group's) and
  /// zeroes the gradients.
  void begin_step(double lr, std::optional<double> decoupled_lr = std::nullopt);
  /// The loss multiplier for backward: the loss scaler's scale, or 1.
  double loss_scale() const;
  /// True when backward runs from loss * loss_scale() (a loss scaler is set).
  bool scales_loss() const;
  /// At 16 bits with a loss scaler: unscales the gradients and returns whether any is inf or NaN
  /// on any rank (`found_inf_any_rank` reduces the local flag); false otherwise.
  bool unscale_and_check(const std::function<bool(bool)>& found_inf_any_rank);
  /// AdamW on this rank's (main) parameters, then the copy into the model and, with the
  /// distributed optimizer, the all-gather of every rank's updated elements.
  void step();

  /// The parameters it was built over.
  const std::vector<at::Tensor>& params() const { return params_; }
  /// The AdamW that steps `adamw_params()` (its state is what a checkpoint keeps).
  torch::optim::AdamW& adamw();
  /// What AdamW steps: the parameters (or this rank's views of them) in fp32, the fp32 main
  /// parameters at 16 bits.
  const std::vector<at::Tensor>& adamw_params() const;
  /// The mixed-precision optimizer (null in fp32 training).
  MixedPrecisionOptimizer* mixed() const { return mixed_.get(); }
  /// The distributed optimizer's layout (null without --use-distributed-optimizer).
  const OptimizerShards* shards() const { return shards_.get(); }

 private:
  std::vector<at::Tensor> params_;
  // Declared before the optimizers, which use it.
  std::unique_ptr<OptimizerShards> shards_;
  std::vector<at::Tensor> adamw_params_;            // fp32 training: what adamw_ steps
  std::unique_ptr<AdamWGroups> adamw_;              // fp32 training
  std::unique_ptr<MixedPrecisionOptimizer> mixed_;  // --bf16 / --fp16
  std::vector<at::Tensor> grads_;
};

}  // namespace actmem
