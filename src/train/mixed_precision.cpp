// mixed_precision.cpp — main parameters, main-grad hooks and loss scaling (Megatron's semantics).
#include "actmem/train/mixed_precision.h"

#include "actmem/parallel/distributed_optimizer.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <cmath>

namespace actmem {

// ---- GradScaler -------------------------------------------------------------------------------

GradScaler GradScaler::constant(double scale) {
  TORCH_CHECK(scale > 0.0 && std::isfinite(static_cast<float>(scale)),
              "actmem::GradScaler::constant: the scale must be positive and finite in fp32, got ",
              scale);
  GradScaler g;
  g.scale_ = static_cast<float>(scale);
  return g;
}

GradScaler GradScaler::dynamic(double initial_scale, double min_scale, int64_t growth_interval,
                               int64_t hysteresis) {
  TORCH_CHECK(initial_scale > 0.0 && std::isfinite(static_cast<float>(initial_scale)) &&
                  min_scale > 0.0 && min_scale <= initial_scale,
              "actmem::GradScaler::dynamic: expected 0 < min_scale <= initial_scale (finite in "
              "fp32), got ",
              min_scale, " and ", initial_scale);
  TORCH_CHECK(growth_interval >= 1 && hysteresis >= 1,
              "actmem::GradScaler::dynamic: "
              "growth_interval and hysteresis must be at least 1, got ",
              growth_interval, " and ", hysteresis);
  GradScaler g;
  g.dynamic_ = true;
  g.scale_ = static_cast<float>(initial_scale);
  g.min_scale_ = static_cast<float>(min_scale);
  g.growth_interval_ = growth_interval;
  g.hysteresis_ = hysteresis;
  g.hysteresis_tracker_ = hysteresis;
  return g;
}

void GradScaler::load_state(float scale, int64_t growth_tracker, int64_t hysteresis_left) {
  TORCH_CHECK(std::isfinite(scale) && scale > 0.0f && growth_tracker >= 0 && hysteresis_left >= 0,
              "actmem::GradScaler::load_state: expected a positive finite scale and non-negative "
              "trackers, got scale ",
              scale, ", growth tracker ", growth_tracker, ", hysteresis tracker ", hysteresis_left);
  scale_ = scale;
  growth_tracker_ = growth_tracker;
  hysteresis_tracker_ = hysteresis_left;
}

float GradScaler::inv_scale() const {
  return static_cast<float>(1.0 / static_cast<double>(scale_));
}

void GradScaler::update(bool found_inf) {
  if (!dynamic_) return;
  // DynamicGradScaler.update: the hysteresis tracker is restored only when the scale grows.
  if (found_inf) {
    growth_tracker_ = 0;
    hysteresis_tracker_ -= 1;
    if (hysteresis_tracker_ <= 0) scale_ = std::max(scale_ * 0.5f, min_scale_);
  } else {
    growth_tracker_ += 1;
    if (growth_tracker_ == growth_interval_) {
      growth_tracker_ = 0;
      hysteresis_tracker_ = hysteresis_;
      scale_ = scale_ * 2.0f;
    }
  }
}

// ---- kernels ----------------------------------------------------------------------------------

std::optional<std::string> missing_kernel(at::ScalarType dtype, const at::Device& device) {
  const auto opts = at::TensorOptions().dtype(dtype).device(device);
  try {
    const at::Tensor x = at::ones({2, 2}, opts), w = at::ones({2}, opts);
    (void)at::addmm(w, x, x);
    (void)at::bmm(x.unsqueeze(0), x.unsqueeze(0));
    (void)at::layer_norm(x, {2}, w, w, 1e-5);
    (void)at::softmax(x, -1);
    (void)at::gelu(x);
    (void)at::silu(x);
    (void)at::rsqrt(x);
    (void)at::native_dropout(x, 0.5, true);
  } catch (const c10::Error& e) {
    return std::string(e.what_without_backtrace());
  }
  return std::nullopt;
}

// ---- MixedPrecisionOptimizer ------------------------------------------------------------------

namespace {
// Megatron's _make_backward_post_hook: runs after the parameter's gradient accumulator stored
// this backward's gradient; adds it into the main-grad buffer and frees it.
class AccumulateIntoMainGrad : public torch::autograd::FunctionPostHook {
 public:
  AccumulateIntoMainGrad(at::Tensor param, at::Tensor main_grad)
      : param_(std::move(param)), main_grad_(std::move(main_grad)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    at::Tensor& grad = param_.mutable_grad();
    if (grad.defined()) {
      at::NoGradGuard no_grad;
      main_grad_.add_(grad);
      grad.reset();
    }
    return outputs;
  }

 private:
  at::Tensor param_, main_grad_;
};
}  // namespace

AdamWGroups::AdamWGroups(const std::vector<at::Tensor>& params, const AdamWSettings& s,
                         const std::vector<bool>& decoupled, const std::vector<bool>& no_decay) {
  TORCH_CHECK(decoupled.empty() || decoupled.size() == params.size(),
              "actmem::AdamWGroups: one decoupled flag per parameter expected");
  TORCH_CHECK(no_decay.empty() || no_decay.size() == params.size(),
              "actmem::AdamWGroups: one no-decay flag per parameter expected");
  std::vector<torch::optim::OptimizerParamGroup> groups;
  // The first group holds the decayed matrices at the base rate (the checkpoint records its
  // settings as Megatron's first param group).
  for (const bool d : {false, true}) {
    for (const bool nd : {false, true}) {
      std::vector<at::Tensor> members;
      for (size_t i = 0; i < params.size(); ++i) {
        const bool is_d = !decoupled.empty() && decoupled[i];
        const bool is_nd = !no_decay.empty() && no_decay[i];
        if (is_d == d && is_nd == nd) members.push_back(params[i]);
      }
      if (members.empty()) continue;
      torch::optim::OptimizerParamGroup group(std::move(members));
      if (nd) {
        auto options = std::make_unique<torch::optim::AdamWOptions>(s.lr);
        options->betas({s.beta1, s.beta2}).eps(s.eps).weight_decay(0.0);
        group.set_options(std::move(options));
      }
      groups.push_back(std::move(group));
      group_decoupled_.push_back(d);
    }
  }
  adamw_ = std::make_unique<torch::optim::AdamW>(groups, torch::optim::AdamWOptions(s.lr)
                                                             .betas({s.beta1, s.beta2})
                                                             .eps(s.eps)
                                                             .weight_decay(s.weight_decay));
}

AdamWGroups::~AdamWGroups() = default;

void AdamWGroups::set_lr(double lr, std::optional<double> decoupled_lr) {
  auto& groups = adamw_->param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    static_cast<torch::optim::AdamWOptions&>(groups[g].options())
        .lr(group_decoupled_[g] ? decoupled_lr.value_or(lr) : lr);
  }
}

MixedPrecisionOptimizer::MixedPrecisionOptimizer(std::vector<at::Tensor> model_params,
                                                 const AdamWSettings& s, at::ScalarType grad_dtype,
                                                 std::optional<GradScaler> scaler,
                                                 const OptimizerShards* shards,
                                                 const std::vector<bool>& decoupled,
                                                 const std::vector<bool>& no_decay)
    : model_params_(std::move(model_params)), scaler_(std::move(scaler)), shards_(shards) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < model_params_.size(); ++i) {
    const at::Tensor& p = model_params_[i];
    TORCH_CHECK(p.is_leaf() && p.requires_grad(),
                "actmem::MixedPrecisionOptimizer: expected "
                "leaf parameters that require grad");
    // Megatron: main_param = param.detach().clone().float(); its grad is the main-grad buffer.
    // With the distributed optimizer: this rank's elements of both (Megatron's
    // shard_fp32_from_float16_groups).
    at::Tensor main = model_view(i).clone().to(at::kFloat).set_requires_grad(true);
    at::Tensor main_grad = at::zeros_like(p, p.options().dtype(grad_dtype));
    if (grad_dtype == at::kFloat)
      main.mutable_grad() = shards_ ? shards_->shard(main_grad, i) : main_grad;
    main_params_.push_back(main);
    main_grads_.push_back(main_grad);
    p.mutable_grad().reset();
    auto acc = torch::autograd::impl::grad_accumulator(p);
    acc->add_post_hook(std::make_unique<AccumulateIntoMainGrad>(p, main_grad));
    grad_accumulators_.push_back(std::move(acc));  // keeps the hooked accumulator alive
  }
  adamw_ = std::make_unique<AdamWGroups>(main_params_, s, decoupled, no_decay);
}

MixedPrecisionOptimizer::~MixedPrecisionOptimizer() = default;

void MixedPrecisionOptimizer::zero_grad() {
  for (auto& g : main_grads_) g.zero_();
}

bool MixedPrecisionOptimizer::unscale_and_check(const std::function<bool(bool)>& any_rank) {
  if (!scaler_) return false;
  at::NoGradGuard no_grad;
  // torch._amp_foreach_non_finite_check_and_unscale_: multiply by 1/scale, flag any inf/NaN.
  const double inv = scaler_->inv_scale();
  bool found_inf = false;
  for (auto& g : main_grads_) {
    g.mul_(inv);
    if (!found_inf && !at::isfinite(g).all().item<bool>()) found_inf = true;
  }
  found_inf = any_rank ? any_rank(found_inf) : found_inf;
  scaler_->update(found_inf);
  return found_inf;
}

void MixedPrecisionOptimizer::set_lr(double lr, std::optional<double> decoupled_lr) {
  adamw_->set_lr(lr, decoupled_lr);
}

at::Tensor MixedPrecisionOptimizer::model_view(size_t i) const {
  const at::Tensor p = model_params_[i].detach();
  return shards_ ? shards_->shard(p, i) : p;
}

void MixedPrecisionOptimizer::reload_main_params() {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < main_params_.size(); ++i) main_params_[i].copy_(model_view(i));
}

void MixedPrecisionOptimizer::step() {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < main_params_.size(); ++i) {
    // fp16 gradients (accumulate_allreduce_grads_in_fp32 off): main_param.grad = main_grad.float()
    if (main_grads_[i].scalar_type() != at::kFloat) {
      main_params_[i].mutable_grad() =
          (shards_ ? shards_->shard(main_grads_[i], i) : main_grads_[i]).to(at::kFloat);
    }
  }
  adamw_->adamw().step();
  for (size_t i = 0; i < main_params_.size(); ++i) {
    model_view(i).copy_(main_params_[i]);  // _copy_main_params_to_model_params
    if (main_grads_[i].scalar_type() != at::kFloat) main_params_[i].mutable_grad().reset();
  }
  // The distributed optimizer's all-gather: every rank's updated elements, everywhere.
  if (shards_) shards_->all_gather(model_params_);
}

}  // namespace actmem
