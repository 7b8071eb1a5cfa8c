// test_moe.cpp — the MoE layer: Megatron's validation rules and messages, the router's maths
// against independent formulas, the layer against a per-token reference, and every MoE recompute
// and offload strategy bitwise equal to the plain run.
#include "actmem/base/compat.h"
#include "actmem/config/activation_plan.h"
#include "actmem/memory/ledger.h"
#include "actmem/memory/memory_model.h"
#include "actmem/model/activation_bytes.h"
#include "actmem/model/mlp/mlp.h"
#include "actmem/model/model.h"
#include "actmem/model/moe/moe.h"
#include "actmem/recompute/recompute.h"
#include "actmem/train/checkpoint.h"
#include "actmem/train/trainer.h"
#include "exactness.h"
#include "fixtures.h"
#include "test_util.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <malloc.h>

#include <cmath>
#include <numeric>

namespace {

using actmem::GPTModel;
using actmem::GroupedLinear;
using actmem::Linear;
using actmem::LinearParallel;
using actmem::MoELayer;
using actmem::ParameterAttributes;
using actmem::Trainer;
using actmem::TrainingConfig;
using actmem::TransformerConfig;
using actmem::testing::expect_error_containing;
using actmem::testing::offload;
using actmem::testing::selective;

// small_model with 4 experts (top-2, expert ffn 32), aux and z losses and expert dropout.
TransformerConfig moe_model() {
  TransformerConfig c = actmem::testing::small_model();
  c.num_moe_experts = 4;
  c.moe_ffn_hidden_size = 32;
  c.moe_aux_loss_coeff = 1e-2;
  c.moe_z_loss_coeff = 1e-3;
  c.moe_expert_dropout = 0.1;
  c.moe_grouped_gemm = true;
  return c;
}

void check_refused(const std::function<void(TransformerConfig&)>& edit, const std::string& needle) {
  TransformerConfig c = moe_model();
  edit(c);
  expect_error_containing([&] { c.validate(); }, needle);
}

// ---- validation -------------------------------------------------------------------------------

TEST(MoEConfig, MegatronsRulesWithItsMessages) {
  check_refused([](auto& c) { c.num_moe_experts = -1; }, "num_moe_experts must be non-negative.");
  check_refused(
      [](auto& c) {
        c.num_moe_experts = 0;
        c.moe_ffn_hidden_size.reset();
        c.moe_aux_loss_coeff = 0;
        c.moe_z_loss_coeff.reset();
        c.moe_expert_dropout = 0;
        c.moe_grouped_gemm = false;
        c.expert_model_parallel_size = 2;
      },
      "num_moe_experts must be non None to use expert-parallel.");
  check_refused(
      [](auto& c) {
        c.num_moe_experts = 0;
        c.moe_aux_loss_coeff = 0;
        c.moe_z_loss_coeff.reset();
        c.moe_expert_dropout = 0;
        c.moe_grouped_gemm = false;
      },
      "moe_ffn_hidden_size is set but num_moe_experts is None. Please set num_moe_experts or "
      "remove moe_ffn_hidden_size.");
  check_refused([](auto& c) { c.moe_router_topk = 5; }, "moe_router_topk must be between 1 and");
  check_refused([](auto& c) { c.moe_router_topk = 1; },
                "Please use --moe-router-pre-softmax when topk is 1.");
  check_refused([](auto& c) { c.moe_router_score_function = "relu"; },
                "Invalid score_function: relu");
  check_refused([](auto& c) { c.moe_token_dispatcher_type = "flex2"; },
                "Unsupported token dispatcher type: flex2");
  check_refused(
      [](auto& c) {
        c.moe_expert_capacity_factor = 1.0;
        c.moe_token_drop_policy = "random";
      },
      "Invalid drop_policy: random");
  check_refused([](auto& c) { c.moe_pad_expert_input_to_capacity = true; },
                "moe_expert_capacity_factor must be set to use moe_pad_expert_input_to_capacity");
  check_refused([](auto& c) { c.moe_shared_expert_intermediate_size = 0; },
                "moe_shared_expert_intermediate_size must be num_shared_experts * "
                "ffn_size_of_each_shared_expert, but got 0");
  check_refused([](auto& c) { c.moe_shared_expert_intermediate_size = 32; },
                "bias is not supported in the shared experts, please set "
                "'--disable-bias-linear' instead.");
  check_refused(
      [](auto& c) {
        c.num_moe_experts = 6;
        c.expert_model_parallel_size = 4;
      },
      "Number of experts should be a multiple of expert model parallel_size.");
  // MoELayer.forward's rule for tensor parallelism (refused up front), and the experts' columns
  // must split over the expert tensor-parallel ranks.
  check_refused([](auto& c) { c.tensor_model_parallel_size = 2; },
                "During training, performance may degrade if MoE and tensor parallelism are "
                "enabled without also enabling sequence parallelism.");
  check_refused(
      [](auto& c) {
        c.tensor_model_parallel_size = 2;
        c.sequence_parallel = true;
        c.moe_ffn_hidden_size = 33;
      },
      "moe_ffn_hidden_size (33) must be divisible by expert_tensor_parallel_size (2)");
  check_refused([](auto& c) { c.moe_router_load_balancing_type = "sinkhorn"; },
                "moe_router_load_balancing_type sinkhorn is not implemented");
  // Recompute rules 12 and 18 of validate_args, and the modules this model does not have.
  check_refused(
      [](auto& c) {
        c.moe_grouped_gemm = false;
        c.recompute_granularity = "selective";
        c.recompute_modules = std::vector<std::string>{"moe_act"};
      },
      "moe_act in recompute_modules is only supported with moe_grouped_gemm.");
  check_refused(
      [](auto& c) {
        c.moe_layer_recompute = true;
        c.recompute_granularity = "full";
        c.recompute_method = "uniform";
        c.recompute_num_layers = 1;
      },
      "Do not set --moe-layer-recompute with full recompute granularity.");
  check_refused(
      [](auto& c) {
        c.recompute_granularity = "selective";
        c.recompute_modules = std::vector<std::string>{"mlp"};
      },
      "mlp in recompute_modules applies to dense layers");
  check_refused(
      [](auto& c) {
        c.recompute_granularity = "selective";
        c.recompute_modules = std::vector<std::string>{"shared_experts"};
      },
      "shared_experts in recompute_modules needs shared experts");
  check_refused(
      [](auto& c) {
        c.fine_grained_activation_offloading = true;
        c.offload_modules = {"expert_fc1"};
        c.moe_grouped_gemm = false;
      },
      "need the grouped experts (--moe-grouped-gemm)");
  check_refused(
      [](auto& c) {
        c.fine_grained_activation_offloading = true;
        c.offload_modules = {"moe_act"};
        c.recompute_granularity = "selective";
        c.recompute_modules = std::vector<std::string>{"moe"};
      },
      "cannot be offloaded when moe recomputes the whole MoE layer");
  // A dense model refuses the MoE modules.
  TransformerConfig dense = actmem::testing::small_model();
  dense.recompute_granularity = "selective";
  dense.recompute_modules = std::vector<std::string>{"moe"};
  expect_error_containing([&] { dense.validate(); }, "this model is dense");
}

TEST(MoEConfig, LayerRecomputeIsMegatronsAlias) {
  TransformerConfig c = moe_model();
  c.moe_layer_recompute = true;
  const auto plan = actmem::make_activation_plan(c);
  // Megatron appends "moe" to the default modules (core_attn).
  ASSERT_EQ(plan.recompute_modules.size(), 2u);
  EXPECT_TRUE(plan.recomputes(actmem::RecomputeModule::kCoreAttn));
  EXPECT_TRUE(plan.recomputes(actmem::RecomputeModule::kMoe));
  EXPECT_TRUE(plan.layers[0].recomputes(actmem::RecomputeModule::kMoe));
}

TEST(MoEConfig, LayerFrequencyIntegerAndPatterns) {
  TransformerConfig c = moe_model();
  c.moe_layer_freq = "2";
  EXPECT_EQ(c.moe_layers(), (std::vector<bool>{true, false, true, false}));
  c.moe_layer_freq = "[0,1,1,0]";
  EXPECT_EQ(c.moe_layers(), (std::vector<bool>{false, true, true, false}));
  c.moe_layer_freq = "([1]*1+[0]*1)*2";
  EXPECT_EQ(c.moe_layers(), (std::vector<bool>{true, false, true, false}));
  c.moe_layer_freq = "[0]+3*[1]";
  EXPECT_EQ(c.moe_layers(), (std::vector<bool>{false, true, true, true}));
  c.moe_layer_freq = "[1,0,1]";
  expect_error_containing([&] { c.validate(); },
                          "Invalid length of moe_layer_pattern: 3, expected 4, current moe layer "
                          "pattern: [1,0,1]");
  c.moe_layer_freq = "[1,0,2,1]";
  expect_error_containing([&] { c.validate(); }, "Invalid layer pattern");
  c.moe_layer_freq = "[1,0]*two";
  expect_error_containing([&] { c.validate(); }, "Invalid pattern: [1,0]*two");
  c.moe_layer_freq = "([1,0]*2";
  expect_error_containing([&] { c.validate(); }, "missing ')'");
  c.moe_layer_freq = "0";
  expect_error_containing([&] { c.validate(); }, "moe_layer_freq must be a positive integer");
  // Dense layers are plain MLPs named as in Megatron; MoE layers carry the router.
  c.moe_layer_freq = "2";
  GPTModel model(c);
  bool router0 = false, router1 = false, dense1 = false;
  for (const auto& p : model.named_parameters()) {
    router0 |= p.key() == "decoder.layers.0.mlp.router.weight";
    router1 |= p.key() == "decoder.layers.1.mlp.router.weight";
    dense1 |= p.key() == "decoder.layers.1.mlp.linear_fc1.weight";
  }
  EXPECT_TRUE(router0);
  EXPECT_FALSE(router1);
  EXPECT_TRUE(dense1);
}

// Note [Parameter attributes] in model.cpp: each module that registers a parameter declares how
// it is held; the model refuses a parameter nobody declares. Checked here against the rules
// Megatron's names imply (the routed experts are mlp.experts.*), and per module against
// Megatron's layers (column-parallel weights and biases split; a row-parallel bias replicated and,
// with sequence parallelism, summed over the ranks).
TEST(MoEModel, ParameterAttributesAreDeclaredByTheModulesThatHoldThem) {
  TransformerConfig c = moe_model();
  c.add_bias_linear = false;  // Megatron's rule with shared experts; the biases are checked below
  c.moe_shared_expert_intermediate_size = 16;
  c.moe_shared_expert_gate = true;
  for (const bool grouped : {true, false}) {
    c.moe_grouped_gemm = grouped;
    GPTModel model(c);
    const std::vector<ParameterAttributes> attrs = model.parameter_attributes();
    const auto named = model.named_parameters();
    ASSERT_EQ(attrs.size(), named.size());
    size_t i = 0, experts = 0;
    for (const auto& item : named) {
      const bool routed = item.key().find(".mlp.experts.") != std::string::npos;
      EXPECT_EQ(attrs[i].expert_parallel, routed) << item.key();
      // One process: nothing is split, no sequence parallelism.
      EXPECT_FALSE(attrs[i].tensor_parallel) << item.key();
      EXPECT_FALSE(attrs[i].sequence_parallel) << item.key();
      experts += routed;
      ++i;
    }
    EXPECT_GT(experts, 0u);
  }
  // The declarations themselves, before the model masks them by its layout.
  Linear column(8, 4, true, false, at::kFloat, LinearParallel::kColumn, /*sequence_parallel=*/true);
  Linear row(4, 8, true, true, at::kFloat, LinearParallel::kRow, /*sequence_parallel=*/true);
  Linear replicated(8, 8, true, false, at::kFloat);
  auto is = [](std::optional<ParameterAttributes> a, bool tp, bool sp) {
    return a.has_value() && a->tensor_parallel == tp && a->sequence_parallel == sp &&
           !a->expert_parallel;
  };
  EXPECT_TRUE(is(column.parameter_attributes("weight"), true, false));
  EXPECT_TRUE(is(column.parameter_attributes("bias"), true, false));
  EXPECT_TRUE(is(row.parameter_attributes("weight"), true, false));
  EXPECT_TRUE(is(row.parameter_attributes("bias"), false, true));
  EXPECT_TRUE(is(replicated.parameter_attributes("weight"), false, false));
  EXPECT_FALSE(replicated.parameter_attributes("gate").has_value());
  GroupedLinear fc1(2, 8, 4, true, at::kFloat, LinearParallel::kColumn);
  GroupedLinear fc2(2, 4, 8, true, at::kFloat, LinearParallel::kRow);
  EXPECT_TRUE(is(fc1.parameter_attributes("weight1"), true, false));
  EXPECT_TRUE(is(fc1.parameter_attributes("bias0"), true, false));
  EXPECT_TRUE(is(fc2.parameter_attributes("weight0"), true, false));
  EXPECT_TRUE(is(fc2.parameter_attributes("bias1"), false, true));
  // A parameter no module declares is refused, by name.
  GPTModel model(c);
  model.decoder->layers[0]->register_parameter("extra", at::zeros({2}));
  expect_error_containing([&] { model.parameter_attributes(); },
                          "parameter decoder.layers.0.extra");
}

TEST(MoEModel, MegatronsParameterNames) {
  TransformerConfig c = moe_model();
  c.add_bias_linear = false;
  c.moe_shared_expert_intermediate_size = 16;
  c.moe_shared_expert_gate = true;
  auto names = [](const GPTModel& m) {
    std::map<std::string, std::vector<int64_t>> out;
    for (const auto& p : m.named_parameters()) out[p.key()] = p.value().sizes().vec();
    return out;
  };
  const auto grouped = names(GPTModel(c));
  const std::string l = "decoder.layers.1.mlp.";
  EXPECT_EQ(grouped.at(l + "router.weight"), (std::vector<int64_t>{4, 32}));
  EXPECT_EQ(grouped.at(l + "experts.linear_fc1.weight3"), (std::vector<int64_t>{32, 32}));
  EXPECT_EQ(grouped.at(l + "experts.linear_fc2.weight0"), (std::vector<int64_t>{32, 32}));
  EXPECT_EQ(grouped.at(l + "shared_experts.linear_fc1.weight"), (std::vector<int64_t>{16, 32}));
  EXPECT_EQ(grouped.at(l + "shared_experts.linear_fc2.weight"), (std::vector<int64_t>{32, 16}));
  EXPECT_EQ(grouped.at(l + "shared_experts.gate_weight"), (std::vector<int64_t>{1, 32}));
  c.moe_grouped_gemm = false;
  c.gated_linear_unit = true;
  const auto sequential = names(GPTModel(c));
  EXPECT_EQ(sequential.at(l + "experts.local_experts.2.linear_fc1.weight"),
            (std::vector<int64_t>{64, 32}));  // [gate; up]
  EXPECT_EQ(sequential.at(l + "experts.local_experts.2.linear_fc2.weight"),
            (std::vector<int64_t>{32, 32}));
}

// ---- the router -------------------------------------------------------------------------------

at::Tensor randn(at::IntArrayRef shape, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::empty(shape, at::kDouble).normal_(0, 1, gen);
}

// A router over T tokens of width h with E experts, in double, initialised at random.
std::shared_ptr<actmem::TopKRouter> make_router(const TransformerConfig& c, uint64_t seed) {
  auto r = std::make_shared<actmem::TopKRouter>(c, at::kDouble);
  at::NoGradGuard g;
  r->weight.copy_(randn(r->weight.sizes(), seed));
  if (r->bias.defined()) r->bias.copy_(randn(r->bias.sizes(), seed + 1) * 0.1);
  return r;
}

TEST(MoERouter, RouterDtypeComputesTheGatingInItsTypeAndCastsTheGradientsBack) {
  // Megatron's --moe-router-dtype (RouterGatingLinearFunction): a bf16 router's logits in fp32 or
  // fp64 from the bf16 input and weight, the probabilities in that type; in backward the input's
  // and the weight's gradients computed in that type and cast back to bf16. Against the same
  // routing run on fp32/fp64 copies of the two, whose gradients are then cast to bf16.
  for (const std::string dtype : {"fp32", "fp64"}) {
    SCOPED_TRACE(dtype);
    const at::ScalarType wide = dtype == "fp32" ? at::kFloat : at::kDouble;
    TransformerConfig c = moe_model();
    c.moe_router_topk = 2;
    c.hidden_size = 8;
    c.moe_aux_loss_coeff = 0.0;
    c.moe_z_loss_coeff.reset();
    c.moe_router_dtype = dtype;
    auto router = std::make_shared<actmem::TopKRouter>(c, at::kBFloat16);
    {
      at::NoGradGuard g;
      router->weight.copy_(randn(router->weight.sizes(), 3));
    }
    const at::Tensor x = randn({24, 8}, 4).to(at::kBFloat16).requires_grad_(true);
    const at::Tensor mix = randn({24, 4}, 5).to(wide);
    const actmem::Routing r = router->forward(x, 1.0, nullptr);
    EXPECT_EQ(r.probs.scalar_type(), wide);
    (r.probs * mix).sum().backward();
    // The reference: the same routing in the wide type throughout.
    c.moe_router_dtype.clear();
    auto reference = std::make_shared<actmem::TopKRouter>(c, wide);
    {
      at::NoGradGuard g;
      reference->weight.copy_(router->weight.to(wide));
    }
    const at::Tensor xw = x.detach().to(wide).requires_grad_(true);
    const actmem::Routing want = reference->forward(xw, 1.0, nullptr);
    EXPECT_TRUE(at::equal(r.probs, want.probs));
    EXPECT_TRUE(at::equal(r.routing_map, want.routing_map));
    (want.probs * mix).sum().backward();
    ASSERT_EQ(x.grad().scalar_type(), at::kBFloat16);
    ASSERT_EQ(router->weight.grad().scalar_type(), at::kBFloat16);
    EXPECT_TRUE(at::equal(x.grad(), xw.grad().to(at::kBFloat16)));
    EXPECT_TRUE(at::equal(router->weight.grad(), reference->weight.grad().to(at::kBFloat16)));
  }
}

TEST(MoERouter, TopKSoftmaxProbabilitiesAndAuxLossAsTheirFormulas) {
  TransformerConfig c = moe_model();
  c.num_moe_experts = 6;
  c.moe_router_topk = 3;
  c.hidden_size = 8;
  auto router = make_router(c, 1);
  const at::Tensor x = randn({40, 8}, 2);
  actmem::MoEStats::Layer stats;
  const actmem::Routing r = router->forward(x, 1.0, &stats);
  const at::Tensor logits = at::linear(x, router->weight, router->bias);
  // Each token: exactly its 3 largest logits, probabilities a softmax over those 3.
  for (int64_t t = 0; t < 40; ++t) {
    const at::Tensor order = std::get<1>(logits[t].sort(0, /*descending=*/true));
    double sum = 0.0;
    for (int64_t j = 0; j < 3; ++j) EXPECT_TRUE(r.routing_map[t][order[j]].item<bool>());
    for (int64_t j = 3; j < 6; ++j) EXPECT_FALSE(r.routing_map[t][order[j]].item<bool>());
    double z = 0.0;
    for (int64_t j = 0; j < 3; ++j) z += std::exp(logits[t][order[j]].item<double>());
    for (int64_t j = 0; j < 3; ++j) {
      const double p = r.probs[t][order[j]].item<double>();
      EXPECT_NEAR(p, std::exp(logits[t][order[j]].item<double>()) / z, 1e-6);
      sum += p;
    }
    EXPECT_NEAR(sum, 1.0, 1e-6);
  }
  // Switch load balancing: E * sum_i f_i P_i, f_i = share of the routed pairs, P_i = mean score.
  double balance = 0.0;
  const at::Tensor scores = at::softmax(logits.to(at::kFloat), -1).to(at::kDouble);
  for (int64_t i = 0; i < 6; ++i) {
    const double f = r.routing_map.select(1, i).sum().item<double>() / (40.0 * 3.0);
    const double P = scores.select(1, i).mean().item<double>();
    balance += f * P;
  }
  EXPECT_EQ(stats.load_balancing_count, 1);
  EXPECT_NEAR(stats.load_balancing_loss, 6.0 * balance, 1e-6);
  EXPECT_EQ(stats.z_loss_count, 1);
  const double z = at::logsumexp(logits, {-1}).pow(2).mean().item<double>();
  EXPECT_NEAR(stats.z_loss, z, 1e-4 * z);
  EXPECT_EQ(r.routed, 120);
  EXPECT_EQ(r.dropped, 0);
}

TEST(MoERouter, AuxLossGradientIsTheScaledLossGradient) {
  // attach_aux_loss adds scale * d(aux)/d(.) to the backward of the main loss: the router's
  // gradient equals the gradient of main + scale * (coeff * balance + z_coeff * z) computed
  // explicitly.
  TransformerConfig c = moe_model();
  c.hidden_size = 8;
  const double scale = 0.25;
  auto router = make_router(c, 3);
  const at::Tensor x = randn({24, 8}, 4);
  const at::Tensor w = randn({24, 4}, 5);
  const actmem::Routing r = router->forward(x, scale, nullptr);
  (r.probs * w).sum().backward();
  const at::Tensor got = router->weight.grad().clone();
  router->weight.mutable_grad().zero_();
  if (router->bias.defined()) router->bias.mutable_grad().zero_();
  // The same loss written out: top-2 softmax probs, the balance term and the z-loss.
  const at::Tensor logits = at::linear(x, router->weight, router->bias);
  const auto [top, idx] = at::topk(logits, 2);
  const at::Tensor probs = at::zeros_like(logits).scatter(1, idx, at::softmax(top, -1));
  const at::Tensor scores = at::softmax(logits, -1);
  const at::Tensor counts =
      at::zeros_like(logits).scatter(1, std::get<1>(at::topk(scores.detach(), 2)), 1.0).sum(0);
  const at::Tensor balance = (scores.sum(0) * counts).sum() * (4.0 / (2.0 * 24 * 24));
  const at::Tensor z = at::logsumexp(logits, {-1}).pow(2).mean();
  ((probs * w).sum() + scale * (1e-2 * balance + 1e-3 * z)).backward();
  // The scores are computed in fp32 (as Megatron's), the reference in double.
  EXPECT_TRUE(at::allclose(got, router->weight.grad(), 1e-5, 1e-6))
      << (got - router->weight.grad()).abs().max().item<double>() << " of "
      << got.abs().max().item<double>();
  EXPECT_FALSE(at::allclose(got, at::zeros_like(got)));
}

TEST(MoERouter, SeqAuxLossIsTheMeanOfEachSequencesSwitchLoss) {
  // router.py _apply_seq_aux_loss (DeepSeek-V2's): the batch folded into the expert dimension
  // makes the Switch loss one per sequence, then the mean over the batch. Against aux_loss run
  // on each sequence alone (tokens [s, b] flattened sequence-first: sequence j is rows j, j + B,
  // ...): the logged value is their mean, and the router's gradient (main loss + 1 x the
  // auxiliary losses) is the sum of the sequences' gradients with the auxiliary losses at 1/B.
  TransformerConfig c = moe_model();
  c.num_moe_experts = 6;
  c.moe_router_topk = 2;
  c.hidden_size = 8;
  TransformerConfig per_sequence = c;
  per_sequence.moe_router_load_balancing_type = "seq_aux_loss";
  const int64_t S = 10, B = 3;
  const at::Tensor x = randn({S * B, 8}, 2);
  const at::Tensor w = randn({S * B, 6}, 3);
  auto router = make_router(per_sequence, 1);
  actmem::MoEStats::Layer stats;
  const actmem::Routing r = router->forward(x, 1.0, &stats, B);
  (r.probs * w).sum().backward();
  auto single = make_router(c, 1);
  double mean = 0.0;
  for (int64_t b = 0; b < B; ++b) {
    actmem::MoEStats::Layer one;
    const at::Tensor xb = x.view({S, B, 8}).select(1, b);
    const actmem::Routing rb = single->forward(xb, 1.0 / B, &one);
    (rb.probs * w.view({S, B, 6}).select(1, b)).sum().backward();
    mean += one.load_balancing_loss / B;
  }
  // The scores are fp32 (as Megatron's), whatever the router's type: agreement to fp32 rounding.
  EXPECT_NEAR(stats.load_balancing_loss, mean, 1e-6 * mean);
  EXPECT_TRUE(at::allclose(router->weight.grad(), single->weight.grad(), 1e-6, 1e-8))
      << (router->weight.grad() - single->weight.grad()).abs().max().item<double>();
  // Not the batch's aux_loss (the path is taken), and the same as it for one sequence.
  actmem::MoEStats::Layer whole;
  make_router(c, 1)->forward(x, 1.0, &whole);
  EXPECT_GT(std::abs(whole.load_balancing_loss - stats.load_balancing_loss), 1e-3 * mean);
  actmem::MoEStats::Layer seq1;
  make_router(per_sequence, 1)->forward(x, 1.0, &seq1, 1);
  EXPECT_EQ(seq1.load_balancing_loss, whole.load_balancing_loss);
  expect_error_containing([&] { make_router(per_sequence, 1)->forward(x, 1.0, nullptr, 4); },
                          "are not 4 sequences");
}

TEST(MoERouter, CapacityKeepsTheHighestProbabilitiesOrTheEarliestTokens) {
  TransformerConfig c = moe_model();
  c.hidden_size = 8;
  c.moe_expert_capacity_factor = 0.5;
  const int64_t T = 32, cap = actmem::moe_expert_capacity(T, 2, 4, 0.5);
  EXPECT_EQ(cap, 8);                                        // ceil(32 * 2 / 4 * 0.5)
  EXPECT_EQ(actmem::moe_expert_capacity(5, 2, 4, 1.1), 3);  // ceil(2.75)
  const at::Tensor x = randn({T, 8}, 6);
  for (const char* policy : {"probs", "position"}) {
    c.moe_token_drop_policy = policy;
    auto router = make_router(c, 7);
    at::NoGradGuard g;
    const actmem::Routing r = router->forward(x, 1.0, nullptr);
    // The same router without a capacity decides what was routed.
    TransformerConfig dropless = c;
    dropless.moe_expert_capacity_factor.reset();
    auto free_router = make_router(dropless, 7);
    const actmem::Routing all = free_router->forward(x, 1.0, nullptr);
    int64_t kept_total = 0;
    for (int64_t e = 0; e < 4; ++e) {
      const at::Tensor routed = all.routing_map.select(1, e), kept = r.routing_map.select(1, e);
      EXPECT_TRUE((kept & ~routed).sum().item<int64_t>() == 0) << "kept an unrouted token";
      const int64_t n_routed = routed.sum().item<int64_t>(), n_kept = kept.sum().item<int64_t>();
      EXPECT_EQ(n_kept, std::min(n_routed, cap));
      kept_total += n_kept;
      // Dropped pairs lose their probability, kept ones keep it unchanged.
      EXPECT_TRUE(at::equal(r.probs.select(1, e), all.probs.select(1, e) * kept));
      if (n_routed <= cap) continue;
      if (std::string(policy) == "probs") {
        const double min_kept = all.probs.select(1, e).masked_select(kept).min().item<double>();
        const double max_dropped =
            all.probs.select(1, e).masked_select(routed & ~kept).max().item<double>();
        EXPECT_GE(min_kept, max_dropped);
      } else {
        const int64_t last_kept = at::nonzero(kept).max().item<int64_t>();
        const int64_t first_dropped = at::nonzero(routed & ~kept).min().item<int64_t>();
        EXPECT_LT(last_kept, first_dropped);
      }
    }
    EXPECT_EQ(r.dropped, 64 - kept_total);
    EXPECT_GT(r.dropped, 0) << "the test needs an over-full expert";
  }
  // Padding: every expert computes exactly `capacity` rows.
  c.moe_pad_expert_input_to_capacity = true;
  auto router = make_router(c, 7);
  at::NoGradGuard g;
  const actmem::Routing r = router->forward(x, 1.0, nullptr);
  EXPECT_TRUE(at::equal(r.routing_map.sum(0), at::full({4}, cap, at::kLong)));
}

// ---- the layer against a per-token reference ---------------------------------------------------

TEST(MoELayerMath, EachTokenIsTheProbabilityWeightedSumOfItsExperts) {
  for (const bool grouped : {true, false}) {
    for (const bool gated : {false, true}) {
      TransformerConfig c = moe_model();
      c.moe_grouped_gemm = grouped;
      c.gated_linear_unit = gated;
      c.add_bias_linear = !gated;  // biases with GeLU, shared experts (no bias) with SwiGLU
      if (gated) {
        c.moe_shared_expert_intermediate_size = 16;
        c.moe_shared_expert_gate = true;
      }
      c.moe_expert_dropout = 0.0;
      GPTModel model(c, at::kDouble);
      model.eval();
      {
        // Non-zero biases, so that their placement is checked too.
        at::NoGradGuard g;
        uint64_t seed = 100;
        for (auto& p : model.named_parameters()) {
          if (p.key().find("bias") != std::string::npos)
            p.value().copy_(randn(p.value().sizes(), seed++) * 0.1);
        }
      }
      MoELayer& moe = *model.decoder->layers[0]->mlp_as<MoELayer>();
      const at::Tensor x = randn({6, 3, c.hidden_size}, 8);  // [s, b, h]
      at::NoGradGuard g;
      const at::Tensor y = moe.forward(x, nullptr).first.reshape({18, c.hidden_size});
      const at::Tensor tokens = x.reshape({18, c.hidden_size});
      const actmem::Routing r = moe.router->forward(tokens, 1.0, nullptr);
      for (int64_t t = 0; t < 18; ++t) {
        at::Tensor expect = at::zeros({c.hidden_size}, at::kDouble);
        for (int64_t e = 0; e < 4; ++e) {
          if (!r.routing_map[t][e].item<bool>()) continue;
          at::Tensor w1, b1, w2, b2;
          if (grouped) {
            w1 = moe.experts->linear_fc1->weights[e];
            w2 = moe.experts->linear_fc2->weights[e];
            if (!gated)
              b1 = moe.experts->linear_fc1->biases[e], b2 = moe.experts->linear_fc2->biases[e];
          } else {
            w1 = moe.experts->local_experts[e]->fc1_weight;
            w2 = moe.experts->local_experts[e]->fc2_weight;
            b1 = moe.experts->local_experts[e]->fc1_bias;
            b2 = moe.experts->local_experts[e]->fc2_bias;
          }
          at::Tensor h1 = at::matmul(w1, tokens[t]);
          if (b1.defined()) h1 = h1 + b1;
          const at::Tensor act =
              gated ? at::silu(h1.narrow(0, 0, 32)) * h1.narrow(0, 32, 32) : at::gelu(h1);
          at::Tensor out = at::matmul(w2, act);
          if (b2.defined()) out = out + b2;
          expect =
              expect + r.probs[t][e] * out;  // the bias too is weighted (Megatron's _apply_bias)
        }
        if (gated) {
          auto& se = *moe.shared_experts;
          const at::Tensor h1 = at::matmul(se.linear_fc1->weight, tokens[t]);
          const at::Tensor act = at::silu(h1.narrow(0, 0, 16)) * h1.narrow(0, 16, 16);
          const double gate =
              at::sigmoid(at::dot(moe.shared_expert_gate[0], tokens[t])).item<double>();
          expect = expect + at::matmul(se.linear_fc2->weight, act) * gate;
        }
        EXPECT_TRUE(at::allclose(y[t], expect, 1e-10, 1e-12))
            << "token " << t << " grouped " << grouped << " gated " << gated;
      }
    }
  }
}

// ---- exactness --------------------------------------------------------------------------------

using MoEVariant = actmem::testing::ConfigEdit;
using MoEStrategy = actmem::testing::ConfigEdit;

void shared(TransformerConfig& c) {
  c.add_bias_linear = false;
  c.moe_shared_expert_intermediate_size = 24;
  c.moe_shared_expert_gate = true;
}

const MoEVariant kVariants[] = {
    {"Dropless", [](TransformerConfig&) {}},
    {"Capacity", [](TransformerConfig& c) { c.moe_expert_capacity_factor = 1.0; }},
    {"CapacityPaddedByPosition",
     [](TransformerConfig& c) {
       c.moe_expert_capacity_factor = 0.75;
       c.moe_pad_expert_input_to_capacity = true;
       c.moe_token_drop_policy = "position";
     }},
    {"SharedSwiGLURMSNorm",
     [](TransformerConfig& c) {
       shared(c);
       c.gated_linear_unit = true;
       c.normalization = "RMSNorm";
     }},
    {"MixedEveryOtherLayerShared",
     [](TransformerConfig& c) {
       shared(c);
       c.moe_layer_freq = "2";
     }},
    {"SigmoidTop1Capacity",
     [](TransformerConfig& c) {
       c.moe_router_score_function = "sigmoid";
       c.moe_router_topk = 1;
       c.moe_router_topk_scaling_factor = 2.0;
       c.moe_expert_capacity_factor = 1.5;
     }},
};

const MoEStrategy kMoEStrategies[] = {
    {"RecomputeMoe", [](TransformerConfig& c) { selective(c, {"moe"}); }},
    {"RecomputeMoeAct", [](TransformerConfig& c) { selective(c, {"moe_act"}); }},
    {"RecomputeLayernormMoeAct",
     [](TransformerConfig& c) {
       selective(c, {"layernorm", "moe_act"});
     }},
    {"RecomputeSharedExperts",
     [](TransformerConfig& c) {
       if (!c.moe_shared_expert_intermediate_size) shared(c);
       selective(c, {"shared_experts"});
     }},
    {"RecomputeAllMoE",
     [](TransformerConfig& c) {
       selective(c, {"core_attn", "layernorm", "moe", "moe_act"});
       if (c.moe_shared_expert_intermediate_size) c.recompute_modules->push_back("shared_experts");
     }},
    {"MoeLayerRecomputeAlias", [](TransformerConfig& c) { c.moe_layer_recompute = true; }},
    {"FullUniform2",
     [](TransformerConfig& c) {
       c.recompute_granularity = "full";
       c.recompute_method = "uniform";
       c.recompute_num_layers = 2;
     }},
    {"OffloadExpertFc1", [](TransformerConfig& c) { offload(c, {"expert_fc1"}); }},
    {"OffloadMoeAct", [](TransformerConfig& c) { offload(c, {"moe_act"}); }},
    {"OffloadAndRecomputeMoeAct",
     [](TransformerConfig& c) {
       offload(c, {"moe_act"});
       selective(c, {"moe_act"});
     }},
    {"OffloadMlpNormExpertsRecomputeLayernormMoeAct",
     [](TransformerConfig& c) {
       offload(c, {"mlp_norm", "expert_fc1", "moe_act"});
       selective(c, {"layernorm", "moe_act"});
     }},
    {"LayerOffload2",
     [](TransformerConfig& c) {
       c.cpu_offloading_num_layers = 2;
       c.min_offloaded_tensor_size = 64;
     }},
};

class MoEExactness : public ::testing::TestWithParam<actmem::testing::ExactnessCase> {};

TEST_P(MoEExactness, BitwiseEqualToPlainOverThreeSteps) {
  actmem::testing::ExactnessHooks hooks;
  hooks.adjust = [](TransformerConfig& plain, TransformerConfig& strat) {
    // The shared-experts strategy adds shared experts; the plain run gets the same model.
    if (strat.moe_shared_expert_intermediate_size && !plain.moe_shared_expert_intermediate_size) {
      shared(plain);
    }
  };
  hooks.training = [](TrainingConfig& t) { t.train_iters = 3; };
  double aux_loss_coeff = 0.0;
  hooks.per_step = [&aux_loss_coeff](const actmem::IterationStats& s) {
    EXPECT_TRUE(s.moe);
    // The auxiliary losses were attached (and logged) once per micro-batch, replays included.
    if (aux_loss_coeff > 0) EXPECT_TRUE(s.load_balancing_loss.has_value());
  };
  TransformerConfig base = moe_model();
  std::get<0>(GetParam()).apply(base);
  aux_loss_coeff = base.moe_aux_loss_coeff;
  actmem::testing::expect_strategy_exact(moe_model(), GetParam(), hooks);
}

// 16 bits for the dropless and shared variants (the others repeat the same paths).
INSTANTIATE_TEST_SUITE_P(Strategies, MoEExactness,
                         ::testing::ValuesIn(actmem::testing::exactness_cases(
                             kVariants, kMoEStrategies, {"Dropless", "SharedSwiGLURMSNorm"})),
                         actmem::testing::exactness_case_name);

TEST(MoEExactnessSequential, OneMlpPerExpertUnderMoeAndSharedRecompute) {
  // Without --moe-grouped-gemm (SequentialMLP): moe and shared_experts recompute, full recompute.
  for (auto apply : {+[](TransformerConfig& c) {
                       selective(c, {"moe", "shared_experts"});
                     },
                     +[](TransformerConfig& c) {
                       c.recompute_granularity = "full";
                       c.recompute_method = "block";
                       c.recompute_num_layers = 3;
                     }}) {
    TransformerConfig base = moe_model();
    base.moe_grouped_gemm = false;
    shared(base);
    TransformerConfig strat = base;
    apply(strat);
    TrainingConfig t;
    t.global_batch_size = 4;
    t.eval_interval = 0;
    Trainer other(strat, t);
    SCOPED_TRACE(strat.recompute_granularity);
    actmem::testing::expect_bitwise_equal_to_plain(base, t, other, 3);
  }
}

TEST(MoEMemory, TheProcessDoesNotGrowFromStepToStep) {
  // Each expert's rows follow the routing, so the step's tensor sizes change from step to step.
  // Served straight by malloc they fragmented its heap: on this model the process grew by ~2.5 MB
  // per step and kept growing (Note [Caching the tracked CPU allocator's blocks]): ~80 MB over the
  // 30 steps measured here. With the cache the classes warm up over the first ~40 steps (the
  // routing reaches new sizes ever more rarely), then what malloc holds barely moves: 3-4 MB.
  TransformerConfig c = actmem::testing::shaped_model(2, 128, 4, 512, 128, 4);
  c.num_moe_experts = 4;
  c.moe_router_topk = 2;
  c.moe_grouped_gemm = false;
  TrainingConfig t;
  t.global_batch_size = 4;
  t.eval_interval = 0;
  Trainer trainer(c, t);
  auto held = [] {
    const struct mallinfo2 m = mallinfo2();
    return static_cast<int64_t>(m.arena + m.hblkhd);
  };
  for (int i = 0; i < 30; ++i) trainer.train_step(false);
  const int64_t warm = held();
  for (int i = 0; i < 30; ++i) trainer.train_step(false);
  EXPECT_LT(held() - warm, int64_t{16} << 20)
      << "malloc held " << warm << " bytes after 30 steps, " << held() << " after 60";
}

TEST(MoEOffload, ARowSegmentBelowTheThresholdGoesWithItsOffloadedStorage) {
  // The permuted tokens [96, 32] (3072 elements) are offloaded and released once copied; each
  // expert's row segment (~24 rows, ~768 elements) is below a threshold of 2000 but is a view of
  // that storage, so it must come back with it rather than stay behind pointing at freed memory.
  TransformerConfig base = moe_model();
  TransformerConfig strat = base;
  offload(strat, {"expert_fc1"});
  strat.min_offloaded_tensor_size = 2000;
  TrainingConfig t;
  t.global_batch_size = 4;
  t.eval_interval = 0;
  Trainer other(strat, t);
  int64_t offloaded = 0;
  actmem::testing::expect_bitwise_equal_to_plain(
      base, t, other, 2, [&](const actmem::IterationStats& s) { offloaded += s.offloaded_bytes; });
  EXPECT_GT(offloaded, 0);
}

TEST(MoERecompute, ForwardReplaysPerStrategy) {
  auto count = [](void (*apply)(TransformerConfig&)) {
    TransformerConfig c = moe_model();
    apply(c);
    TrainingConfig t;
    t.eval_interval = 0;
    Trainer trainer(c, t);
    actmem::forward_counters().reset();
    actmem::recompute_counters().reset();
    trainer.train_step(false);
    return std::make_pair(actmem::forward_counters().moe.load(),
                          actmem::recompute_counters().output_recomputes.load());
  };
  EXPECT_EQ(count([](TransformerConfig&) {}), std::make_pair(int64_t{4}, int64_t{0}));
  // moe: each of the 4 MoE layers runs twice; moe_act: each layer's activation recomputed once.
  EXPECT_EQ(count([](TransformerConfig& c) { selective(c, {"moe"}); }).first, 8);
  EXPECT_EQ(count([](TransformerConfig& c) { selective(c, {"moe_act"}); }),
            std::make_pair(int64_t{4}, int64_t{4}));
}

// ---- memory ------------------------------------------------------------------------------------

class MoEPredictor : public ::testing::TestWithParam<std::tuple<MoEVariant, const char*>> {};

TEST_P(MoEPredictor, ExactAgainstTheTrackerAndTheLedgerPerModule) {
  const std::pair<const char*, void (*)(TransformerConfig&)> policies[] = {
      {"plain", [](TransformerConfig&) {}},
      {"moe", [](TransformerConfig& c) { selective(c, {"moe"}); }},
      {"moe_act", [](TransformerConfig& c) { selective(c, {"moe_act"}); }},
      {"layernorm+moe_act+core_attn",
       [](TransformerConfig& c) {
         selective(c, {"layernorm", "moe_act", "core_attn"});
       }},
      {"shared_experts",
       [](TransformerConfig& c) {
         if (c.moe_shared_expert_intermediate_size) selective(c, {"shared_experts"});
       }},
      {"sequential", [](TransformerConfig& c) { c.moe_grouped_gemm = false; }},
      {"full",
       [](TransformerConfig& c) {
         c.recompute_granularity = "full";
         c.recompute_method = "block";
         c.recompute_num_layers = 2;
       }},
  };
  for (const auto& [policy, apply] : policies) {
    TransformerConfig c = moe_model();
    actmem::testing::set_precision(c, std::get<1>(GetParam()));
    std::get<0>(GetParam()).apply(c);
    apply(c);
    actmem::testing::expect_predictor_matches_tracker(c, policy);
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, MoEPredictor,
                         ::testing::Combine(::testing::ValuesIn(kVariants),
                                            ::testing::ValuesIn(actmem::testing::kPrecisions)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param).name) + "_" +
                                  std::get<1>(info.param);
                         });

TEST(MoEPredictor, StepPeakBoundCoversMoEModels) {
  // The trainer's memory pre-check (predict_step_peak_bound) stays an upper bound of the measured
  // peak with MoE layers: dropless, capacity (the worst routing), shared SwiGLU experts, bf16.
  for (int i = 0; i < 4; ++i) {
    TransformerConfig c = moe_model();
    if (i == 1) c.moe_expert_capacity_factor = 2.0;
    if (i == 2) shared(c), c.gated_linear_unit = true;
    if (i == 3) actmem::testing::set_precision(c, "bf16");
    TrainingConfig t;
    t.eval_interval = 0;
    Trainer trainer(c, t);
    int64_t peak = 0;
    for (int step = 0; step < 2; ++step)
      peak = std::max(peak, trainer.train_step(false).peak_device_bytes);
    EXPECT_GE(actmem::predict_step_peak_bound(c), static_cast<double>(peak)) << "config " << i;
  }
}

TEST(MoEPredictorRouting, DroplessAndPaddedNeedNoRoutingCapacityDoes) {
  TransformerConfig c = moe_model();
  const int64_t T = c.seq_length * c.micro_batch_size;  // 48
  EXPECT_EQ(actmem::moe_expert_rows(c, 0), T * 2);
  c.moe_expert_capacity_factor = 0.5;
  EXPECT_FALSE(actmem::moe_expert_rows(c, 0).has_value());
  expect_error_containing([&] { actmem::predict_activation_bytes(c); }, "pass the router's counts");
  const actmem::MoERouting routing(4, std::vector<int64_t>{12, 12, 5, 3});
  EXPECT_EQ(actmem::moe_expert_rows(c, 2, &routing), 32);
  c.moe_pad_expert_input_to_capacity = true;
  EXPECT_EQ(actmem::moe_expert_rows(c, 0), 4 * 12);  // capacity ceil(48 * 2 / 4 * 0.5) = 12
}

TEST(MoEEstimate, TermsEqualThePredictorsMoEModulesAtBf16) {
  // actmem estimate's MoE terms (doubles, the paper's style) against the exact predictor's MoE
  // modules (checked against the tracker above) for the same model at bf16.
  struct Case {
    const char* name;
    void (*apply)(TransformerConfig&);
  };
  const Case cases[] = {
      {"dropless GeLU", [](TransformerConfig&) {}},
      {"SwiGLU, shared experts, no z-loss",
       [](TransformerConfig& c) {
         c.gated_linear_unit = true;
         c.add_bias_linear = false;
         c.moe_shared_expert_intermediate_size = 24;
         c.moe_z_loss_coeff.reset();
       }},
      {"padded capacity, no aux loss",
       [](TransformerConfig& c) {
         c.moe_expert_capacity_factor = 0.75;
         c.moe_pad_expert_input_to_capacity = true;
         c.moe_aux_loss_coeff = 0.0;
       }},
  };
  for (const auto& k : cases) {
    TransformerConfig c = moe_model();
    c.bf16 = true;
    c.moe_expert_dropout = 0.0;  // Megatron's experts have no dropout
    k.apply(c);
    actmem::PaperShape m;
    m.s = static_cast<double>(c.seq_length), m.b = static_cast<double>(c.micro_batch_size);
    m.h = static_cast<double>(c.hidden_size), m.a = static_cast<double>(c.num_attention_heads);
    m.L = static_cast<double>(c.num_layers), m.ffn = static_cast<double>(c.ffn()), m.v = 256;
    m.swiglu = c.gated_linear_unit;
    m.moe.experts = static_cast<double>(c.num_moe_experts);
    m.moe.topk = static_cast<double>(c.moe_router_topk);
    m.moe.ffn = static_cast<double>(c.moe_ffn());
    m.moe.shared_ffn = static_cast<double>(c.moe_shared_expert_intermediate_size.value_or(0));
    m.moe.capacity_factor = c.moe_expert_capacity_factor.value_or(0.0);
    m.moe.pad_to_capacity = c.moe_pad_expert_input_to_capacity;
    m.moe.aux_loss = c.moe_aux_loss_coeff > 0;
    m.moe.z_loss = c.moe_z_loss_coeff.has_value();
    const actmem::MoELayerBytes estimate = actmem::paper_moe_layer_bytes(m);
    const auto predicted = actmem::predict_activation_bytes(c, 2);
    int64_t mlp = 0;
    for (const auto& [module, bytes] : predicted.by_module) {
      if (module.rfind("decoder.layers.0.mlp.", 0) == 0) mlp += bytes;
    }
    EXPECT_EQ(static_cast<double>(mlp), estimate.mlp()) << k.name;
    EXPECT_EQ(estimate.rows, static_cast<double>(*actmem::moe_expert_rows(c, 0))) << k.name;
  }
  // The command: a mixed model's first stage is the mix of dense and MoE layers.
  const auto r = actmem::testing::run_actmem(
      "estimate --json --seq-length 4096 --micro-batch-size 1 --hidden-size 2048 "
      "--num-attention-heads 16 --num-layers 8 --ffn-hidden-size 8192 --vocab-size 32000 "
      "--tensor-model-parallel-size 1 "
      "--pipeline-model-parallel-size 1 --no-sequence-parallel --num-experts 8 --moe-router-topk 2 "
      "--moe-ffn-hidden-size 1024 --moe-layer-freq 2 --moe-aux-loss-coeff 0.01");
  ASSERT_EQ(r.exit_code, 0) << r.output << r.stderr_text;
  const auto j = nlohmann::json::parse(r.output);
  const double dense = j["moe"]["dense_layer_bytes"]["none"].get<double>();
  const double moe = j["moe"]["per_moe_layer_bytes"]["none"].get<double>();
  EXPECT_EQ(j["moe"]["moe_layers"].get<double>(), 4);
  EXPECT_DOUBLE_EQ(j["per_stage_bytes"]["none"].get<double>(), 4 * dense + 4 * moe);
  EXPECT_EQ(j["moe"]["rows_per_layer"].get<double>(), 4096 * 2);
  const auto bad = actmem::testing::run_actmem("estimate --num-experts 4 --moe-router-topk 8");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.stderr_text.find("moe_router_topk must be between 1 and num_moe_experts (4)"),
            std::string::npos)
      << bad.stderr_text;
}

TEST(MoECheckpoint, ResumesBitwiseRefusesAnotherExpertCountAndGenerates) {
  TransformerConfig c = moe_model();
  c.moe_expert_capacity_factor = 1.0;
  c.moe_layer_freq = "[1,0,1,1]";
  TrainingConfig t;
  t.eval_interval = 0;
  t.global_batch_size = 4;
  const std::string dir = actmem::testing::fresh_temp_dir("moe_ckpt");
  Trainer through(c, t), first(c, t);
  for (int i = 0; i < 2; ++i) {
    through.train_step();
    first.train_step();
  }
  first.save_checkpoint(dir);
  Trainer resumed(c, t);
  ASSERT_EQ(resumed.load_checkpoint(dir), 2);
  for (int i = 0; i < 2; ++i) {
    const auto a = through.train_step(), b = resumed.train_step();
    EXPECT_EQ(a.loss, b.loss);
    EXPECT_EQ(a.grad_digest, b.grad_digest);
  }
  TransformerConfig other = c;
  other.num_moe_experts = 8;
  Trainer wrong(other, t);
  expect_error_containing([&] { wrong.load_checkpoint(dir); }, "num_moe_experts");
  TransformerConfig dense = actmem::testing::small_model();
  Trainer dense_run(dense, t);
  expect_error_containing(
      [&] { dense_run.load_checkpoint(dir); },
      "the checkpoint has num_moe_experts = 4 but this run has num_moe_experts = null");
  // Inference rebuilds the MoE model from the checkpoint's args: the same logits as training's.
  const actmem::LoadedModel loaded = actmem::load_model_for_inference(dir);
  ASSERT_TRUE(loaded.model->decoder->layers[0]->mlp_as<MoELayer>());
  ASSERT_FALSE(loaded.model->decoder->layers[1]->mlp_as<MoELayer>());
  first.model().eval();
  at::NoGradGuard g;
  const at::Tensor tokens = at::randint(0, 256, {2, 24}, at::kLong);
  EXPECT_TRUE(
      actmem::testing::bitwise_equal(first.model().logits(tokens), loaded.model->logits(tokens)));
}

TEST(MoETraining, ExpertDropoutDrawsFromTheExpertStream) {
  // The expert dropout forks the expert-parallel stream: the default (data-parallel) generator
  // advances exactly as in a run without expert dropout, and the two runs' losses differ.
  TransformerConfig with = moe_model();
  TransformerConfig without = with;
  without.moe_expert_dropout = 0.0;
  TrainingConfig t;
  t.eval_interval = 0;
  Trainer a(with, t), b(without, t);
  const auto sa = a.train_step(), sb = b.train_step();
  EXPECT_NE(sa.loss, sb.loss);
  ASSERT_EQ(a.rng_state().size(), b.rng_state().size());
  for (size_t g = 0; g < a.rng_state().size(); ++g) {
    EXPECT_TRUE(actmem::testing::bitwise_equal(a.rng_state()[g], b.rng_state()[g]));
  }
}

TEST(MoETraining, LogsLossesImbalanceAndDroppedTokens) {
  TransformerConfig c = moe_model();
  c.moe_expert_capacity_factor = 0.5;
  TrainingConfig t;
  t.global_batch_size = 4;
  t.eval_interval = 0;
  Trainer trainer(c, t);
  const auto s = trainer.train_step();
  ASSERT_TRUE(s.moe);
  // 4 MoE layers x 2 micro-batches x 48 tokens x top-2.
  EXPECT_EQ(s.moe_routed_tokens, 4 * 2 * 48 * 2);
  EXPECT_GT(s.moe_dropped_tokens, 0);
  EXPECT_LE(s.moe_dropped_tokens, s.moe_routed_tokens);
  ASSERT_TRUE(s.load_balancing_loss && s.z_loss);
  EXPECT_GT(*s.load_balancing_loss, 0.0);
  EXPECT_GT(*s.z_loss, 0.0);
  EXPECT_GE(s.expert_load_imbalance, 1.0);
  const nlohmann::json j = actmem::to_json(s);
  EXPECT_EQ(j.at("moe_dropped_tokens").get<int64_t>(), s.moe_dropped_tokens);
  EXPECT_EQ(j.at("load_balancing_loss").get<double>(), *s.load_balancing_loss);
}

}  // namespace
