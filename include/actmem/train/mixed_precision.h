// mixed_precision.h — Megatron's mixed-precision training state: 16-bit model parameters, fp32
// main parameters and main-grad buffers, and the loss scalers (docs/mixed-precision.md).
//
// As Megatron-LM's Float16OptimizerWithFloat16Params (megatron/core/optimizer/optimizer.py) with
// its DistributedDataParallel main_grad buffers (megatron/core/distributed/): each model
// parameter's gradient is added into its main-grad buffer by a hook on the parameter's gradient
// accumulator as soon as backward produces it, and freed, so the 16-bit gradient of a parameter
// lives only between its accumulation and the hook; the step unscales the main gradients and
// checks them for inf/NaN (skipping the step on overflow), runs AdamW on the fp32 main
// parameters and copies them back, rounded, into the model.
#pragma once

#include "actmem/base/compat.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace torch::optim {
class AdamW;
}
namespace torch::autograd {
struct Node;
}

namespace actmem {

class OptimizerShards;

/// Megatron's ConstantGradScaler and DynamicGradScaler (megatron/core/optimizer/grad_scaler.py).
/// The scale is kept as an fp32 value, as Megatron keeps it in a float tensor.
class GradScaler {
 public:
  static GradScaler constant(double scale);
  /// Halves (backoff 0.5, floored at min_scale) after `hysteresis` overflows, doubles (growth 2)
  /// after `growth_interval` consecutive steps without one (the loss-scale window).
  static GradScaler dynamic(double initial_scale, double min_scale, int64_t growth_interval,
                            int64_t hysteresis);
  float scale() const { return scale_; }
  /// 1 / scale, computed in double and rounded to fp32 (Megatron's inv_scale).
  float inv_scale() const;
  bool is_dynamic() const { return dynamic_; }
  /// After each step: whether its gradients overflowed. A constant scaler ignores it.
  void update(bool found_inf);
  int64_t hysteresis_left() const { return hysteresis_tracker_; }
  int64_t growth_tracker() const { return growth_tracker_; }
  /// Restores what Megatron's DynamicGradScaler.load_state_dict restores (scale, growth and
  /// hysteresis trackers), from a checkpoint; the settings stay this scaler's.
  void load_state(float scale, int64_t growth_tracker, int64_t hysteresis_left);

 private:
  bool dynamic_ = false;
  float scale_ = 1.0f;
  float min_scale_ = 1.0f;
  int64_t growth_interval_ = 1000, hysteresis_ = 2;
  int64_t growth_tracker_ = 0, hysteresis_tracker_ = 2;
};

/// The AdamW hyper-parameters the optimizer is built with.
struct AdamWSettings {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
};

/// Megatron's parameter groups (_get_param_groups with get_standard_config_overrides in
/// megatron/core/optimizer/__init__.py): `params` in AdamW groups by two marks, each empty or one
/// per parameter. `decoupled` (the word embedding and output layer, with --decoupled-lr) takes
/// the decoupled learning rate; `no_decay` (the parameters Megatron gives wd_mult 0: 1-D ones,
/// i.e. biases and normalization weights) takes no weight decay. AdamW steps each parameter on
/// its own, so grouping changes no number beyond what the groups' settings say.
class AdamWGroups {
 public:
  AdamWGroups(const std::vector<at::Tensor>& params, const AdamWSettings& s,
              const std::vector<bool>& decoupled, const std::vector<bool>& no_decay = {});
  ~AdamWGroups();
  torch::optim::AdamW& adamw() { return *adamw_; }
  /// The learning rate of every group: `decoupled_lr` for the decoupled one (lr without it).
  void set_lr(double lr, std::optional<double> decoupled_lr);

 private:
  std::unique_ptr<torch::optim::AdamW> adamw_;
  std::vector<bool> group_decoupled_;
};

/// A libtorch build may lack the kernels of a 16-bit type on a device (libtorch 1.13, which actmem
/// once built on, had no float16 matmul, layer norm or softmax on CPU; 2.11 to 2.15 have them).
/// Runs one tiny instance of each operation the model uses at `dtype` on `device`; returns the
/// first error ("addmm_impl_cpu_" not implemented for 'Half'), or nullopt when all run.
std::optional<std::string> missing_kernel(at::ScalarType dtype, const at::Device& device);

class MixedPrecisionOptimizer {
 public:
  /// model_params: the model's 16-bit leaf parameters. grad_dtype: the main-grad buffers' type
  /// (float with accumulate_allreduce_grads_in_fp32, else the parameters' type). The hooks are
  /// installed here and live as long as this object. With `shards` (the distributed optimizer,
  /// distributed_optimizer.h; must outlive this object) the main parameters and AdamW's state
  /// cover this rank's elements only, and step() ends with the all-gather of the parameters.
  MixedPrecisionOptimizer(std::vector<at::Tensor> model_params, const AdamWSettings& settings,
                          at::ScalarType grad_dtype, std::optional<GradScaler> scaler,
                          const OptimizerShards* shards = nullptr,
                          const std::vector<bool>& decoupled = {},
                          const std::vector<bool>& no_decay = {});
  ~MixedPrecisionOptimizer();
  MixedPrecisionOptimizer(const MixedPrecisionOptimizer&) = delete;
  MixedPrecisionOptimizer& operator=(const MixedPrecisionOptimizer&) = delete;

  /// The main-grad buffers, one per model parameter (what reductions, the norm, the clip and the
  /// digest work on).
  const std::vector<at::Tensor>& main_grads() const { return main_grads_; }
  /// The fp32 main parameters the optimizer steps: one per model parameter, shaped like it, or
  /// with the distributed optimizer this rank's elements of it (1-D, possibly empty).
  const std::vector<at::Tensor>& main_params() const { return main_params_; }
  /// Main parameters := model parameters (Megatron's reload_model_params).
  void reload_main_params();
  const OptimizerShards* shards() const { return shards_; }
  void zero_grad();
  /// The loss multiplier for backward: the scaler's scale, or 1 without one.
  double loss_scale() const { return scaler_ ? scaler_->scale() : 1.0f; }
  const std::optional<GradScaler>& scaler() const { return scaler_; }
  std::optional<GradScaler>& scaler() { return scaler_; }
  /// The AdamW that steps main_params() (its per-parameter state is what a checkpoint keeps).
  torch::optim::AdamW& adamw() { return adamw_->adamw(); }
  /// With a scaler: multiplies the main gradients by 1/scale and returns whether any is inf or
  /// NaN on any rank (`found_inf_any_rank` reduces the local flag, e.g. a max over the
  /// tensor-parallel group), then updates the scaler. Without one: false.
  bool unscale_and_check(const std::function<bool(bool)>& found_inf_any_rank);
  void set_lr(double lr, std::optional<double> decoupled_lr = std::nullopt);
  /// AdamW on the main parameters, then main -> model parameters (rounded to 16 bits).
  void step();

 private:
  /// Model parameter i's elements the main parameter i mirrors (all, or this rank's shard).
  at::Tensor model_view(size_t i) const;
  std::vector<at::Tensor> model_params_, main_params_, main_grads_;
  std::vector<compat::NodePtr> grad_accumulators_;
  std::unique_ptr<AdamWGroups> adamw_;
  std::optional<GradScaler> scaler_;
  const OptimizerShards* shards_ = nullptr;
};

}  // namespace actmem
