// moe.cpp — the MoE layer (moe.h). Shapes: T tokens (s * b), E experts, k = topk, N rows the
// experts compute (T * k dropless), h hidden, f each expert's hidden size.
#include "actmem/model/moe/moe.h"

#include "actmem/memory/ledger.h"
#include "actmem/model/layers.h"
#include "actmem/model/mlp/mlp.h"
#include "actmem/model/weight_init.h"
#include "actmem/offload/activation_offloader.h"
#include "actmem/parallel/moe_dispatch.h"
#include "actmem/parallel/tensor_parallel.h"
#include "actmem/recompute/recompute.h"
#include "actmem/recompute/rng.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cmath>
#include <limits>
#include <numeric>
#include <optional>

namespace actmem {

// ---- MoEStats ---------------------------------------------------------------------------------

void MoEStats::reset() {
  for (auto& l : layers) {
    const int64_t number = l.layer_number;
    l = Layer{};
    l.layer_number = number;
  }
}

namespace {
// Mean over the layers that attached a loss of each layer's mean (Megatron's aggregation); NaN
// when none did.
double mean_over_layers(const std::vector<MoEStats::Layer>& layers, double MoEStats::Layer::*sum,
                        int64_t MoEStats::Layer::*count) {
  double total = 0.0;
  int64_t n = 0;
  for (const auto& l : layers) {
    if (l.*count == 0) continue;
    total += l.*sum / static_cast<double>(l.*count);
    ++n;
  }
  return n == 0 ? std::numeric_limits<double>::quiet_NaN() : total / static_cast<double>(n);
}
}  // namespace

double MoEStats::mean_load_balancing_loss() const {
  return mean_over_layers(layers, &Layer::load_balancing_loss, &Layer::load_balancing_count);
}

double MoEStats::mean_z_loss() const {
  return mean_over_layers(layers, &Layer::z_loss, &Layer::z_loss_count);
}

double MoEStats::max_load_imbalance() const {
  double worst = std::numeric_limits<double>::quiet_NaN();
  for (const auto& l : layers) {
    if (l.routed_per_expert.empty()) continue;
    const int64_t total =
        std::accumulate(l.routed_per_expert.begin(), l.routed_per_expert.end(), int64_t{0});
    if (total == 0) continue;
    const int64_t busiest =
        *std::max_element(l.routed_per_expert.begin(), l.routed_per_expert.end());
    const double mean =
        static_cast<double>(total) / static_cast<double>(l.routed_per_expert.size());
    const double ratio = static_cast<double>(busiest) / mean;
    if (!(ratio <= worst)) worst = ratio;  // also replaces the initial NaN
  }
  return worst;
}

int64_t MoEStats::total_dropped() const {
  int64_t n = 0;
  for (const auto& l : layers) n += l.dropped;
  return n;
}

int64_t MoEStats::total_routed() const {
  int64_t n = 0;
  for (const auto& l : layers) n += l.routed;
  return n;
}

MoERouting MoEStats::routing() const {
  MoERouting out;
  for (const auto& l : layers) out.emplace_back(l.tokens_per_expert, l.dispatched_rows);
  return out;
}

MoERouting MoEStats::last_routing() const {
  MoERouting out;
  for (const auto& l : layers) out.emplace_back(l.last_tokens_per_expert, l.last_dispatched_rows);
  return out;
}

// ---- auxiliary losses -------------------------------------------------------------------------

namespace {
struct AuxLossScaler : torch::autograd::Function<AuxLossScaler> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& output,
                            const at::Tensor& aux_loss, double scale) {
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["dtype"] = static_cast<int64_t>(aux_loss.scalar_type());
    ctx->saved_data["device"] = aux_loss.device().str();
    return output;  // returned as is: autograd makes it a view of the input
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    const at::Device device(ctx->saved_data["device"].toStringRef());
    const at::Tensor aux_grad = at::full({}, ctx->saved_data["scale"].toDouble(),
                                         at::TensorOptions().dtype(dtype).device(device));
    return {grads[0], aux_grad, at::Tensor()};
  }
};

// Megatron's RouterGatingLinearFunction (megatron/core/transformer/moe/moe_utils.py): the
// router's logits computed in --moe-router-dtype from the input and weight in their own type;
// backward in the router's type, each gradient cast back to its tensor's type. It saves the
// input as it came (not its fp32/fp64 copy), as Megatron's does. Without a bias, `bias` is an
// empty tensor (an undefined one cannot pass through apply).
struct RouterGatingLinear : torch::autograd::Function<RouterGatingLinear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight, const at::Tensor& bias,
                            int64_t router_dtype) {
    const auto dt = static_cast<at::ScalarType>(router_dtype);
    ctx->save_for_backward({input, weight, bias});
    ctx->saved_data["dtype"] = router_dtype;
    const at::Tensor w = weight.to(dt).t();
    return bias.numel() > 0 ? at::addmm(bias.to(dt), input.to(dt), w) : at::mm(input.to(dt), w);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &input = saved[0], &weight = saved[1], &bias = saved[2];
    const auto dt = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    const at::Tensor& g = grads[0];
    at::Tensor grad_input = at::mm(g, weight.to(dt)).to(input.scalar_type());
    at::Tensor grad_weight = at::mm(g.t(), input.to(dt)).to(weight.scalar_type());
    at::Tensor grad_bias = bias.numel() > 0 ? g.sum(0).to(weight.scalar_type()) : at::Tensor();
    return {grad_input, grad_weight, grad_bias, at::Tensor()};
  }
};

// The tokens each expert keeps under a capacity: per expert (column) the `capacity` rows with
// the largest key, ties by token order (a stable sort, so the choice does not depend on the
// kernel; Megatron's torch.topk leaves the order of ties unspecified).
at::Tensor capacity_mask(const at::Tensor& key, int64_t capacity) {
  const at::Tensor order =
      std::get<1>(at::sort(key, /*stable=*/true, /*dim=*/0, /*descending=*/true));
  return at::zeros(key.sizes(), key.options().dtype(at::kBool))
      .scatter_(0, order.narrow(0, 0, capacity), true);
}
}  // namespace

at::Tensor attach_aux_loss(const at::Tensor& output, const at::Tensor& aux_loss, double scale) {
  return AuxLossScaler::apply(output, aux_loss, scale);
}

// ---- TopKRouter -------------------------------------------------------------------------------

TopKRouter::TopKRouter(const TransformerConfig& config, at::ScalarType dtype) : config_(config) {
  const auto opts = at::TensorOptions().dtype(dtype);
  weight =
      register_parameter("weight", at::zeros({config.num_moe_experts, config.hidden_size}, opts));
  if (config.add_bias_linear)
    bias = register_parameter("bias", at::zeros({config.num_moe_experts}, opts));
}

at::Tensor TopKRouter::gating_logits(const at::Tensor& h) const {
  // [T, E] in the input's type, or in --moe-router-dtype's (Megatron's router_gating_linear).
  const TransformerConfig& c = config_;
  const at::ScalarType router_dtype = c.moe_router_dtype == "fp64"   ? at::kDouble
                                      : c.moe_router_dtype == "fp32" ? at::kFloat
                                                                     : h.scalar_type();
  return router_dtype == h.scalar_type()
             ? at::linear(h, weight, bias)
             : RouterGatingLinear::apply(h, weight,
                                         bias.defined() ? bias : at::empty({0}, weight.options()),
                                         static_cast<int64_t>(router_dtype));
}

std::pair<at::Tensor, at::Tensor> TopKRouter::top_k(const at::Tensor& logits) const {
  // topk_routing_with_score_function: scores in fp32, probabilities back in the logits' type.
  const TransformerConfig& c = config_;
  const int64_t k = c.moe_router_topk;
  at::Tensor top_probs, top_index;
  if (c.moe_router_score_function == "softmax") {
    if (c.moe_router_pre_softmax) {
      std::tie(top_probs, top_index) = at::topk(at::softmax(logits, -1, at::kFloat), k);
    } else {
      at::Tensor top_logits;
      std::tie(top_logits, top_index) = at::topk(logits, k);
      top_probs = at::softmax(top_logits, -1, at::kFloat);
    }
  } else {
    at::Tensor top_scores;
    std::tie(top_scores, top_index) = at::topk(at::sigmoid(logits.to(at::kFloat)), k);
    top_probs = k > 1 ? top_scores / (top_scores.sum(-1, /*keepdim=*/true) + 1e-20) : top_scores;
  }
  if (c.moe_router_topk_scaling_factor) top_probs = top_probs * *c.moe_router_topk_scaling_factor;
  return {top_probs.to(logits.scalar_type()), top_index};
}

void TopKRouter::drop_over_capacity(Routing& r, at::Tensor& routing_map) const {
  // moe_utils.apply_router_token_dropping on this rank's tokens.
  const TransformerConfig& c = config_;
  const int64_t T = routing_map.size(0), E = c.num_moe_experts, k = c.moe_router_topk;
  const int64_t cap = moe_expert_capacity(T, k, E, *c.moe_expert_capacity_factor);
  {
    at::NoGradGuard no_grad;
    at::Tensor keep;
    if (cap > T) {
      keep = at::ones({T, E}, routing_map.options());
    } else if (c.moe_token_drop_policy == "probs") {
      keep = capacity_mask(r.probs.detach().to(at::kFloat), cap);
    } else {
      keep = capacity_mask(routing_map.to(at::kFloat), cap);
    }
    r.dropped = r.routed - (routing_map & keep).sum().item<int64_t>();
    routing_map = c.moe_pad_expert_input_to_capacity ? keep : (routing_map & keep);
  }
  r.probs = r.probs * routing_map;
}

at::Tensor TopKRouter::load_balancing_loss(const at::Tensor& logits, int64_t batch_size) const {
  // compute_routing_scores_for_aux_loss + switch_load_balancing_loss_func: the scores over all
  // experts, the top-k counts of those scores, sum(P_i * f_i) * E * coeff / (k * T * T).
  // seq_aux_loss (router.py _apply_seq_aux_loss, DeepSeek-V2's): the same per sequence, the
  // batch folded into the expert dimension ([s, b * E]), divided by the batch size.
  const TransformerConfig& c = config_;
  const int64_t T = logits.size(0), E = c.num_moe_experts, k = c.moe_router_topk;
  const TensorParallelGroup& tp = tensor_parallel_group();
  const int64_t sp = c.sequence_parallel ? tp.size : 1;
  const bool per_sequence = c.moe_router_load_balancing_type == "seq_aux_loss";
  TORCH_CHECK(batch_size >= 1 && T % batch_size == 0, "actmem::TopKRouter: ", T, " tokens are not ",
              batch_size, " sequences");
  const int64_t groups = per_sequence ? batch_size : 1;
  const int64_t rows = T / groups;  // this rank's tokens of one sequence (all tokens for aux_loss)
  at::Tensor scores;
  if (c.moe_router_score_function == "softmax") {
    scores = at::softmax(logits, -1, at::kFloat);
  } else {
    const at::Tensor s = at::sigmoid(logits.to(at::kFloat));
    scores = s / (s.sum(-1, /*keepdim=*/true) + 1e-20);
  }
  at::Tensor tokens_per_expert;
  {
    at::NoGradGuard no_grad;
    const at::Tensor idx = std::get<1>(at::topk(scores, k));
    tokens_per_expert = at::zeros({T, E}, scores.options())
                            .scatter_(1, idx, 1.0)
                            .reshape({rows, groups * E})
                            .sum(0);
    // get_tokens_per_expert_and_token_count: the counts over the tensor ranks' tokens.
    if (sp > 1) tokens_per_expert = group_all_reduce_sum(tp, tokens_per_expert);
  }
  const int64_t total = rows * sp;  // the tokens (of one sequence) of all tensor ranks
  const double norm = static_cast<double>(E) /
                      static_cast<double>(k * total * total * groups);  // / bsz for seq_aux_loss
  return (scores.reshape({rows, groups * E}).sum(0) * tokens_per_expert).sum() * norm;
}

Routing TopKRouter::forward(const at::Tensor& h, double aux_scale, MoEStats::Layer* stats,
                            int64_t batch_size) {
  const TransformerConfig& c = config_;
  const int64_t T = h.size(0), E = c.num_moe_experts, k = c.moe_router_topk;
  // Megatron attaches the auxiliary losses only while training with grad enabled (so not in a
  // recompute's first, graph-less forward; its replay attaches them).
  const bool attach = is_training() && at::GradMode::is_enabled();
  at::Tensor logits = gating_logits(h);
  // With sequence parallelism (required for MoE under tensor parallelism) this rank routes its
  // s/t tokens; the router's weight gradient is summed over the tensor ranks (it is a sequence-
  // parallel parameter, GPTModel::sequence_parallel_parameters), so each rank's share of the
  // auxiliary losses is scaled to make that sum the loss over all s tokens (router.py).
  const int64_t sp = c.sequence_parallel ? tensor_parallel_group().size : 1;
  if (c.moe_z_loss_coeff && attach && *c.moe_z_loss_coeff > 0.0) {
    // moe_utils.z_loss_func: mean(logsumexp(logits)^2) * coeff, on the logits before the top-k;
    // apply_z_loss divides the coefficient by the tensor-parallel size.
    const at::Tensor z = at::logsumexp(logits.to(at::kFloat), {-1}).pow(2).mean();
    logits =
        attach_aux_loss(logits, z * (*c.moe_z_loss_coeff / static_cast<double>(sp)), aux_scale);
    if (stats != nullptr) {
      stats->z_loss += z.item<double>();
      ++stats->z_loss_count;
    }
  }
  const auto [top_probs, top_index] = top_k(logits);
  Routing r;
  r.probs = at::zeros_like(logits).scatter(1, top_index, top_probs);
  at::Tensor routing_map;
  {
    at::NoGradGuard no_grad;
    routing_map = at::zeros({T, E}, logits.options().dtype(at::kBool)).scatter_(1, top_index, true);
  }
  r.routed = T * k;
  {
    const at::Tensor per_expert = routing_map.sum(0).cpu();
    r.routed_per_expert.assign(per_expert.data_ptr<int64_t>(), per_expert.data_ptr<int64_t>() + E);
  }
  if (c.moe_expert_capacity_factor) drop_over_capacity(r, routing_map);
  const std::string& balancing = c.moe_router_load_balancing_type;
  const bool aux =
      (balancing == "aux_loss" || balancing == "seq_aux_loss") && c.moe_aux_loss_coeff > 0.0;
  if (aux && attach) {
    const at::Tensor balance = load_balancing_loss(logits, batch_size);
    r.probs = attach_aux_loss(r.probs, balance * c.moe_aux_loss_coeff, aux_scale);
    if (stats != nullptr) {
      stats->load_balancing_loss += balance.item<double>();
      ++stats->load_balancing_count;
    }
  }
  r.routing_map = routing_map;
  return r;
}

// ---- experts ----------------------------------------------------------------------------------

std::optional<ParameterAttributes> TopKRouter::parameter_attributes(const std::string& name) const {
  if (name != "weight" && name != "bias") return std::nullopt;
  return ParameterAttributes{false, config_.sequence_parallel, false};
}

std::optional<ParameterAttributes> ExpertMLP::parameter_attributes(const std::string& name) const {
  if (name == "linear_fc1.weight" || name == "linear_fc1.bias" || name == "linear_fc2.weight") {
    return ParameterAttributes{true, false, false};
  }
  if (name == "linear_fc2.bias") return ParameterAttributes{false, true, false};
  return std::nullopt;
}

ExpertMLP::ExpertMLP(int64_t hidden, int64_t ffn, bool gated, bool bias, at::ScalarType dtype) {
  const auto opts = at::TensorOptions().dtype(dtype);
  const int64_t fc1_out = gated ? 2 * ffn : ffn;
  auto fc1 = register_module("linear_fc1", std::make_shared<torch::nn::Module>());
  auto fc2 = register_module("linear_fc2", std::make_shared<torch::nn::Module>());
  fc1_weight = fc1->register_parameter("weight", at::zeros({fc1_out, hidden}, opts));
  if (bias) fc1_bias = fc1->register_parameter("bias", at::zeros({fc1_out}, opts));
  fc2_weight = fc2->register_parameter("weight", at::zeros({hidden, ffn}, opts));
  if (bias) fc2_bias = fc2->register_parameter("bias", at::zeros({hidden}, opts));
}

GroupedLinear::GroupedLinear(int64_t experts, int64_t in, int64_t out, bool bias,
                             at::ScalarType dtype, LinearParallel parallel)
    : parallel_(parallel) {
  const auto opts = at::TensorOptions().dtype(dtype);
  for (int64_t j = 0; j < experts; ++j) {
    weights.push_back(register_parameter("weight" + std::to_string(j), at::zeros({out, in}, opts)));
  }
  if (bias) {
    for (int64_t j = 0; j < experts; ++j) {
      biases.push_back(register_parameter("bias" + std::to_string(j), at::zeros({out}, opts)));
    }
  }
}

std::optional<ParameterAttributes> GroupedLinear::parameter_attributes(
    const std::string& name) const {
  const bool column = parallel_ == LinearParallel::kColumn;
  if (name.rfind("weight", 0) == 0) return ParameterAttributes{true, false, false};
  if (name.rfind("bias", 0) == 0) return ParameterAttributes{column, !column, false};
  return std::nullopt;
}

at::Tensor GroupedLinear::forward(const at::Tensor& x, const std::vector<int64_t>& counts,
                                  bool with_bias) {
  TORCH_CHECK(counts.size() == weights.size(), "actmem::GroupedLinear: ", counts.size(),
              " row counts for ", weights.size(), " experts");
  // The grouped product on CPU: one matrix product per expert's row segment, written into one
  // output (TE's GroupedLinear does the same segments in one kernel on CUDA). Every expert's
  // weight takes part even with no rows, so it always receives a (zero) gradient.
  std::vector<at::Tensor> outs;
  outs.reserve(weights.size());
  int64_t offset = 0;
  for (size_t j = 0; j < weights.size(); ++j) {
    const at::Tensor seg = x.narrow(0, offset, counts[j]);
    outs.push_back(
        at::linear(seg, weights[j], with_bias && !biases.empty() ? biases[j] : at::Tensor()));
    offset += counts[j];
  }
  TORCH_CHECK(offset == x.size(0), "actmem::GroupedLinear: the counts cover ", offset, " rows of ",
              x.size(0));
  return at::cat(outs, 0);
}

Experts::Experts(const TransformerConfig& c, const LayerPlan& plan, at::ScalarType dtype)
    : gated_(c.gated_linear_unit),
      grouped_(c.moe_grouped_gemm),
      bias_(c.add_bias_linear),
      dropout_(c.moe_expert_dropout),
      ep_size_(c.expert_model_parallel_size),
      plan_(plan) {
  const int64_t E = c.num_moe_experts / c.expert_model_parallel_size, h = c.hidden_size;
  // Expert tensor parallelism (etp = t, Megatron's default): each tensor rank holds its slice of
  // every local expert's fc1 columns and fc2 rows (docs/moe.md).
  const int64_t f = c.moe_ffn() / c.tensor_model_parallel_size;
  fc2_bias_here_ = tensor_parallel_group().rank == 0;
  if (grouped_) {
    linear_fc1 = register_module(
        "linear_fc1", std::make_shared<GroupedLinear>(E, h, gated_ ? 2 * f : f, bias_, dtype,
                                                      LinearParallel::kColumn));
    linear_fc2 = register_module(
        "linear_fc2", std::make_shared<GroupedLinear>(E, f, h, bias_, dtype, LinearParallel::kRow));
  } else {
    auto list = register_module("local_experts", std::make_shared<torch::nn::Module>());
    for (int64_t j = 0; j < E; ++j) {
      local_experts.push_back(list->register_module(
          std::to_string(j), std::make_shared<ExpertMLP>(h, f, gated_, bias_, dtype)));
    }
  }
}

at::Tensor Experts::activation(const at::Tensor& fc1, const at::Tensor& probs) const {
  at::Tensor act;
  if (gated_) {
    const auto halves = fc1.chunk(2, -1);
    act = at::silu(halves[0]) * halves[1];
  } else {
    act = at::gelu(fc1);
  }
  // Megatron applies the routing weight here, before fc2 (since core_v0.13), the product back
  // in the activation's type (probabilities in --moe-router-dtype's are wider).
  act = (act * probs.unsqueeze(-1)).to(act.scalar_type());
  if (dropout_ > 0.0 && is_training()) {
    // actmem's expert dropout (Megatron has none): each expert-parallel rank draws from its own
    // stream, seed + 1024 + 100 * ep_rank + etp_rank (model_parallel_manual_seed).
    auto& tracker = get_rng_tracker();
    std::optional<RngFork> fork;
    if (tracker.current_state_name() != kExpertParallelRng) {
      TORCH_CHECK(tracker.has(kExpertParallelRng) || ep_size_ == 1,
                  "actmem::Experts: expert "
                  "dropout with expert parallelism needs the expert-parallel random stream (call "
                  "model_parallel_manual_seed first)");
      if (tracker.has(kExpertParallelRng)) fork.emplace(tracker.fork(kExpertParallelRng));
    }
    act = apply_dropout(act, dropout_, true);
  }
  return act;
}

at::Tensor Experts::forward(const at::Tensor& x, const std::vector<int64_t>& counts,
                            const at::Tensor& probs, ActivationOffloader* offloader) {
  forward_counters().experts.fetch_add(1, std::memory_order_relaxed);
  if (grouped_) return forward_grouped(x, counts, probs, offloader);
  // SequentialMLP: each expert is a whole MLP over its rows.
  std::vector<at::Tensor> outs;
  int64_t offset = 0;
  for (size_t j = 0; j < local_experts.size(); ++j) {
    ModuleScope scope("local_experts", static_cast<int64_t>(j));
    const ExpertMLP& e = *local_experts[j];
    const at::Tensor xs = x.narrow(0, offset, counts[j]), ps = probs.narrow(0, offset, counts[j]);
    at::Tensor fc1;
    {
      ModuleScope s("linear_fc1");
      fc1 = at::linear(xs, e.fc1_weight, e.fc1_bias);
    }
    at::Tensor act;
    {
      ModuleScope s("activation_func");
      act = activation(fc1, ps);
    }
    ModuleScope s("linear_fc2");
    at::Tensor y = at::linear(act, e.fc2_weight);
    if (e.fc2_bias.defined() && fc2_bias_here_) {
      y = y + (e.fc2_bias * ps.unsqueeze(-1)).to(y.scalar_type());
    }
    outs.push_back(y);
    offset += counts[j];
  }
  return at::cat(outs, 0);
}

at::Tensor Experts::forward_grouped(const at::Tensor& x, const std::vector<int64_t>& counts,
                                    const at::Tensor& probs, ActivationOffloader* offloader) {
  // Megatron's TEGroupedMLP.forward with its fine-grained offload groups (docs/offload.md):
  // expert_fc1 from the permuted tokens to fc1's output (the tokens are released once copied),
  // moe_act from fc1's output through the activation, committed only after linear_fc2 so that
  // backward waits for the reload before fc2's gradient hook recomputes the activation from it.
  auto group = [&](OffloadModule m) {
    return plan_.offloads(m) && is_training() ? offloader : nullptr;
  };
  at::Tensor fc1;
  {
    ModuleScope scope("linear_fc1");
    // Their sizes follow the routing: host buffers by size class.
    OffloadRegion region(group(OffloadModule::kExpertFc1), OffloadModule::kExpertFc1,
                         HostBuffers::kSizeClasses);
    fc1 = region.commit(linear_fc1->forward(region.enter(x), counts, true), {x});
  }
  OffloadRegion region(group(OffloadModule::kMoeAct), OffloadModule::kMoeAct,
                       HostBuffers::kSizeClasses);
  const bool discard = plan_.recomputes(RecomputeModule::kMoeAct) && is_training();
  CheckpointWithoutOutput ckpt;
  at::Tensor act;
  {
    ModuleScope scope("activation_func");
    const at::Tensor fc1_in = region.enter(fc1);
    if (discard) {
      act = ckpt.checkpoint(
          [this](const TensorList& in) { return TensorList{activation(in[0], in[1])}; },
          {fc1_in, probs})[0];
    } else {
      act = activation(fc1_in, probs);
    }
    region.end_capture();  // fc2's saved input is not part of the group
  }
  at::Tensor y;
  {
    ModuleScope scope("linear_fc2");
    y = linear_fc2->forward(act, counts, false);
  }
  if (discard) ckpt.discard_output_and_register_recompute(y);
  y = region.commit(y, {fc1});
  if (bias_ && fc2_bias_here_) {
    // TEGroupedMLP._apply_bias: each row gets its expert's fc2 bias times its probability, per
    // expert segment (which keeps nothing but the probabilities, already kept).
    ModuleScope scope("linear_fc2");
    std::vector<at::Tensor> rows;
    int64_t offset = 0;
    for (size_t j = 0; j < counts.size(); ++j) {
      rows.push_back((linear_fc2->biases[j] * probs.narrow(0, offset, counts[j]).unsqueeze(-1))
                         .to(y.scalar_type()));
      offset += counts[j];
    }
    y = y + at::cat(rows, 0);
  }
  return y;
}

// ---- MoELayer ---------------------------------------------------------------------------------

MoELayer::MoELayer(const TransformerConfig& config, const LayerPlan& plan, int64_t layer_number,
                   at::ScalarType dtype)
    : config_(config), plan_(plan), layer_number_(layer_number) {
  router = register_module("router", std::make_shared<TopKRouter>(config, dtype));
  experts = register_module("experts", std::make_shared<Experts>(config, plan, dtype));
  if (config.moe_shared_expert_intermediate_size) {
    // Megatron's SharedExpertMLP: an MLP of the shared size on the tensor-parallel group.
    TransformerConfig shared = config;
    shared.ffn_hidden_size = *config.moe_shared_expert_intermediate_size;
    shared_experts = register_module("shared_experts", std::make_shared<MLP>(shared, dtype));
    if (config.moe_shared_expert_gate) {
      shared_expert_gate = shared_experts->register_parameter(
          "gate_weight", at::zeros({1, config.hidden_size}, at::TensorOptions().dtype(dtype)));
    }
  }
}

at::Tensor MoELayer::run_shared_experts(const at::Tensor& x) {
  ModuleScope scope("shared_experts");
  auto fn = [this](const TensorList& in) {
    // Note [One gradient per checkpoint input]: fc1 and the gate both read x. Through a view their
    // two gradients are summed before they join the others reaching x, as they are when the
    // shared experts run in a checkpoint (whose input receives one gradient), so the sum rounds
    // the same with and without shared_experts recompute.
    const at::Tensor x = in[0].view_as(in[0]);
    at::Tensor out = shared_experts->forward(x).first;
    if (shared_expert_gate.defined()) out = out * at::sigmoid(at::linear(x, shared_expert_gate));
    return TensorList{out};
  };
  if (plan_.recomputes(RecomputeModule::kSharedExperts) && is_training())
    return checkpoint(fn, false, {x})[0];
  return fn({x})[0];
}

at::Tensor MoELayer::compute(const at::Tensor& x, ActivationOffloader* offloader) {
  forward_counters().moe.fetch_add(1, std::memory_order_relaxed);
  const int64_t T = x.size(0) * x.size(1), h = x.size(2);
  // The shared experts see the un-routed tokens, before routing (Megatron's non-overlapped path).
  at::Tensor shared;
  if (shared_experts) shared = run_shared_experts(x);
  const at::Tensor tokens = x.reshape({T, h});
  // A recompute replays the forward: its routing was counted by the first pass. The losses are
  // attached (and counted) once either way: in the forward with grad, or else in the replay.
  MoEStats::Layer* stats = is_recomputing() ? nullptr : this->stats();
  Routing r;
  {
    ModuleScope scope("router");
    r = router->forward(tokens, aux_scale_, this->stats(), x.size(1));
  }
  const TensorParallelGroup& ep = expert_parallel_group();
  const TensorParallelGroup& tp = tensor_parallel_group();
  // Tokens leave the rank when the experts are split over expert or tensor ranks.
  const bool exchange = ep.size > 1 || tp.size > 1;
  const bool allgather = exchange && config_.moe_token_dispatcher_type == "allgather";
  // Megatron's allgather dispatcher: the tokens, probabilities and routing map of the t x e
  // ranks gathered; this rank's experts' columns kept (Note on all_gather_tokens in
  // moe_dispatch.h).
  at::Tensor rows = tokens, map = r.routing_map, probs = r.probs;
  const TensorParallelGroup& tp_ep = tensor_and_expert_parallel_group();
  TORCH_CHECK(!exchange || tp_ep.size == tp.size * ep.size,
              "actmem::MoELayer: the tensor-and-"
              "expert-parallel group has ",
              tp_ep.size, " ranks, expected t x e = ", tp.size, " x ", ep.size,
              " (init_tensor_parallel_from_environment builds it)");
  if (allgather) {
    ModuleScope scope("token_dispatcher");
    const int64_t local = config_.num_moe_experts / ep.size;
    rows = all_gather_tokens(tokens, tp_ep);
    probs = all_gather_tokens(r.probs, tp_ep).narrow(1, ep.rank * local, local);
    at::NoGradGuard no_grad;
    map = all_gather_tokens(r.routing_map.to(at::kByte), tp_ep)
              .narrow(1, ep.rank * local, local)
              .to(at::kBool);
  }
  const int64_t rows_in = rows.size(0);
  // Megatron's permute (moe/moe_utils.py): the kept token-expert pairs expert-major, each
  // expert's tokens in token order; flat = expert * T + token.
  at::Tensor token_index, permuted, permuted_probs;
  std::vector<int64_t> counts;
  {
    ModuleScope scope("token_dispatcher");
    at::Tensor flat;
    {
      at::NoGradGuard no_grad;
      const at::Tensor map_t = map.t().contiguous();  // [E, T]
      flat = at::nonzero(map_t.reshape({-1})).squeeze(1);
      token_index = flat.remainder(rows_in);
      const at::Tensor per_expert = map_t.sum(1).cpu();
      counts.assign(per_expert.data_ptr<int64_t>(),
                    per_expert.data_ptr<int64_t>() + per_expert.numel());
    }
    permuted = rows.index_select(0, token_index);
    permuted_probs = probs.t().reshape({-1}).index_select(0, flat);
  }
  // Megatron's alltoall dispatcher: the rows travel to the ranks owning their experts
  // (Note [All-to-all dispatch]).
  std::optional<AlltoAllTokenDispatcher> alltoall;
  at::Tensor expert_in = permuted, expert_probs = permuted_probs;
  std::vector<int64_t> expert_counts = counts;
  if (exchange && !allgather) {
    ModuleScope scope("token_dispatcher");
    alltoall.emplace(ep, tp, tp_ep, config_.num_moe_experts);
    auto d = alltoall->dispatch(permuted, permuted_probs, counts);
    expert_in = d.tokens;
    expert_probs = d.probs;
    expert_counts = std::move(d.tokens_per_local_expert);
  }
  if (stats != nullptr && is_training()) {
    // The rows this rank's experts computed (the predictor's routing, moe_rows.h).
    if (stats->tokens_per_expert.empty()) {
      stats->tokens_per_expert = expert_counts;
      stats->dispatched_rows = permuted.size(0);
    }
    stats->last_tokens_per_expert = expert_counts;
    stats->last_dispatched_rows = permuted.size(0);
    if (stats->routed_per_expert.empty())
      stats->routed_per_expert.assign(r.routed_per_expert.size(), 0);
    for (size_t j = 0; j < r.routed_per_expert.size(); ++j)
      stats->routed_per_expert[j] += r.routed_per_expert[j];
    stats->routed += r.routed;
    stats->dropped += r.dropped;
  }
  at::Tensor y;
  {
    ModuleScope scope("experts");
    y = experts->forward(expert_in, expert_counts, expert_probs, offloader);
  }
  at::Tensor out;
  {
    // unpermute: a token's expert outputs summed (scatter_add, as Megatron's unpermute).
    ModuleScope scope("token_dispatcher");
    if (alltoall) y = alltoall->combine(y);
    out = at::zeros({rows_in, h}, y.options())
              .scatter_add(0, token_index.unsqueeze(1).expand({token_index.size(0), h}), y);
    if (allgather) out = reduce_scatter_tokens(out, tp_ep);  // the group's sum, this rank's rows
  }
  out = out.view(x.sizes());
  return shared.defined() ? out + shared : out;
}

std::pair<at::Tensor, at::Tensor> MoELayer::forward(const at::Tensor& x,
                                                    ActivationOffloader* offloader) {
  if (plan_.recomputes(RecomputeModule::kMoe) && is_training()) {
    // Selective "moe": router, dispatch, experts, combine and shared experts replayed in
    // backward from the layer's input.
    return {checkpoint([this, offloader](
                           const TensorList& in) { return TensorList{compute(in[0], offloader)}; },
                       false, {x})[0],
            at::Tensor()};
  }
  return {compute(x, offloader), at::Tensor()};
}

void MoELayer::bind_stats(MoEStats& stats) {
  MoEStats::Layer entry;
  entry.layer_number = layer_number_;
  stats.layers.push_back(std::move(entry));
  stats_ = &stats;
  stats_index_ = stats.layers.size() - 1;
}

void MoELayer::init_weights(WeightInit& init) {
  const TransformerConfig& c = config_;
  const int64_t h = c.hidden_size, f = c.moe_ffn(), fc1_rows = c.gated_linear_unit ? 2 * f : f;
  const bool gated = c.gated_linear_unit;
  router->weight.copy_(init.normal({c.num_moe_experts, h}, init.std()));
  Experts& e = *experts;
  // Every expert-parallel rank draws all E experts in order and keeps its own E/e, and of them
  // its tensor rank's slice (expert tensor parallelism), so the model is the same function of
  // the config for any t and e.
  const int64_t local = c.num_moe_experts / c.expert_model_parallel_size;
  const int64_t first = expert_parallel_group().rank * local;
  for (int64_t g = 0; g < c.num_moe_experts; ++g) {
    const at::Tensor fc1 = init.normal({fc1_rows, h}, init.std());
    const at::Tensor fc2 = init.normal({h, f}, init.scaled_std());
    if (g < first || g >= first + local) continue;
    const auto j = static_cast<size_t>(g - first);
    if (e.linear_fc1) {
      e.linear_fc1->weights[j].copy_(init.fc1_rows(fc1, gated));
      e.linear_fc2->weights[j].copy_(init.cols(fc2));
    } else {
      e.local_experts[j]->fc1_weight.copy_(init.fc1_rows(fc1, gated));
      e.local_experts[j]->fc2_weight.copy_(init.cols(fc2));
    }
  }
  if (shared_experts) {
    shared_experts->init_weights(init);
    if (shared_expert_gate.defined()) shared_expert_gate.copy_(init.normal({1, h}, init.std()));
  }
}

}  // namespace actmem
