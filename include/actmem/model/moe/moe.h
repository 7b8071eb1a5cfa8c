// moe.h — the mixture-of-experts layer in Megatron-LM's structure and parameter names
// (megatron/core/transformer/moe/: router.py, token_dispatcher.py, experts.py, shared_experts.py,
// moe_layer.py; docs/moe.md):
//
//   h [s, b, h] -> shared_experts(h)                                    (optional, un-routed)
//               -> router: logits = h W^T, top-k scores -> probs [T, E], routing map [T, E]
//                  (z-loss on the logits, Switch load-balancing loss on the probs, capacity)
//               -> dispatch: the tokens of each expert gathered, expert-major [N, h]
//               -> experts: fc1, activation x prob (the routing weight applied before fc2), fc2
//               -> combine: each token's expert outputs summed back into [T, h]
//               -> + shared-expert output
//
// The MoE layer stands where a dense layer's MLP stands (mlp.router.weight,
// mlp.experts.local_experts.j.linear_fc1.weight or, with --moe-grouped-gemm,
// mlp.experts.linear_fc1.weight{j}, mlp.shared_experts.linear_fc1.weight). Its recompute
// (moe, moe_act, shared_experts) and offload groups (expert_fc1, moe_act) follow the layer's
// LayerPlan (activation_plan.h).
#pragma once

#include "actmem/config/activation_plan.h"
#include "actmem/config/config.h"
#include "actmem/model/layer_part.h"
#include "actmem/model/layers.h"
#include "actmem/model/moe/moe_rows.h"

#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace actmem {

class ActivationOffloader;
class MLP;

/// What the MoE layers of a model measured since reset(); the trainer reads and resets it once
/// per optimizer step. Recompute replays do not count twice.
struct MoEStats {
  struct Layer {
    int64_t layer_number = 0;  // 1-based, as Megatron's logs
    /// Rows each of this rank's experts computed in the first training forward since reset():
    /// the routing the exact predictor takes for this layer (moe_rows.h).
    std::vector<int64_t> tokens_per_expert;
    /// Rows this rank's router sent to the experts in that forward (differs from the sum of
    /// tokens_per_expert only with expert parallelism, whose experts compute every rank's rows).
    int64_t dispatched_rows = -1;
    /// tokens_per_expert and dispatched_rows of the latest training forward.
    std::vector<int64_t> last_tokens_per_expert;
    int64_t last_dispatched_rows = -1;
    /// Token-expert pairs the router chose per expert, summed over the step (before capacity).
    std::vector<int64_t> routed_per_expert;
    int64_t routed = 0;   // token-expert pairs chosen, summed over the step's forwards
    int64_t dropped = 0;  // of them, dropped by the expert capacity
    /// Sums over the forwards that attached the loss (training with grad): the Switch load-
    /// balancing loss divided by its coefficient (E * sum_i f_i P_i, 1 when balanced) and the
    /// z-loss divided by its coefficient; Megatron logs the same unscaled values.
    double load_balancing_loss = 0.0;
    int64_t load_balancing_count = 0;
    double z_loss = 0.0;
    int64_t z_loss_count = 0;
  };
  std::vector<Layer> layers;  // one per MoE layer, in layer order
  void reset();
  /// Mean over MoE layers of each layer's mean (Megatron's logged load_balancing_loss); NaN when
  /// no forward attached it.
  double mean_load_balancing_loss() const;
  double mean_z_loss() const;
  /// Over all MoE layers: the busiest expert's routed pairs over the mean (1 = balanced).
  double max_load_imbalance() const;
  int64_t total_dropped() const;
  int64_t total_routed() const;
  /// tokens_per_expert and dispatched_rows of every MoE layer, in layer order.
  MoERouting routing() const;
  /// The same for the latest training forward (the trainer predicts each micro-batch from it).
  MoERouting last_routing() const;
};

/// Megatron's MoEAuxLossAutoScaler: returns `output` unchanged and, in backward, gives `aux_loss`
/// the gradient `scale` (the main loss's scale over its micro-batches), so the auxiliary loss
/// trains the router without being added to the reported loss.
at::Tensor attach_aux_loss(const at::Tensor& output, const at::Tensor& aux_loss, double scale);

/// The router's decision for T tokens over E experts.
struct Routing {
  at::Tensor probs;  // [T, E]: the routing weight of every kept token-expert pair, 0 elsewhere
  at::Tensor routing_map;  // [T, E] bool: the pairs the experts compute (with padding: all rows)
  int64_t routed = 0;      // pairs the top-k chose
  int64_t dropped = 0;     // of them, dropped by the capacity
  std::vector<int64_t> routed_per_expert;  // the top-k's choices per expert
};

/// Megatron's TopKRouter (moe/router.py, moe/moe_utils.py): mlp.router.weight [E, h] (and
/// mlp.router.bias [E] with add_bias_linear).
class TopKRouter : public torch::nn::Module, public DeclaresParameters {
 public:
  TopKRouter(const TransformerConfig& config, at::ScalarType dtype);
  /// h: [T, h], the tokens of [s, b] flattened sequence-first (T = s * batch_size). The z-loss
  /// and the load-balancing loss are attached (attach_aux_loss) only in training with grad
  /// enabled, as in Megatron; `aux_scale` is their backward scale and `stats` (may be null)
  /// receives their unscaled values. seq_aux_loss balances each of the batch_size sequences.
  Routing forward(const at::Tensor& h, double aux_scale, MoEStats::Layer* stats,
                  int64_t batch_size = 1);
  /// Replicated; with sequence parallelism each rank routes its own tokens.
  std::optional<ParameterAttributes> parameter_attributes(const std::string& name) const override;
  at::Tensor weight;
  at::Tensor bias;  // undefined without add_bias_linear

 private:
  // forward()'s steps: the gating logits [T, E], the top-k probabilities and experts of each
  // token, the capacity's drops (routing_map narrowed), the load-balancing loss (unscaled).
  at::Tensor gating_logits(const at::Tensor& h) const;
  std::pair<at::Tensor, at::Tensor> top_k(const at::Tensor& logits) const;
  void drop_over_capacity(Routing& r, at::Tensor& routing_map) const;
  at::Tensor load_balancing_loss(const at::Tensor& logits, int64_t batch_size) const;
  TransformerConfig config_;
};

/// One expert of SequentialMLP (mlp.experts.local_experts.j): linear_fc1 and linear_fc2.
class ExpertMLP : public torch::nn::Module, public DeclaresParameters {
 public:
  ExpertMLP(int64_t hidden, int64_t ffn, bool gated, bool bias, at::ScalarType dtype);
  /// As an MLP's: fc1 column-parallel, fc2's weight row-parallel, its bias replicated (added by
  /// tensor rank 0 only, so a sequence-parallel sum).
  std::optional<ParameterAttributes> parameter_attributes(const std::string& name) const override;
  at::Tensor fc1_weight, fc1_bias, fc2_weight,
      fc2_bias;  // biases undefined without add_bias_linear
};

/// TE's GroupedLinear naming (mlp.experts.linear_fc1.weight0, .weight1, ...): one weight (and
/// bias) per expert, applied to consecutive row segments of one input.
class GroupedLinear : public torch::nn::Module, public DeclaresParameters {
 public:
  /// `parallel`: column (fc1) or row (fc2), as the experts' linears split over the tensor ranks.
  GroupedLinear(int64_t experts, int64_t in, int64_t out, bool bias, at::ScalarType dtype,
                LinearParallel parallel);
  /// weightJ as a Linear's weight, biasJ as its bias (Linear::parameter_attributes).
  std::optional<ParameterAttributes> parameter_attributes(const std::string& name) const override;
  /// x: [N, in], rows grouped by expert (counts[j] rows for expert j) -> [N, out]; biases added
  /// when `with_bias`.
  at::Tensor forward(const at::Tensor& x, const std::vector<int64_t>& counts, bool with_bias);
  std::vector<at::Tensor> weights, biases;

 private:
  LinearParallel parallel_;
};

/// The experts of one MoE layer: SequentialMLP (one MLP per expert) or, with moe_grouped_gemm,
/// the grouped form (TEGroupedMLP: one fc1 over all permuted tokens, the activation times the
/// routing probabilities, one fc2).
class Experts : public torch::nn::Module {
 public:
  Experts(const TransformerConfig& config, const LayerPlan& plan, at::ScalarType dtype);
  /// x: [N, h] permuted tokens, counts: rows per expert, probs: [N] -> [N, h] (each row already
  /// weighted by its probability; fc2's bias is added times the probability).
  at::Tensor forward(const at::Tensor& x, const std::vector<int64_t>& counts,
                     const at::Tensor& probs, ActivationOffloader* offloader);
  std::vector<std::shared_ptr<ExpertMLP>> local_experts;  // SequentialMLP
  std::shared_ptr<GroupedLinear> linear_fc1, linear_fc2;  // grouped

 private:
  /// act(fc1) * prob (and actmem's expert dropout): the region moe_act recomputes.
  at::Tensor activation(const at::Tensor& fc1, const at::Tensor& probs) const;
  at::Tensor forward_grouped(const at::Tensor& x, const std::vector<int64_t>& counts,
                             const at::Tensor& probs, ActivationOffloader* offloader);
  bool gated_, grouped_, bias_;
  // fc2's bias is added once per token: by tensor rank 0 when the experts' fc2 products are
  // partial sums over the tensor ranks (its gradient is summed over them, as a sequence-parallel
  // parameter's).
  bool fc2_bias_here_ = true;
  double dropout_;
  int64_t ep_size_;
  LayerPlan plan_;
};

/// Megatron's MoELayer: router, token dispatch, experts, combine and shared experts. The MLP
/// part "moe".
class MoELayer : public PartModule {
 public:
  MoELayer(const TransformerConfig& config, const LayerPlan& plan, int64_t layer_number,
           at::ScalarType dtype);
  /// x: [s, b, h] (the pre-MLP norm's output) -> (output [s, b, h], undefined bias), as an MLP.
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x, ActivationOffloader* offloader);
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x, const LayerContext& ctx) override {
    return forward(x, ctx.offloader);
  }
  /// The router, then every expert in order (fc1 then fc2 of each: every expert-parallel rank
  /// draws all E and keeps its own E/e, and of them its tensor rank's slice), then the shared
  /// experts (fc1, fc2, gate); the fc2 layers at the residual projections' std, as Megatron's
  /// MLP.
  void init_weights(WeightInit& init) override;
  /// Appends this layer's entry to `stats`, where each forward reports its routing and losses.
  void bind_stats(MoEStats& stats) override;
  /// The aux losses' backward scale; set by GPTModel before each step.
  void set_aux_loss_scale(double scale) override { aux_scale_ = scale; }
  int64_t layer_number() const { return layer_number_; }

  std::shared_ptr<TopKRouter> router;
  std::shared_ptr<Experts> experts;
  std::shared_ptr<MLP> shared_experts;  // null without shared experts
  at::Tensor shared_expert_gate;        // [1, h] with moe_shared_expert_gate (named gate_weight)

 private:
  at::Tensor compute(const at::Tensor& x, ActivationOffloader* offloader);
  at::Tensor run_shared_experts(const at::Tensor& x);
  TransformerConfig config_;
  LayerPlan plan_;
  int64_t layer_number_;
  // This layer's entry of the model's MoEStats (an index: the vector may grow while the layers
  // bind).
  MoEStats::Layer* stats() const {
    return stats_ == nullptr ? nullptr : &stats_->layers[stats_index_];
  }
  MoEStats* stats_ = nullptr;
  size_t stats_index_ = 0;
  double aux_scale_ = 1.0;
};

/// One MoE layer's activation bytes for one micro-batch at 16 bits (fp32 router scores, 8-byte
/// indices), per tensor-parallel rank with sequence parallelism (Megatron requires it for MoE
/// with t > 1; the all-gather dispatcher gives every rank all N rows, each expert's columns split
/// t ways). Megatron's theoretical_memory_usage counts every layer as dense (Megatron-LM's known
/// gap); these are the terms of Note [What an MoE layer saves] in moe_part.cpp, which the
/// exact predictor checks against the tracker:
///   router   (input 2sbh + top-k indices 8sbk + top-k softmax 4sbk + load-balancing scores
///            4sbE + counts 4E + z-loss logits 4sbE + logsumexp 4sb + capacity mask sbE) / t
///   dispatch index vectors 16N, permuted probabilities 2N, permuted tokens 2Nh
///   experts  GeLU 6Nf (fc1 output, GeLU output, fc2 input), SwiGLU 10Nf, over t
///   shared   GeLU 4sb*fs, SwiGLU 8sb*fs, over t
/// with N = sbk dropless, E*min(capacity, sb) padded, at most min(sbk, E*capacity) otherwise
/// (taken as that bound). `layer` is the whole layer: the attention half as the paper's
/// sbh(13 + 5as/h) (13sbh with selective core_attn recompute), the pre-MLP norm 2sbh and the
/// residual dropout mask sbh, all over t; full recompute keeps 2sbh/t.
struct MoELayerBytes {
  double rows = 0;  // N
  double router = 0, dispatch = 0, experts = 0, shared = 0;
  LayerBytes layer;
  double mlp() const { return router + dispatch + experts + shared; }
};
MoELayerBytes paper_moe_layer_bytes(const PaperShape& m);

/// The MLP part "moe" (Note [A layer part owns its contract] in layer_part.h).
const LayerPart& moe_part();

}  // namespace actmem
