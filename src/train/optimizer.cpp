// optimizer.cpp — Optimizer and OptimizerParamScheduler (optimizer.h).
#include "actmem/train/optimizer.h"

#include "actmem/model/layers.h"
#include "actmem/parallel/distributed_optimizer.h"
#include "actmem/train/mixed_precision.h"

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <cmath>

namespace actmem {

double OptimizerParamScheduler::lr_at_sample(int64_t samples, double max_lr, double min_lr) const {
  // OptimizerParamScheduler.get_lr(param_group) at num_steps = the samples before this step,
  // with the group's max_lr and min_lr.
  const auto& c = config_;
  const double num_steps = static_cast<double>(samples);
  const double warmup = steps_.warmup, decay = static_cast<double>(steps_.decay);
  if (warmup > 0 && num_steps <= warmup) {
    return c.lr_warmup_init + (max_lr - c.lr_warmup_init) * num_steps / warmup;
  }
  if (c.lr_decay_style == "constant") return max_lr;
  if (num_steps > decay) return min_lr;
  const double ratio = (num_steps - warmup) / (decay - warmup);
  const double coeff =
      c.lr_decay_style == "linear" ? 1.0 - ratio : 0.5 * (std::cos(M_PI * ratio) + 1.0);
  return min_lr + coeff * (max_lr - min_lr);
}

Optimizer::Optimizer(const std::vector<at::Tensor>& params, const TransformerConfig& model,
                     const TrainingConfig& training, std::unique_ptr<OptimizerShards> shards,
                     const std::vector<bool>& decoupled)
    : params_(params), shards_(std::move(shards)) {
  // Megatron's get_standard_config_overrides: wd_mult 0 for every parameter of one dimension
  // (biases, normalization weights; "*.bias" names are all 1-D here), read from the whole
  // parameter's shape before any distributed-optimizer shard flattens it.
  std::vector<bool> no_decay;
  for (const auto& p : params_) no_decay.push_back(p.dim() == 1);
  const at::ScalarType dtype = params_dtype(model);
  if (is_16bit(dtype)) {
    // Megatron's Float16OptimizerWithFloat16Params with main-grad buffers (mixed_precision.h).
    std::optional<GradScaler> scaler;
    if (training.loss_scale) {
      scaler = GradScaler::constant(*training.loss_scale);
    } else if (training.dynamic_loss_scale(model)) {
      scaler = GradScaler::dynamic(training.initial_loss_scale, training.min_loss_scale,
                                   training.loss_scale_window, training.hysteresis);
    }
    mixed_ = std::make_unique<MixedPrecisionOptimizer>(
        params_,
        AdamWSettings{training.lr, training.adam_beta1, training.adam_beta2, training.adam_eps,
                      training.weight_decay},
        training.fp32_main_grads(model) ? at::kFloat : dtype, scaler, shards_.get(), decoupled,
        no_decay);
    grads_ = mixed_->main_grads();
    return;
  }
  {
    // Gradients live for the whole run: allocated once here, zeroed in place each step.
    at::NoGradGuard no_grad;
    for (auto p : params_) p.mutable_grad() = at::zeros_like(p);
  }
  for (const auto& p : params_) grads_.push_back(p.grad());
  // With the distributed optimizer AdamW steps views of this rank's elements of each parameter
  // (Megatron's fp32 shards are views of the parameters too), their gradients views of the
  // gradients' same elements; the step writes straight into the parameters.
  adamw_params_ = params_;
  if (shards_) {
    for (size_t i = 0; i < params_.size(); ++i) {
      adamw_params_[i] = shards_->shard(params_[i].detach(), i);
      adamw_params_[i].mutable_grad() = shards_->shard(grads_[i], i);
    }
  }
  adamw_ = std::make_unique<AdamWGroups>(
      adamw_params_,
      AdamWSettings{training.lr, training.adam_beta1, training.adam_beta2, training.adam_eps,
                    training.weight_decay},
      decoupled, no_decay);
}

Optimizer::~Optimizer() = default;

void Optimizer::begin_step(double lr, std::optional<double> decoupled_lr) {
  if (mixed_) {
    mixed_->set_lr(lr, decoupled_lr);
    mixed_->zero_grad();
    return;
  }
  adamw_->set_lr(lr, decoupled_lr);
  for (auto& g : grads_) g.zero_();
}

double Optimizer::loss_scale() const {
  return mixed_ ? mixed_->loss_scale() : 1.0;
}

bool Optimizer::scales_loss() const {
  return mixed_ && mixed_->scaler();
}

bool Optimizer::unscale_and_check(const std::function<bool(bool)>& found_inf_any_rank) {
  return mixed_ ? mixed_->unscale_and_check(found_inf_any_rank) : false;
}

void Optimizer::step() {
  if (mixed_) {
    mixed_->step();  // its all-gather included
    return;
  }
  adamw_->adamw().step();
  if (shards_) shards_->all_gather(params_);
}

torch::optim::AdamW& Optimizer::adamw() {
  return mixed_ ? mixed_->adamw() : adamw_->adamw();
}

const std::vector<at::Tensor>& Optimizer::adamw_params() const {
  return mixed_ ? mixed_->main_params() : adamw_params_;
}

}  // namespace actmem
