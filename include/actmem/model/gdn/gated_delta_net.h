// gated_delta_net.h — Megatron-LM's GatedDeltaNet layer (megatron/core/ssm/gated_delta_net/gdn.py
// and common.py), the linear-attention layer of hybrid models such as Qwen3-Next:
//
//   in_proj (column-parallel, h -> [q | k | v | z | beta | alpha] per rank)
//   -> causal depthwise conv1d over [q | k | v] -> silu
//   -> L2-normalised q, k (key heads repeated to the value heads); g = -exp(A_log) softplus(alpha
//      + dt_bias) in fp32; beta = sigmoid(beta)
//   -> the gated delta rule (gated_delta_rule.h, chunked, one autograd node)
//   -> out_norm (per value head, over linear_value_head_dim) times silu(z), the output gate
//   -> out_proj (row-parallel, back to h)
//
// Note [GatedDeltaNet as actmem builds it]
// - Layout and names as Megatron's: in_proj.weight holds, per tensor-parallel rank, its slice of
//   each of the six sections in that order (Megatron's in_proj_split_sections; its distributed
//   checkpoint splits the weight into query, key, value, z, beta, alpha); conv1d.weight
//   [conv_dim / t, 1, K] its slices of q, k, v; A_log, dt_bias [num_value_heads / t];
//   out_norm.weight [value_head_dim]; out_proj.weight [h, v_dim / t]. Neither linear has a bias
//   (Megatron builds both with bias=False), the convolution neither (conv_bias=False).
// - The input norm is the layer's input_layernorm (actmem's modules are Megatron's local spec;
//   Megatron's only GDN spec fuses it into in_proj as TELayerNormColumnParallelLinear, whose
//   weight it names self_attention.in_proj.layer_norm_weight).
// - The convolution is Megatron's torch path (deterministic_mode: F.conv1d with K - 1 padding
//   on both sides, the first s outputs, then silu); FLA's causal_conv1d computes the same.
// - The rule is the chunked form in one autograd node keeping its inputs (Note [One node for the
//   gated delta rule]); Megatron's deterministic path (torch_chunk_gated_delta_rule) keeps every
//   intermediate, FLA's kernel its inputs and per-chunk solutions.
// - L2 normalisation is one node as FLA's l2norm (y = x / sqrt(sum x^2 + 1e-6) in fp32, keeping
//   y and 1/sqrt(...) for the backward).
// - gdn_norm_out recompute (Megatron's recompute_norm_out): the gated norm runs in a
//   CheckpointWithoutOutput whose output (out_proj's input) is freed after out_proj saved it and
//   rebuilt from the gradient hook of out_proj's output; the checkpoint keeps the rule's output
//   and the gate. Megatron's also spans the context-parallel all-to-all; actmem has no context
//   parallelism.
// - out_norm's weight is shared by every head, and each tensor-parallel rank normalises its own
//   heads, so its gradient is a partial sum on each rank: actmem sums it over the tensor-parallel
//   ranks (ParameterAttributes::partial_over_heads). Megatron sums it only under sequence
//   parallelism (TENorm's sequence_parallel attribute; finalize_model_grads.py's
//   _allreduce_non_tensor_model_parallel_grads), so without it each rank keeps its own partial
//   gradient and the ranks' copies drift apart (fixed here).
#pragma once

#include "actmem/config/activation_plan.h"
#include "actmem/config/config.h"
#include "actmem/model/layer_part.h"
#include "actmem/model/layers.h"

#include <torch/nn/module.h>

#include <array>
#include <memory>
#include <utility>

namespace actmem {

/// FLA's l2norm over the last dimension as one autograd node: x / sqrt(sum(x^2) + eps) computed
/// in fp32 (the dtype itself for double), returned in x's dtype; keeps its output and the fp32
/// reciprocal norms [..., 1] for the backward.
at::Tensor l2norm(const at::Tensor& x, double eps = 1e-6);

class GatedDeltaNet : public PartModule, public DeclaresParameters {
 public:
  GatedDeltaNet(const TransformerConfig& config, const LayerPlan& plan, at::ScalarType dtype);
  /// x: [s, b, h] (the [s/t, b, h] shard under sequence parallelism) -> (output, undefined
  /// bias), as SelfAttention returns them.
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x, const LayerContext& ctx) override;
  /// Megatron's order: in_proj, conv1d (nn.Conv1d's default: uniform +-1/sqrt(K)), A_log =
  /// log(uniform(1, 16)) (A_init_range), out_proj; dt_bias and out_norm's weight stay the ones
  /// they were built with. Each rank keeps its slice of every section.
  void init_weights(WeightInit& init) override;
  /// Refused: generation would carry the recurrent state and the convolution's last K - 1
  /// inputs instead of a key/value cache, which is not implemented.
  std::unique_ptr<DecodeState> make_decode_state(int64_t capacity,
                                                 const at::TensorOptions& options) const override;
  /// conv1d.weight, A_log and dt_bias hold this rank's heads.
  std::optional<ParameterAttributes> parameter_attributes(const std::string& name) const override;

  std::shared_ptr<Linear> in_proj;
  at::Tensor conv1d_weight;  // [conv_dim / t, 1, K], registered as conv1d.weight
  at::Tensor A_log;          // [num_value_heads / t]
  at::Tensor dt_bias;        // [num_value_heads / t]
  std::shared_ptr<Norm> out_norm;
  std::shared_ptr<Linear> out_proj;

  /// This rank's section sizes of in_proj's output: q, k, v, z, beta, alpha.
  std::array<int64_t, 6> in_proj_sections() const;

 private:
  // The gated output norm: out_norm(o) * silu(z) in fp32, back to o's dtype, as [s, b, v_dim/t].
  at::Tensor gated_norm(const at::Tensor& o, const at::Tensor& z) const;
  int64_t key_heads_, value_heads_, key_dim_, value_dim_, kernel_;  // this rank's heads
  LayerPlan plan_;
};

/// The mixer part "gdn" (Note [A layer part owns its contract] in layer_part.h).
const LayerPart& gated_delta_net_part();

}  // namespace actmem
