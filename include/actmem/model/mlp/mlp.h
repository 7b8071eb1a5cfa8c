// mlp.h — Megatron's MLP (megatron/core/transformer/mlp.py): linear_fc1 (column-parallel) ->
// GeLU, or SwiGLU on fc1's [gate; up] halves -> linear_fc2 (row-parallel). The MLP part "mlp" of a
// dense layer, and the building block of the MoE layer's shared experts.
#pragma once

#include "actmem/config/activation_plan.h"
#include "actmem/config/config.h"
#include "actmem/model/layer_part.h"
#include "actmem/model/layers.h"

#include <memory>
#include <optional>
#include <string>
#include <utility>

namespace actmem {

class MLP : public PartModule, public DeclaresParameters {
 public:
  /// Of config.ffn() hidden columns (split over the tensor ranks); `plan` is the layer's when
  /// the MLP is a dense layer's part (selective "mlp" recompute), none inside an MoE layer.
  MLP(const TransformerConfig& config, at::ScalarType dtype, const LayerPlan& plan = LayerPlan{});
  /// x: [s, b, h] -> (output [s, b, h], linear_fc2 bias or undefined)
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x);
  /// As a dense layer's part: the MLP, in one checkpoint under selective "mlp" (training), which
  /// keeps only its input; fc2's bias is a parameter, not an activation, so it is returned beside
  /// the checkpoint as Megatron does.
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x, const LayerContext& ctx) override;
  /// fc1 (the rank's rows; both halves' with SwiGLU), then fc2 (its columns) at the residual
  /// projections' std.
  void init_weights(WeightInit& init) override;
  /// Its linears declare their own; the MoE layer registers the shared experts' gate_weight
  /// here (Megatron's name mlp.shared_experts.gate_weight): replicated, reading this rank's
  /// tokens.
  std::optional<ParameterAttributes> parameter_attributes(const std::string& name) const override;
  /// Under FP8, linear_fc1 keeps the norm's output instead of a quantized copy when selective
  /// layernorm recompute frees and recomputes it (fp8_keeps_recomputed_norm_output).
  void use_fp8(const std::shared_ptr<Fp8Registry>& registry) override;
  std::shared_ptr<Linear> linear_fc1;
  std::shared_ptr<Linear> linear_fc2;

 private:
  bool gated_;
  bool sequence_parallel_;
  LayerPlan plan_;
};

/// The MLP part "mlp" of a dense layer (Note [A layer part owns its contract] in layer_part.h).
const LayerPart& mlp_part();

}  // namespace actmem
