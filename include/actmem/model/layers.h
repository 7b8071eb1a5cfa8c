// layers.h — the building blocks of the model layer: norms, tensor-parallel linears, dropout, the
// precision helpers and the forward counters. The layer parts (layer_part.h: attention, MLA,
// Gated DeltaNet, the MLP, mixture of experts) and the GPT model (model.h) are built from these;
// none of them is included here.
#pragma once

#include "actmem/config/config.h"

#include <torch/nn/module.h>

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <utility>

namespace actmem {

class RngFork;
class Fp8Gemm;

class ActivationOffloader;

/// How many times each module's forward ran since reset() (recompute replays included), so
/// tests can count re-executions per strategy.
struct ForwardCounters {
  std::atomic<int64_t> layer{0}, core_attention{0}, mlp{0}, norm{0}, moe{0}, experts{0};
  void reset() { layer = core_attention = mlp = norm = moe = experts = 0; }
};
ForwardCounters& forward_counters();

/// True for bfloat16 and float16.
inline bool is_16bit(at::ScalarType t) {
  return t == at::kBFloat16 || t == at::kHalf;
}
/// The type 16-bit tensors are computed in where Megatron upcasts (norm statistics, the fp32
/// softmax, the loss): float for 16-bit types, the type itself otherwise.
inline at::ScalarType compute_dtype(at::ScalarType t) {
  return is_16bit(t) ? at::kFloat : t;
}
/// The parameter (and activation) type of `config`'s precision: float, bfloat16 or half.
at::ScalarType params_dtype(const TransformerConfig& config);

/// x * rsqrt(mean(x^2, -1) + eps) * weight as one autograd node (see Note [Fused RMSNorm] in
/// layers.cpp).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

/// How a parameter is held across ranks, as Megatron records it on the parameter itself
/// (tensor_model_parallel by set_tensor_model_parallel_attributes in
/// megatron/core/tensor_parallel/layers.py, sequence_parallel on norms and row-parallel biases,
/// allreduce=False on routed experts). Note [Parameter attributes] in model.cpp.
struct ParameterAttributes {
  /// Each tensor-parallel rank holds a different slice (column- or row-parallel weights, the
  /// column-parallel biases); only tensor rank 0's counts in the gradient norm.
  bool tensor_parallel = false;
  /// Replicated, but with sequence parallelism its gradient saw this rank's tokens only: summed
  /// over the tensor-parallel ranks after backward (norms, row-parallel biases, the router).
  bool sequence_parallel = false;
  /// A routed expert's: reduced over the expert-data-parallel group (set by GPTModel for every
  /// parameter below an Experts module).
  bool expert_parallel = false;
  /// Replicated, but each tensor-parallel rank's gradient covers its own heads only
  /// (a norm shared by the heads): summed over the tensor-parallel ranks after backward, with or
  /// without sequence parallelism.
  bool partial_over_heads = false;
};

/// A module that registers parameters says how each is held (Note [Parameter attributes] in
/// model.cpp): GPTModel::parameter_attributes() refuses a parameter no module declares.
class DeclaresParameters {
 public:
  virtual ~DeclaresParameters() = default;
  /// The attributes of parameter `name`, relative to this module: one it registered ("weight"),
  /// or one it registered on a plain child module ("linear_fc1.weight"); nullopt when the
  /// parameter is not this module's to declare.
  virtual std::optional<ParameterAttributes> parameter_attributes(
      const std::string& name) const = 0;
};

/// LayerNorm or RMSNorm over the last dimension, per config.normalization.
class Norm : public torch::nn::Module, public DeclaresParameters {
 public:
  /// Over `size` features (0: the hidden size).
  Norm(const TransformerConfig& config, at::ScalarType dtype, int64_t size = 0);
  at::Tensor forward(const at::Tensor& x);  // [..., h] -> [..., h]
  /// Replicated; with sequence parallelism each rank normalises its own tokens.
  std::optional<ParameterAttributes> parameter_attributes(const std::string& name) const override;
  at::Tensor weight;
  at::Tensor bias;  // undefined for RMSNorm
  /// Normalises per-head slices on each tensor-parallel rank (ParameterAttributes).
  bool partial_over_heads = false;

 private:
  bool rms_;
  bool zero_centered_gamma_;
  double eps_;
  bool sequence_parallel_;
};

/// How a Linear's weight is split across the tensor-parallel ranks (tensor_parallel.h).
enum class LinearParallel {
  kNone,    // replicated
  kColumn,  // ColumnParallelLinear: this rank holds out/t output rows (and bias entries)
  kRow,     // RowParallelLinear: this rank holds in/t input columns; output reduced across ranks
};

/// y = x W^T (+ b). With skip_bias_add the bias is returned separately for bias-dropout-add,
/// as Megatron's RowParallelLinear does for linear_proj and linear_fc2. `in` and `out` are this
/// rank's sizes. With sequence_parallel a column-parallel layer takes the [s/t, b, in] shard and
/// a row-parallel one returns it (all-gather / reduce-scatter at the boundary).
class Linear : public torch::nn::Module, public DeclaresParameters {
 public:
  Linear(int64_t in, int64_t out, bool bias, bool skip_bias_add, at::ScalarType dtype,
         LinearParallel parallel = LinearParallel::kNone, bool sequence_parallel = false);
  /// Returns the output and, when skip_bias_add, the bias to add later (else undefined).
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x);
  /// The weight is split unless replicated; a column-parallel bias is split, a row-parallel one
  /// replicated (added after the reduction) and, with sequence parallelism, sees this rank's
  /// tokens only.
  std::optional<ParameterAttributes> parameter_attributes(const std::string& name) const override;
  at::Tensor weight;  // [out, in]
  at::Tensor bias;    // [out] or undefined
  /// Runs the GEMM on FP8 operands under this state's recipe (fp8.h); null: in the parameters'
  /// type. Set by the layer part (PartModule::use_fp8) for the layers that run in FP8.
  std::shared_ptr<Fp8Gemm> fp8;
  /// Under FP8, keep the 16-bit input for the backward instead of its quantized copy (Megatron's
  /// set_save_original_input: the input is kept by someone else, or recomputed).
  bool fp8_save_original_input = false;

 private:
  bool skip_bias_add_;
  LinearParallel parallel_;
  bool sequence_parallel_;
};

/// residual + apply_dropout(x + bias), Megatron's bias-dropout-add.
at::Tensor bias_dropout_add(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& residual,
                            double p, bool training);

/// Dropout that saves a 1-byte mask, as the GPU kernel does (at::native_dropout);
/// identity when p == 0 or not training.
at::Tensor apply_dropout(const at::Tensor& x, double p, bool training);

/// Forks the model-parallel random stream for a module's dropout (Megatron's
/// get_cuda_rng_tracker().fork()); nullopt when that stream is already current, or when it was
/// never added and is not `required` (then it throws, naming `api`).
std::optional<RngFork> fork_model_parallel_rng(bool required, const char* api);

}  // namespace actmem
