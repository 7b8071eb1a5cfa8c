// mlp.cpp — Megatron's MLP (mlp.h).
#include "actmem/model/mlp/mlp.h"

#include "actmem/memory/ledger.h"
#include "actmem/model/fp8.h"
#include "actmem/model/weight_init.h"
#include "actmem/recompute/recompute.h"

#include <ATen/ATen.h>

namespace actmem {

MLP::MLP(const TransformerConfig& config, at::ScalarType dtype, const LayerPlan& plan)
    : gated_(config.gated_linear_unit), sequence_parallel_(config.sequence_parallel), plan_(plan) {
  const int64_t h = config.hidden_size, t = config.tensor_model_parallel_size;
  const int64_t f = config.ffn() / t;  // this rank's share of the MLP's hidden columns
  const bool sp = config.sequence_parallel;
  linear_fc1 = register_module(
      "linear_fc1", std::make_shared<Linear>(h, gated_ ? 2 * f : f, config.add_bias_linear, false,
                                             dtype, LinearParallel::kColumn, sp));
  linear_fc2 =
      register_module("linear_fc2", std::make_shared<Linear>(f, h, config.add_bias_linear, true,
                                                             dtype, LinearParallel::kRow, sp));
}

std::optional<ParameterAttributes> MLP::parameter_attributes(const std::string& name) const {
  if (name != "gate_weight") return std::nullopt;
  return ParameterAttributes{false, sequence_parallel_, false};
}

std::pair<at::Tensor, at::Tensor> MLP::forward(const at::Tensor& x) {
  forward_counters().mlp.fetch_add(1, std::memory_order_relaxed);
  at::Tensor fc1, act;
  {
    ModuleScope scope("linear_fc1");
    fc1 = linear_fc1->forward(x).first;  // [s, b, f] or [s, b, 2f]
  }
  {
    ModuleScope scope("activation_func");
    if (gated_) {
      const auto halves = fc1.chunk(2, -1);
      act = at::silu(halves[0]) * halves[1];
    } else {
      act = at::gelu(fc1);
    }
  }
  ModuleScope scope("linear_fc2");
  return linear_fc2->forward(act);
}

std::pair<at::Tensor, at::Tensor> MLP::forward(const at::Tensor& x, const LayerContext&) {
  if (plan_.recomputes(RecomputeModule::kMlp) && is_training()) {
    const at::Tensor out = checkpoint(
        [this](const TensorList& in) { return TensorList{forward(in[0]).first}; }, false, {x})[0];
    return {out, linear_fc2->bias};
  }
  return forward(x);
}

void MLP::use_fp8(const std::shared_ptr<Fp8Registry>& registry) {
  PartModule::use_fp8(registry);
  linear_fc1->fp8_save_original_input =
      fp8_keeps_recomputed_norm_output(registry->recipe().delayed, plan_);
}

void MLP::init_weights(WeightInit& init) {
  const int64_t t = init.tp_size(), h = linear_fc1->weight.size(1);
  const int64_t f = linear_fc2->weight.size(1) * t;
  linear_fc1->weight.copy_(init.fc1_rows(init.normal({gated_ ? 2 * f : f, h}, init.std()), gated_));
  linear_fc2->weight.copy_(init.cols(init.normal({h, f}, init.scaled_std())));
}

}  // namespace actmem
