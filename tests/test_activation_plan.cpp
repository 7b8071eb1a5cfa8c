// test_activation_plan.cpp — the plan is resolved once and read by both the model and the
// predictor: for a sweep of plans (from flags, and per-layer plans no flag can express) the
// bytes each layer saves, measured by the ledger, equal the predictor's for that layer.
#include "actmem/base/compat.h"
#include "actmem/config/activation_plan.h"
#include "actmem/memory/ledger.h"
#include "actmem/memory/memory_model.h"
#include "actmem/model/activation_bytes.h"
#include "actmem/model/model.h"
#include "actmem/recompute/rng.h"
#include "fixtures.h"
#include "test_util.h"

#include <ATen/CPUGeneratorImpl.h>

#include <map>
#include <set>
#include <sstream>

namespace actmem {
namespace {

using actmem::testing::expect_error_containing;

// "decoder.layers.3.mlp.linear_fc1" -> 3; -1 outside the layers.
int64_t layer_of(const std::string& module) {
  const std::string prefix = "decoder.layers.";
  if (module.rfind(prefix, 0) != 0) return -1;
  return std::stoll(module.substr(prefix.size()));
}

std::map<int64_t, int64_t> per_layer(const std::vector<std::pair<std::string, int64_t>>& modules) {
  std::map<int64_t, int64_t> bytes;
  for (const auto& [module, b] : modules) {
    if (module != "loss value") bytes[layer_of(module)] += b;  // held by the caller, not saved
  }
  return bytes;
}

// One training forward of `model` under the ledger; returns its bytes per layer (-1: outside).
std::map<int64_t, int64_t> measured_per_layer(GPTModel& model) {
  // The named streams a Trainer has (each checkpoint snapshots them, and the predictor counts
  // the snapshot's bytes).
  model_parallel_manual_seed(1234);
  model.train();
  const auto& c = model.config();
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const at::Tensor tokens =
      at::randint(c.vocab_size, {c.micro_batch_size, c.seq_length}, gen, at::kLong);
  const at::Tensor labels =
      at::randint(c.vocab_size, {c.micro_batch_size, c.seq_length}, gen, at::kLong);
  ActivationLedger ledger;
  ledger.exclude(model.ordered_parameters());
  for (const auto& b : model.buffers()) ledger.exclude(b);
  ledger.exclude(model.attention_mask());
  ledger.exclude(tokens);
  ledger.exclude(labels);
  at::Tensor loss;
  {
    LedgerScope scope(ledger);
    loss = model.forward(tokens, labels);
  }
  auto bytes = per_layer(ledger.bytes_by_module());
  // What the ledger cannot see: each checkpoint's random-state snapshot, kept in the checkpoint
  // itself. The checkpoints that ran are the modules whose inputs a checkpoint op saved.
  std::set<std::string> checkpoints;
  for (const auto& r : ledger.records()) {
    if (r.op == "actmem::checkpoint" || r.op == "actmem::checkpoint_without_output") {
      checkpoints.insert(r.module);
    }
  }
  for (const auto& module : checkpoints) bytes[layer_of(module)] += checkpoint_snapshot_bytes();
  loss.backward();  // the recompute hooks run; the graph is freed
  return bytes;
}

void expect_layers_agree(GPTModel& model, const std::string& what) {
  const auto measured = measured_per_layer(model);
  // The predictor walks the very plan the model executes.
  const auto predicted = per_layer(
      predict_activation_bytes(model.config(), model.plan(), /*dtype_bytes=*/8).by_module);
  for (int64_t i = -1; i < model.config().num_layers; ++i) {
    const int64_t m = measured.count(i) ? measured.at(i) : 0;
    const int64_t p = predicted.count(i) ? predicted.at(i) : 0;
    EXPECT_EQ(m, p) << what << ", layer " << i;
  }
}

// Beyond the shared sweep: the chunkings that shape the plan most (one layer per chunk, a clamped
// tail, a block of two).
const std::pair<const char*, void (*)(TransformerConfig&)> kMoreChunkings[] = {
    {"full uniform 1",
     [](TransformerConfig& c) {
       c.recompute_granularity = "full";
       c.recompute_method = "uniform";
       c.recompute_num_layers = 1;
     }},
    {"full uniform 3 (clamped tail)",
     [](TransformerConfig& c) {
       c.recompute_granularity = "full";
       c.recompute_method = "uniform";
       c.recompute_num_layers = 3;
     }},
    {"full block 2",
     [](TransformerConfig& c) {
       c.recompute_granularity = "full";
       c.recompute_method = "block";
       c.recompute_num_layers = 2;
     }},
};

TEST(ActivationPlan, ModelAndPredictorAgreeLayerByLayerForEveryFlagPlan) {
  std::vector<std::pair<const char*, void (*)(TransformerConfig&)>> plans(
      std::begin(actmem::testing::kRecomputePolicies),
      std::end(actmem::testing::kRecomputePolicies));
  plans.insert(plans.end(), std::begin(kMoreChunkings), std::end(kMoreChunkings));
  for (const bool variant : {false, true}) {
    for (const auto& [name, apply] : plans) {
      TransformerConfig c = actmem::testing::small_model();
      if (variant) {
        c.normalization = "RMSNorm";
        c.gated_linear_unit = true;
        c.position_embedding_type = "rope";
      }
      apply(c);
      GPTModel model(c, at::kDouble);
      expect_layers_agree(model, std::string(name) + (variant ? " (RMSNorm, SwiGLU, RoPE)" : ""));
    }
  }
}

TEST(ActivationPlan, APerLayerPlanNoFlagCanExpressRunsAndIsPredicted) {
  // Layer 0 recomputes core attention, layer 1 its MLP, layer 2 discards its norm outputs,
  // layer 3 keeps everything: the model executes it and the predictor, reading the same plan,
  // agrees layer by layer. (The flags can only give every layer the same selective modules.)
  const TransformerConfig c = actmem::testing::small_model();
  ActivationPlan plan = make_activation_plan(c);
  plan.layers[0].recompute_module[static_cast<size_t>(RecomputeModule::kCoreAttn)] = true;
  plan.layers[1].recompute_module[static_cast<size_t>(RecomputeModule::kMlp)] = true;
  plan.layers[2].recompute_module[static_cast<size_t>(RecomputeModule::kLayernorm)] = true;
  GPTModel model(c, plan, at::kDouble);
  expect_layers_agree(model, "per-layer selective plan");
  // And it differs from keeping everything in exactly the layers whose plan says so. (Not
  // always downwards: on this tiny model layer 2's two random-state snapshots outweigh the two
  // small norm outputs it frees, which the predictor says as well.)
  GPTModel keep(c, at::kDouble);
  const auto planned = measured_per_layer(model), kept = measured_per_layer(keep);
  EXPECT_LT(planned.at(0), kept.at(0));
  EXPECT_LT(planned.at(1), kept.at(1));
  EXPECT_NE(planned.at(2), kept.at(2));
  EXPECT_EQ(planned.at(3), kept.at(3));
}

TEST(ActivationPlan, ResolvesMegatronsDefaultsOnce) {
  TransformerConfig c = actmem::testing::small_model();
  c.recompute_granularity = "selective";
  ActivationPlan p = make_activation_plan(c);
  EXPECT_EQ(p.granularity, RecomputeGranularity::kSelective);
  EXPECT_EQ(p.recompute_modules, std::vector<RecomputeModule>{RecomputeModule::kCoreAttn});
  for (const auto& l : p.layers) {
    EXPECT_TRUE(l.recomputes(RecomputeModule::kCoreAttn));
    EXPECT_FALSE(l.in_chunk());
  }
  c = actmem::testing::small_model();
  c.cpu_offloading_num_layers = 2;
  p = make_activation_plan(c);
  ASSERT_EQ(p.layers.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_TRUE(p.layers[i].layer_group);  // every layer marks its backward for the prefetch
    EXPECT_EQ(p.layers[i].offload_layer, i < 2);
  }
  c = actmem::testing::small_model();
  c.fine_grained_activation_offloading = true;
  c.offload_modules = {"attn_norm", "core_attn", "attn_proj"};
  p = make_activation_plan(c);
  EXPECT_TRUE(p.layers[3].offloads(OffloadModule::kAttnProj));
  EXPECT_FALSE(p.layers[3].offloads(OffloadModule::kQkvLinear));
  EXPECT_EQ(p.summary(),
            "recompute none | offload modules: attn_norm core_attn attn_proj, "
            "tensors of at least 1048576 elements");
}

TEST(ActivationPlan, NamesRoundTripThroughTheOneTable) {
  for (const auto& [m, name] : kRecomputeModuleNames) {
    EXPECT_EQ(parse_recompute_module(to_string(m)), m);
    EXPECT_EQ(std::string(to_string(m)), std::string(name));
  }
  for (const auto& [m, name] : kOffloadModuleNames) {
    EXPECT_EQ(parse_offload_module(to_string(m)), m);
  }
  EXPECT_FALSE(parse_recompute_module("qkv").has_value());
  EXPECT_FALSE(parse_offload_module("mlp").has_value());
}

TEST(ActivationPlan, AnInconsistentPlanIsRefused) {
  const TransformerConfig c = actmem::testing::small_model();
  ActivationPlan p = make_activation_plan(c);
  p.layers.pop_back();
  expect_error_containing([&] { GPTModel m(c, p); }, "the plan has 3 layers, the model 4");
  p = make_activation_plan(c);
  p.chunks = {{0, 2}};
  p.layers[0].chunk = p.layers[1].chunk = 0;
  p.layers[0].starts_chunk = true;
  p.layers[1].recompute_module[static_cast<size_t>(RecomputeModule::kMlp)] = true;
  expect_error_containing([&] { check_activation_plan(c, p); },
                          "layer 1 runs in a full-recompute chunk and cannot also recompute");
  p.layers[1].recompute_module[static_cast<size_t>(RecomputeModule::kMlp)] = false;
  p.layers[1].starts_chunk = true;
  expect_error_containing([&] { check_activation_plan(c, p); },
                          "layer 1 does not say it runs in chunk 0");
}

TEST(ActivationPlan, InspectPrintsThePlanPerLayer) {
  const auto r = actmem::testing::run_actmem(
      "inspect --plan --num-layers 3 --recompute-granularity full --recompute-method block "
      "--recompute-num-layers 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("recompute full, block 2 | offload none"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("0       full, chunk 0 (layers 0-0): keeps its input"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("2       keep"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace actmem
