// layers.cpp — the model layer's building blocks (layers.h): norms, linears, dropout.
#include "actmem/model/layers.h"

#include "actmem/model/fp8.h"
#include "actmem/parallel/tensor_parallel.h"
#include "actmem/recompute/rng.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/autograd.h>

namespace actmem {

std::optional<RngFork> fork_model_parallel_rng(bool required, const char* api) {
  auto& tracker = get_rng_tracker();
  if (tracker.current_state_name() == kModelParallelRng) return std::nullopt;
  if (!tracker.has(kModelParallelRng)) {
    TORCH_CHECK(!required, api,
                " needs the model-parallel random stream (call "
                "model_parallel_manual_seed first)");
    return std::nullopt;
  }
  return tracker.fork(kModelParallelRng);
}

ForwardCounters& forward_counters() {
  static ForwardCounters counters;
  return counters;
}

// ---- Norm -------------------------------------------------------------------------------------

Norm::Norm(const TransformerConfig& config, at::ScalarType dtype, int64_t size)
    : rms_(config.use_rmsnorm()),
      zero_centered_gamma_(config.layernorm_zero_centered_gamma),
      eps_(config.layernorm_epsilon),
      sequence_parallel_(config.sequence_parallel) {
  const auto opts = at::TensorOptions().dtype(dtype);
  const int64_t n = size > 0 ? size : config.hidden_size;
  // Zero-centred gamma (--apply-layernorm-1p): the norm multiplies by 1 + weight, so the weight
  // starts at zero (Megatron's FusedLayerNorm.reset_parameters; TENorm's zero_centered_gamma).
  weight = register_parameter("weight",
                              zero_centered_gamma_ ? at::zeros({n}, opts) : at::ones({n}, opts));
  if (!rms_) bias = register_parameter("bias", at::zeros({n}, opts));
}

std::optional<ParameterAttributes> Norm::parameter_attributes(const std::string& name) const {
  if (name != "weight" && name != "bias") return std::nullopt;
  return ParameterAttributes{false, sequence_parallel_, false, partial_over_heads};
}

namespace {
// Note [Fused RMSNorm]
// RMSNorm written as x * rsqrt(mean(x^2) + eps) * w uses x twice, so x's gradient arrives as two
// contributions that autograd adds to the residual's contribution in whatever order the graph
// produces them. Output-discarding recompute of the norm sums the two norm contributions first,
// which rounds differently. One node with an explicit backward (as fused GPU kernels have) gives
// x a single contribution, so every strategy sums the same two terms and stays bitwise exact.
// At 16 bits the norm computes in fp32 and keeps rstd in fp32 (sb * 4 bytes), as the fused
// kernels Megatron uses do; the input and output stay 16-bit.
struct RMSNormFunction : torch::autograd::Function<RMSNormFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, double eps) {
    const at::ScalarType acc = compute_dtype(x.scalar_type());
    const at::Tensor xa = x.to(acc);
    const at::Tensor rstd = at::rsqrt(xa.pow(2).mean({-1}, /*keepdim=*/true) + eps);  // [..., 1]
    ctx->save_for_backward({x, weight, rstd});
    return (xa * rstd * weight.to(acc)).to(x.scalar_type());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x16 = saved[0], &weight16 = saved[1], &rstd = saved[2];
    const at::ScalarType acc = rstd.scalar_type();
    const at::Tensor x = x16.to(acc), weight = weight16.to(acc), g = grads[0].to(acc);
    const at::Tensor gw = g * weight;
    // d/dx_j: rstd * gw_j - x_j * rstd^3 * mean_i(gw_i * x_i)
    const at::Tensor dx = rstd * gw - x * rstd.pow(3) * (gw * x).mean({-1}, /*keepdim=*/true);
    const at::Tensor dw = (g * x * rstd).reshape({-1, x.size(-1)}).sum(0);
    return {dx.to(x16.scalar_type()), dw.to(weight16.scalar_type()), at::Tensor()};
  }
};

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  RECORD_FUNCTION("actmem::rms_norm", std::vector<c10::IValue>());
  return RMSNormFunction::apply(x, weight, eps);
}

at::Tensor Norm::forward(const at::Tensor& x) {
  forward_counters().norm.fetch_add(1, std::memory_order_relaxed);
  // Zero-centred: the scale 1 + weight is a new [n] tensor the norm's backward keeps (n e bytes
  // per call, Note [What this model saves]), as Megatron's `self.weight + 1` in
  // FusedLayerNorm.forward.
  const at::Tensor scale = zero_centered_gamma_ ? weight + 1 : weight;
  if (!rms_) return at::layer_norm(x, {x.size(-1)}, scale, bias, eps_);
  return rms_norm(x, scale, eps_);
}

// ---- Linear -----------------------------------------------------------------------------------

Linear::Linear(int64_t in, int64_t out, bool bias_on, bool skip_bias_add, at::ScalarType dtype,
               LinearParallel parallel, bool sequence_parallel)
    : skip_bias_add_(skip_bias_add), parallel_(parallel), sequence_parallel_(sequence_parallel) {
  // The caller re-initialises weight with the right std; zeros here keep construction cheap.
  weight = register_parameter("weight", at::zeros({out, in}, at::TensorOptions().dtype(dtype)));
  if (bias_on)
    bias = register_parameter("bias", at::zeros({out}, at::TensorOptions().dtype(dtype)));
}

std::optional<ParameterAttributes> Linear::parameter_attributes(const std::string& name) const {
  // A replicated weight reading a sequence-parallel input (MLA's down projections, Megatron's
  // duplicated TELinear) saw this rank's tokens only.
  if (name == "weight") {
    return ParameterAttributes{parallel_ != LinearParallel::kNone,
                               parallel_ == LinearParallel::kNone && sequence_parallel_, false};
  }
  if (name == "bias") {
    return ParameterAttributes{parallel_ == LinearParallel::kColumn,
                               parallel_ == LinearParallel::kRow && sequence_parallel_, false};
  }
  return std::nullopt;
}

std::pair<at::Tensor, at::Tensor> Linear::forward(const at::Tensor& x) {
  if (fp8) {
    // One process so far (TransformerConfig refuses FP8 with tensor parallelism): the column-
    // and row-parallel layers are the whole GEMM.
    TORCH_CHECK(parallel_ == LinearParallel::kNone || tensor_parallel_group().size == 1,
                "actmem::Linear: FP8 GEMMs run without tensor parallelism so far");
    const at::Tensor y =
        fp8_linear(x, weight, skip_bias_add_ ? at::Tensor() : bias, *fp8, fp8_save_original_input);
    return {y, skip_bias_add_ ? bias : at::Tensor()};
  }
  switch (parallel_) {
    case LinearParallel::kColumn:
      if (skip_bias_add_)
        return {column_parallel_linear(x, weight, at::Tensor(), sequence_parallel_), bias};
      return {column_parallel_linear(x, weight, bias, sequence_parallel_), at::Tensor()};
    case LinearParallel::kRow: {
      // The bias is added after the reduction (once, not once per rank).
      at::Tensor out = row_parallel_linear(x, weight, sequence_parallel_);
      if (skip_bias_add_) return {out, bias};
      return {bias.defined() ? out + bias : out, at::Tensor()};
    }
    case LinearParallel::kNone:
      break;
  }
  if (skip_bias_add_) return {at::linear(x, weight), bias};
  return {at::linear(x, weight, bias), at::Tensor()};
}

// ---- dropout helpers --------------------------------------------------------------------------

at::Tensor apply_dropout(const at::Tensor& x, double p, bool training) {
  if (!training || p == 0.0) return x;
  // native_dropout saves a bool mask (1 byte per element) like the CUDA kernel; at::dropout on
  // CPU would save a float noise tensor instead.
  return std::get<0>(at::native_dropout(x, p, /*train=*/true));
}

at::Tensor bias_dropout_add(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& residual,
                            double p, bool training) {
  const at::Tensor biased = bias.defined() ? x + bias : x;
  return residual + apply_dropout(biased, p, training);
}

at::ScalarType params_dtype(const TransformerConfig& config) {
  return config.bf16 ? at::kBFloat16 : config.fp16 ? at::kHalf : at::kFloat;
}

}  // namespace actmem
