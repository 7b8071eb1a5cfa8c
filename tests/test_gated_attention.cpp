// test_gated_attention.cpp — attention as Qwen3 and Qwen3-Next shape it, with Megatron's flags:
// heads wider than h / a (--kv-channels), norms on each query and key head (--qk-layernorm),
// the output gate (--attention-output-gate), partial RoPE (--rotary-percent) and zero-centred
// norms (--apply-layernorm-1p). Their rules, parameter names and shapes, the layer against a
// reference written from the formulas, every strategy bitwise equal to the plain run, and the
// exact predictor against the tracker and the ledger.
#include "actmem/flags/presets.h"
#include "actmem/memory/memory_model.h"
#include "actmem/model/activation_bytes.h"
#include "actmem/model/model.h"
#include "actmem/train/trainer.h"
#include "exactness.h"
#include "fixtures.h"
#include "test_util.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>

namespace {

using actmem::GPTModel;
using actmem::Trainer;
using actmem::TrainingConfig;
using actmem::TransformerConfig;
using actmem::testing::expect_error_containing;
using actmem::testing::offload;
using actmem::testing::selective;

// small_model (4 layers, h 32, 4 heads, s 24, b 2) with Qwen3-Next's attention: heads of 16
// (a d = 64, twice h), 2 key/value groups, q/k norms, the output gate, RoPE on half of each head,
// zero-centred RMSNorm, SwiGLU, no biases.
TransformerConfig gated_model() {
  TransformerConfig c = actmem::testing::small_model();
  c.kv_channels_arg = 16;
  c.num_query_groups = 2;
  c.qk_layernorm = true;
  c.attention_output_gate = true;
  c.position_embedding_type = "rope";
  c.rotary_percent = 0.5;
  c.layernorm_zero_centered_gamma = true;
  c.normalization = "RMSNorm";
  c.gated_linear_unit = true;
  c.add_bias_linear = false;
  c.untie_embeddings_and_output_weights = true;
  return c;
}

using GatedCase = actmem::testing::ConfigEdit;

// ---- rules, names, shapes ---------------------------------------------------------------------

TEST(GatedAttentionConfig, RulesWithMegatronsMessages) {
  auto refused = [](const std::function<void(TransformerConfig&)>& edit,
                    const std::string& needle) {
    TransformerConfig c = gated_model();
    edit(c);
    expect_error_containing([&] { c.validate(); }, needle);
  };
  EXPECT_NO_THROW(gated_model().validate());
  {
    // With --kv-channels the heads need not tile h (Megatron asserts h % a only without it).
    TransformerConfig c = gated_model();
    c.num_attention_heads = 6;
    c.num_query_groups = 3;
    EXPECT_NO_THROW(c.validate());
    c.kv_channels_arg.reset();
    expect_error_containing([&] { c.validate(); },
                            "num_attention_heads (6) must divide hidden_size (32)");
  }
  refused([](TransformerConfig& c) { c.kv_channels_arg = 0; }, "kv_channels must be positive");
  refused([](TransformerConfig& c) { c.rotary_percent = 0.0; }, "rotary_percent must be in (0, 1]");
  refused([](TransformerConfig& c) { c.rotary_percent = 1.5; }, "rotary_percent must be in (0, 1]");
  // int(16 x 0.3) = 4 is even; int(16 x 0.2) = 3 is not.
  EXPECT_NO_THROW([] {
    TransformerConfig c = gated_model();
    c.rotary_percent = 0.3;
    c.validate();
  }());
  refused([](TransformerConfig& c) { c.rotary_percent = 0.2; }, "= 3, must be even and positive");
  refused([](TransformerConfig& c) { c.position_embedding_type = "learned_absolute"; },
          "applies to rotary positions");
  refused(
      [](TransformerConfig& c) {
        c.rotary_percent = 1.0;
        c.num_query_groups = 0;
        c.multi_latent_attention = true;
      },
      "Output gate is not supported for MLA yet.");
}

TEST(GatedAttentionModel, MegatronsParameterNamesShapesAndInitialisation) {
  const TransformerConfig c = gated_model();
  GPTModel model(c);
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& p : model.named_parameters()) shapes[p.key()] = p.value().sizes().vec();
  const std::string attn = "decoder.layers.0.self_attention.";
  // Per group [2 query heads | 2 gate heads | key | value] of 16: 2 x 6 x 16 = 192 rows.
  EXPECT_EQ(shapes.at(attn + "linear_qkv.weight"), (std::vector<int64_t>{192, 32}));
  EXPECT_EQ(shapes.at(attn + "linear_proj.weight"), (std::vector<int64_t>{32, 64}));
  EXPECT_EQ(shapes.at(attn + "q_layernorm.weight"), (std::vector<int64_t>{16}));
  EXPECT_EQ(shapes.at(attn + "k_layernorm.weight"), (std::vector<int64_t>{16}));
  // Zero-centred gamma: every norm's weight starts at zero (it multiplies by 1 + weight).
  for (const char* norm :
       {"decoder.layers.0.input_layernorm.weight",
        "decoder.layers.0.self_attention.q_layernorm.weight", "decoder.final_layernorm.weight"}) {
    const at::Tensor w = model.named_parameters()[norm];
    EXPECT_TRUE(at::equal(w, at::zeros_like(w))) << norm;
  }
  // Without the switches, the plain layout: (4 + 2 x 4) x 8 rows, 32 x 32 linear_proj.
  TransformerConfig plain = actmem::testing::small_model();
  GPTModel plain_model(plain);
  std::map<std::string, std::vector<int64_t>> plain_shapes;
  for (const auto& p : plain_model.named_parameters())
    plain_shapes[p.key()] = p.value().sizes().vec();
  EXPECT_EQ(plain_shapes.at(attn + "linear_qkv.weight"), (std::vector<int64_t>{96, 32}));
  EXPECT_EQ(plain_shapes.count(attn + "q_layernorm.weight"), 0u);
}

// The attention block against the formulas written out in double: linear_qkv's rows per group
// as Megatron lays them out, RMSNorm with (1 + weight) per query and key head, RoPE on the first
// rotary_percent of each head (frequencies base^(-2i/rot)), causal softmax attention with each
// group's key and value serving its query heads, the context times sigmoid(gate), linear_proj.
TEST(GatedAttentionModel, LayerEqualsTheFormulasWrittenOut) {
  for (const double percent : {0.5, 1.0}) {
    SCOPED_TRACE(percent);
    TransformerConfig c = gated_model();
    c.rotary_percent = percent;
    c.attention_dropout = 0.0;
    c.attention_backend = "unfused";
    GPTModel model(c, at::kDouble);
    auto& attn = *model.decoder->layers[0]->mixer_as<actmem::SelfAttention>();
    {
      at::NoGradGuard no_grad;  // weights other than the zero-centred zeros
      attn.q_layernorm->weight.copy_(at::linspace(-0.3, 0.4, 16, at::kDouble));
      attn.k_layernorm->weight.copy_(at::linspace(0.2, -0.1, 16, at::kDouble));
    }
    const int64_t s = 12, b = 2, h = 32, a = 4, G = 2, d = 16;
    const int64_t rot = static_cast<int64_t>(d * percent);
    at::Generator gen = at::detail::createCPUGenerator(7);
    const at::Tensor x = at::randn({s, b, h}, gen, at::TensorOptions().dtype(at::kDouble));
    const at::Tensor mask = actmem::make_causal_mask(s, x.device());
    const at::Tensor out = attn.forward(x, actmem::LayerContext{model.rope(), mask, nullptr}).first;

    const at::Tensor P = at::matmul(x, attn.linear_qkv->weight.t());  // [s, b, 192]
    const int64_t per = a / G, width = (2 * per + 2) * d;
    auto norm = [&](const at::Tensor& v, const at::Tensor& w) {  // RMSNorm, 1 + weight
      return v / (v.square().mean(-1, true) + c.layernorm_epsilon).sqrt() * (1.0 + w);
    };
    auto rope = [&](const at::Tensor& v) {  // v [s, d]: positions 0..s-1
      const at::Tensor pos = at::arange(s, at::kDouble).unsqueeze(1);
      const at::Tensor inv = at::pow(c.rotary_base, -at::arange(0, rot, 2, at::kDouble) / rot);
      const at::Tensor ang = at::cat({pos * inv, pos * inv}, -1);  // [s, rot]
      const at::Tensor r = v.narrow(-1, 0, rot), half1 = r.narrow(-1, 0, rot / 2),
                       half2 = r.narrow(-1, rot / 2, rot / 2);
      const at::Tensor rotated = r * ang.cos() + at::cat({-half2, half1}, -1) * ang.sin();
      return at::cat({rotated, v.narrow(-1, rot, d - rot)}, -1);
    };
    at::Tensor gated = at::zeros({s, b, a * d}, x.options());
    for (int64_t bi = 0; bi < b; ++bi) {
      for (int64_t g = 0; g < G; ++g) {
        const at::Tensor row = P.select(1, bi).narrow(-1, g * width, width);  // [s, width]
        const at::Tensor k = rope(norm(row.narrow(-1, 2 * per * d, d), attn.k_layernorm->weight));
        const at::Tensor v = row.narrow(-1, (2 * per + 1) * d, d);
        for (int64_t j = 0; j < per; ++j) {
          const int64_t head = g * per + j;
          const at::Tensor q = rope(norm(row.narrow(-1, j * d, d), attn.q_layernorm->weight));
          const at::Tensor gate = row.narrow(-1, (per + j) * d, d);
          at::Tensor scores = at::matmul(q, k.t()) / std::sqrt(static_cast<double>(d));
          scores = scores.masked_fill(at::ones({s, s}, at::kBool).triu(1), -1e30);
          const at::Tensor ctx = at::matmul(at::softmax(scores, -1), v);
          gated.select(1, bi).narrow(-1, head * d, d).copy_(ctx * at::sigmoid(gate));
        }
      }
    }
    const at::Tensor expected = at::matmul(gated, attn.linear_proj->weight.t());
    EXPECT_TRUE(at::allclose(out, expected, 1e-10, 1e-12))
        << (out - expected).abs().max().item<double>() << " of "
        << expected.abs().max().item<double>();
  }
}

// ---- exactness ---------------------------------------------------------------------------------

const GatedCase kGatedVariants[] = {
    {"Grouped", [](TransformerConfig&) {}},
    // One group per head, LayerNorm, whole RoPE, the flash kernel (no attention dropout), b 1.
    {"UngroupedFlashLayerNorm",
     [](TransformerConfig& c) {
       c.num_query_groups = 0;
       c.normalization = "LayerNorm";
       c.rotary_percent = 1.0;
       c.attention_dropout = 0.0;
       c.micro_batch_size = 1;
     }},
    // Qwen3-Next in miniature: a 3:1 GatedDeltaNet hybrid whose every MLP is an MoE layer with a
    // gated shared expert.
    {"Qwen3NextMini",
     [](TransformerConfig& c) {
       c.experimental_attention_variant = "gdn";
       c.linear_attention_freq = "4";
       c.linear_num_key_heads = 2;
       c.linear_num_value_heads = 4;
       c.linear_key_head_dim = 8;
       c.linear_value_head_dim = 6;
       c.num_moe_experts = 4;
       c.moe_router_topk = 2;
       c.moe_ffn_hidden_size = 16;
       c.moe_shared_expert_intermediate_size = 16;
       c.moe_shared_expert_gate = true;
       c.moe_grouped_gemm = true;
     }},
};

const GatedCase kGatedStrategies[] = {
    {"RecomputeCoreAttn", [](TransformerConfig& c) { selective(c, {"core_attn"}); }},
    {"RecomputeLayernormMlp",
     [](TransformerConfig& c) {
       selective(c, {"layernorm", "mlp"});
     }},
    {"FullUniform1",
     [](TransformerConfig& c) {
       c.recompute_granularity = "full";
       c.recompute_method = "uniform";
       c.recompute_num_layers = 1;
     }},
    {"FullBlock2",
     [](TransformerConfig& c) {
       c.recompute_granularity = "full";
       c.recompute_method = "block";
       c.recompute_num_layers = 2;
     }},
    {"OffloadEveryGroup",
     [](TransformerConfig& c) {
       offload(c, {"attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"});
     }},
    {"OffloadCoreAttnRecomputeLayernorm",
     [](TransformerConfig& c) {
       offload(c, {"core_attn", "attn_proj"});
       selective(c, {"layernorm"});
     }},
    {"LayerOffload2",
     [](TransformerConfig& c) {
       c.cpu_offloading_num_layers = 2;
       c.min_offloaded_tensor_size = 64;
     }},
};

class GatedExactness : public ::testing::TestWithParam<actmem::testing::ExactnessCase> {};

TEST_P(GatedExactness, BitwiseEqualToPlainOverThreeSteps) {
  actmem::testing::ExactnessHooks hooks;
  if (std::string(std::get<0>(GetParam()).name) == "Qwen3NextMini") {
    hooks.adjust = [](TransformerConfig&, TransformerConfig& strat) {
      if (strat.recompute_granularity != "selective") return;
      // Every MLP is an MoE layer: its parts instead of mlp; and the GDN layers' norm.
      auto& m = *strat.recompute_modules;
      m.erase(std::remove(m.begin(), m.end(), "mlp"), m.end());
      m.insert(m.end(), {"moe_act", "shared_experts", "gdn_norm_out"});
    };
  }
  actmem::testing::expect_strategy_exact(gated_model(), GetParam(), hooks);
}

// 16 bits on the grouped model (the others repeat the same paths).
INSTANTIATE_TEST_SUITE_P(Strategies, GatedExactness,
                         ::testing::ValuesIn(actmem::testing::exactness_cases(kGatedVariants,
                                                                              kGatedStrategies,
                                                                              {"Grouped"})),
                         actmem::testing::exactness_case_name);

// ---- memory ------------------------------------------------------------------------------------

class GatedPredictor : public ::testing::TestWithParam<std::tuple<GatedCase, const char*>> {};

TEST_P(GatedPredictor, ExactAgainstTheTrackerAndTheLedgerPerModule) {
  const std::pair<const char*, void (*)(TransformerConfig&)> policies[] = {
      {"plain", [](TransformerConfig&) {}},
      {"core_attn", [](TransformerConfig& c) { selective(c, {"core_attn"}); }},
      {"layernorm+mlp",
       [](TransformerConfig& c) {
         selective(c, {"layernorm", "mlp"});
       }},
      {"full block 2",
       [](TransformerConfig& c) {
         c.recompute_granularity = "full";
         c.recompute_method = "block";
         c.recompute_num_layers = 2;
       }},
  };
  for (const auto& [policy, apply] : policies) {
    TransformerConfig c = gated_model();
    actmem::testing::set_precision(c, std::get<1>(GetParam()));
    std::get<0>(GetParam()).apply(c);
    apply(c);
    actmem::testing::expect_predictor_matches_tracker(c, policy);
    // Each switch alone too, so no term hides another's.
    for (int off = 0; off < 4; ++off) {
      TransformerConfig one = c;
      if (off == 0) one.qk_layernorm = false;
      if (off == 1) one.attention_output_gate = false;
      if (off == 2) one.layernorm_zero_centered_gamma = false;
      if (off == 3) one.kv_channels_arg.reset();
      actmem::testing::expect_predictor_matches_tracker(
          one, std::string(policy) + " without switch " + std::to_string(off));
    }
  }
}

const GatedCase kGatedPredictorVariants[] = {
    kGatedVariants[0],
    kGatedVariants[1],
    // One group: q and the gate are views of linear_qkv's output.
    {"OneGroupNoRope",
     [](TransformerConfig& c) {
       c.num_query_groups = 1;
       c.position_embedding_type = "learned_absolute";
       c.rotary_percent = 1.0;
     }},
    {"GroupedFlash", [](TransformerConfig& c) { c.attention_dropout = 0.0; }},
};

INSTANTIATE_TEST_SUITE_P(Variants, GatedPredictor,
                         ::testing::Combine(::testing::ValuesIn(kGatedPredictorVariants),
                                            ::testing::Values("fp32", "bf16")),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param).name) + "_" +
                                  std::get<1>(info.param);
                         });

// The memory pre-check bounds the measured step peak with the wider heads and the gate.
TEST(GatedPredictor, StepPeakBoundCoversGatedAttention) {
  for (const char* precision : {"fp32", "bf16"}) {
    TransformerConfig c = gated_model();
    actmem::testing::set_precision(c, precision);
    c.kv_channels_arg = 32;  // a d = 128 = 4h
    TrainingConfig t;
    t.eval_interval = 0;
    Trainer trainer(c, t);
    int64_t peak = 0;
    for (int step = 0; step < 2; ++step) {
      peak = std::max(peak, trainer.train_step(false).peak_device_bytes);
    }
    EXPECT_GE(actmem::predict_step_peak_bound(c), static_cast<double>(peak)) << precision;
  }
}

// ---- parameters and estimate -------------------------------------------------------------------

// count_parameters, from the configuration alone, against the model GPTModel builds.
TEST(GatedParameters, CountedFromTheConfigurationAsTheModelBuildsThem) {
  std::vector<std::pair<const char*, TransformerConfig>> configs;
  configs.emplace_back("gated", gated_model());
  configs.emplace_back("plain", actmem::testing::small_model());
  for (const auto& v : kGatedVariants) {
    TransformerConfig c = gated_model();
    v.apply(c);
    configs.emplace_back(v.name, c);
  }
  {
    TransformerConfig c = gated_model();  // LayerNorm norms with biases, learned positions, tied
    c.normalization = "LayerNorm";
    c.add_bias_linear = true;
    c.position_embedding_type = "learned_absolute";
    c.rotary_percent = 1.0;
    c.untie_embeddings_and_output_weights = false;
    c.num_moe_experts = 3;
    c.moe_layer_freq = "[0,1,0,1]";  // MoE with biases (Megatron refuses them on shared experts)
    configs.emplace_back("biases", c);
  }
  for (const auto& [name, c] : configs) {
    GPTModel model(c);
    EXPECT_EQ(actmem::count_parameters(c).total, model.num_parameters()) << name;
    EXPECT_EQ(actmem::count_parameters(c).on_rank, static_cast<double>(model.num_parameters()))
        << name;
  }
}

// The Qwen3-Next preset at its published size: "80B total parameters, 3B activated" (Qwen's
// model card; the activated count without the 0.62B of embedding and output layer).
TEST(GatedParameters, Qwen3NextPresetHasThePublishedSize) {
  const TransformerConfig c = actmem::preset_options("qwen3-next-80b-a3b").model;
  const actmem::ParameterCount n = actmem::count_parameters(c);
  EXPECT_NEAR(static_cast<double>(n.total) / 1e9, 80.0, 1.0);
  const double embeddings = 2.0 * 151936 * 2048;
  EXPECT_NEAR((static_cast<double>(n.active) - embeddings) / 1e9, 3.0, 0.5);
  EXPECT_EQ(c.gdn_layers()[3], false);
  EXPECT_EQ(c.gdn_layers()[0], true);
}

// `estimate` on a model the paper's formulas do not describe prints the exact predictor: with
// no recompute, its first-stage bytes are what a bf16 step on this machine measures (RMSNorm
// keeps fp32 statistics on every device; no checkpoint, so no snapshot).
TEST(GatedEstimate, HybridModelEstimateEqualsTheMeasuredStep) {
  const std::string flags =
      "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --kv-channels 16 "
      "--group-query-attention --num-query-groups 2 --qk-layernorm --attention-output-gate "
      "--position-embedding-type rope --rotary-percent 0.5 --apply-layernorm-1p "
      "--normalization RMSNorm --swiglu --ffn-hidden-size 48 --disable-bias-linear "
      "--untie-embeddings-and-output-weights --experimental-attention-variant gdn "
      "--linear-attention-freq 2 --linear-num-key-heads 2 --linear-num-value-heads 4 "
      "--linear-key-head-dim 8 --linear-value-head-dim 6 --seq-length 24 --micro-batch-size 2 "
      "--vocab-size 256 --attention-dropout 0.1 --hidden-dropout 0.1";
  const auto r = actmem::testing::run_actmem("estimate --json " + flags);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output.substr(0, r.output.size() - r.stderr_text.size()));
  // Its layers by kind (layer_spec.h): two Gated DeltaNet layers, two attention layers.
  ASSERT_EQ(j["layer_kinds"].size(), 2u);
  EXPECT_EQ(j["layer_kinds"][0]["kind"], "gdn+mlp");
  EXPECT_EQ(j["layer_kinds"][0]["layers"], 2);
  EXPECT_EQ(j["layer_kinds"][1]["kind"], "attention+mlp");
  EXPECT_EQ(j["layer_kinds"][1]["layers"], 2);
  const auto& none = j["strategies"][0];
  ASSERT_EQ(none["name"], "none");

  TransformerConfig c = gated_model();
  c.ffn_hidden_size = 48;
  c.experimental_attention_variant = "gdn";
  c.linear_attention_freq = "2";
  c.linear_num_key_heads = 2;
  c.linear_num_value_heads = 4;
  c.linear_key_head_dim = 8;
  c.linear_value_head_dim = 6;
  c.bf16 = true;
  TrainingConfig t;
  t.eval_interval = 0;
  Trainer trainer(c, t);
  const auto st = trainer.train_step(false);
  EXPECT_EQ(none["first_stage_bytes"].get<double>(), static_cast<double>(st.activation_bytes));
  EXPECT_EQ(j["parameters"]["total"].get<int64_t>(), GPTModel(c).num_parameters());
  // Interleaved stages: the first stage's chunks hold layers 0 and 2, both GatedDeltaNet.
  const auto vpp = actmem::testing::run_actmem(
      "estimate --json " + flags +
      " --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1");
  ASSERT_EQ(vpp.exit_code, 0) << vpp.output;
  const auto jv =
      nlohmann::json::parse(vpp.output.substr(0, vpp.output.size() - vpp.stderr_text.size()));
  EXPECT_GT(jv["strategies"][0]["layer_bytes"]["gdn+mlp"].get<double>(), 0.0);
  EXPECT_EQ(jv["strategies"][0]["layer_bytes"]["attention+mlp"].get<double>(), 0.0);
  EXPECT_TRUE(jv["layer_kinds"][1]["first_layer_on_first_stage"].is_null());
  // Each strategy keeps less than no recompute, full recompute least.
  double previous = none["first_stage_bytes"].get<double>();
  for (size_t i = 1; i < j["strategies"].size(); ++i) {
    const double bytes = j["strategies"][i]["first_stage_bytes"].get<double>();
    EXPECT_LT(bytes, previous) << j["strategies"][i]["name"];
    previous = bytes;
  }
}

// A checkpoint records the switches: generate rebuilds the model from it, and a run whose
// attention differs is refused naming the field.
TEST(GatedCheckpoint, GenerateRebuildsTheModelAndAnotherShapeIsRefused) {
  const std::string dir = actmem::testing::fresh_temp_dir("gated_ckpt");
  const std::string model =
      "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --kv-channels 16 "
      "--group-query-attention --num-query-groups 2 --qk-layernorm --position-embedding-type rope "
      "--rotary-percent 0.5 --apply-layernorm-1p --normalization RMSNorm --swiglu "
      "--seq-length 32 --micro-batch-size 2 --eval-interval 0";
  auto r = actmem::testing::run_actmem("train " + model +
                                       " --attention-output-gate --train-iters 2 --save " + dir);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = actmem::testing::run_actmem("generate --load " + dir + " --prompt ab --max-new-tokens 2");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  r = actmem::testing::run_actmem("train " + model + " --train-iters 3 --load " + dir);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.stderr_text.find("attention_output_gate = true but this run has "
                               "attention_output_gate = false"),
            std::string::npos)
      << r.stderr_text;
  std::filesystem::remove_all(dir);
}

}  // namespace
