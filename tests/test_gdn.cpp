// test_gdn.cpp — GatedDeltaNet hybrid models: Megatron's validation rules and layer pattern, its
// parameter names and shapes, the layer against an independent token-by-token reference, every
// recompute (gdn_norm_out included) and offload strategy bitwise equal to the plain run, and the
// exact predictor against the tracker and the ledger.
#include "actmem/config/activation_plan.h"
#include "actmem/memory/memory_model.h"
#include "actmem/model/activation_bytes.h"
#include "actmem/model/gdn/gated_delta_net.h"
#include "actmem/model/model.h"
#include "actmem/recompute/recompute.h"
#include "actmem/train/trainer.h"
#include "exactness.h"
#include "fixtures.h"
#include "test_util.h"

#include <ATen/ATen.h>

#include <cmath>
#include <map>

namespace {

using actmem::GPTModel;
using actmem::Trainer;
using actmem::TrainingConfig;
using actmem::TransformerConfig;
using actmem::testing::expect_error_containing;
using actmem::testing::offload;
using actmem::testing::selective;

// small_model (4 layers, h 32, 4 heads, s 24, b 2) as a 3:1 hybrid (make_gdn_hybrid).
TransformerConfig gdn_model() {
  TransformerConfig c = actmem::testing::small_model();
  actmem::testing::make_gdn_hybrid(c);
  return c;
}

using GDNCase = actmem::testing::ConfigEdit;

// ---- validation and pattern
// ----------------------------------------------------------------------

TEST(GDNConfig, MegatronsRulesWithItsMessages) {
  auto refused = [](const std::function<void(TransformerConfig&)>& edit,
                    const std::string& needle) {
    TransformerConfig c = gdn_model();
    edit(c);
    expect_error_containing([&] { c.validate(); }, needle);
  };
  EXPECT_NO_THROW(gdn_model().validate());
  refused([](TransformerConfig& c) { c.linear_attention_freq.clear(); },
          "linear_attention_freq must be set for linear gdn.");
  refused([](TransformerConfig& c) { c.linear_num_value_heads = 3; },
          "linear_num_value_heads (3) must be a multiple of linear_num_key_heads (2).");
  refused([](TransformerConfig& c) { c.tensor_model_parallel_size = 4; },
          "self.linear_num_key_heads=2 must be a multiple of (self.tensor_model_parallel_size=4 "
          "* self.context_parallel_size=1).");
  refused([](TransformerConfig& c) { c.linear_conv_kernel_dim = 0; },
          "linear_conv_kernel_dim must be set for gated delta net");
  refused([](TransformerConfig& c) { c.linear_attention_freq = "[1,1,0]"; },
          "Invalid length of linear_attention_pattern: 3, expected 4");
  refused([](TransformerConfig& c) { c.linear_attention_freq = "[1,2,1,0]"; },
          "entries must be 0 or 1");
  refused([](TransformerConfig& c) { c.linear_attention_freq = "x"; },
          "Invalid linear_attention_freq");
  refused([](TransformerConfig& c) { c.experimental_attention_variant = "gdn2"; },
          "experimental_attention_variant gdn2 is not implemented");
  refused([](TransformerConfig& c) { c.experimental_attention_variant = "mamba"; },
          "experimental_attention_variant must be one of gdn, gdn2, dsa, gated_delta_net");
  refused([](TransformerConfig& c) { c.gated_linear_unit = false; }, "must be silu");
  refused([](TransformerConfig& c) { c.experimental_attention_variant.clear(); },
          "linear_attention_freq needs --experimental-attention-variant gdn");
  refused(
      [](TransformerConfig& c) {
        c.linear_attention_freq = "1";
        selective(c, {"gdn_norm_out"});
      },
      "gdn_norm_out in recompute_modules applies to GatedDeltaNet layers and this model has "
      "none");
  refused(
      [](TransformerConfig& c) {
        c.linear_attention_freq = "[1,1,1,1]";
        selective(c, {"core_attn"});
      },
      "core_attn in recompute_modules applies to standard attention layers and every layer of "
      "this model is GatedDeltaNet");
  // Without the variant, Megatron's message for gdn_norm_out.
  TransformerConfig dense = actmem::testing::small_model();
  selective(dense, {"gdn_norm_out"});
  expect_error_containing([&] { dense.validate(); },
                          "gdn_norm_out in recompute_modules is only supported with "
                          "experimental_attention_variant='gdn' or 'gdn2'.");
}

TEST(GDNConfig, LayerPatternAsMegatronReadsIt) {
  TransformerConfig c = gdn_model();
  c.num_layers = 8;
  EXPECT_EQ(c.gdn_layers(), (std::vector<bool>{true, true, true, false, true, true, true, false}));
  c.linear_attention_freq = "2";
  EXPECT_EQ(c.gdn_layers(),
            (std::vector<bool>{true, false, true, false, true, false, true, false}));
  c.linear_attention_freq = "([0]+[1]*3)*2";
  EXPECT_EQ(c.gdn_layers(), (std::vector<bool>{false, true, true, true, false, true, true, true}));
  c.experimental_attention_variant = "gated_delta_net";  // the deprecated spelling
  EXPECT_TRUE(c.gated_delta_net());
  EXPECT_EQ(c.gdn_layers()[1], true);
  // The plan: GDN layers have gdn_norm_out, attention layers core_attn.
  c = gdn_model();
  selective(c, {"core_attn", "gdn_norm_out"});
  const auto plan = actmem::make_activation_plan(c);
  for (int i = 0; i < 4; ++i) {
    const bool gdn = i < 3;
    EXPECT_EQ(plan.layers[i].gdn, gdn);
    EXPECT_EQ(plan.layers[i].recomputes(actmem::RecomputeModule::kGdnNormOut), gdn) << i;
    EXPECT_EQ(plan.layers[i].recomputes(actmem::RecomputeModule::kCoreAttn), !gdn) << i;
  }
}

// ---- the layer ---------------------------------------------------------------------------------

TEST(GDNModel, MegatronsParameterNamesAndShapes) {
  const TransformerConfig c = gdn_model();
  GPTModel model(c);
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& p : model.named_parameters()) shapes[p.key()] = p.value().sizes().vec();
  const std::string gdn = "decoder.layers.0.self_attention.";
  // in_proj: [q 2x8 | k 2x8 | v 4x6 | z 4x6 | beta 4 | alpha 4] = 88 rows.
  EXPECT_EQ(shapes.at(gdn + "in_proj.weight"), (std::vector<int64_t>{88, 32}));
  EXPECT_EQ(shapes.at(gdn + "conv1d.weight"), (std::vector<int64_t>{56, 1, 4}));
  EXPECT_EQ(shapes.at(gdn + "A_log"), (std::vector<int64_t>{4}));
  EXPECT_EQ(shapes.at(gdn + "dt_bias"), (std::vector<int64_t>{4}));
  EXPECT_EQ(shapes.at(gdn + "out_norm.weight"), (std::vector<int64_t>{6}));
  EXPECT_EQ(shapes.at(gdn + "out_proj.weight"), (std::vector<int64_t>{32, 24}));
  EXPECT_EQ(shapes.count(gdn + "in_proj.bias") + shapes.count(gdn + "conv1d.bias"), 0u);
  EXPECT_EQ(shapes.count("decoder.layers.2.self_attention.in_proj.weight"), 1u);
  EXPECT_EQ(shapes.count("decoder.layers.3.self_attention.linear_qkv.weight"), 1u);
  EXPECT_EQ(shapes.count("decoder.layers.3.self_attention.in_proj.weight"), 0u);
  // Megatron's initialisation: A_log = log(uniform(1, 16)), dt_bias ones, out_norm ones.
  const auto* layer = model.decoder->layers[0]->mixer_as<actmem::GatedDeltaNet>();
  ASSERT_NE(layer, nullptr);
  const at::Tensor A = layer->A_log.exp();
  EXPECT_TRUE((A >= 1.0).all().item<bool>() && (A <= 16.0).all().item<bool>());
  EXPECT_TRUE(at::equal(layer->dt_bias, at::ones_like(layer->dt_bias)));
  const double bound = 0.5;  // 1/sqrt(K)
  EXPECT_LE(layer->conv1d_weight.abs().max().item<double>(), bound);
}

// The layer against the rule written token by token in double: in_proj, the causal convolution
// as a sum over its taps, L2 norms, the gates, the recurrence per (batch row, value head), the
// gated RMSNorm and out_proj, each from the module's parameters.
TEST(GDNModel, LayerEqualsAnIndependentTokenByTokenReference) {
  for (const int64_t key_heads : {2, 4}) {
    SCOPED_TRACE(key_heads);
    TransformerConfig c = gdn_model();
    c.linear_num_key_heads = key_heads;
    GPTModel model(c, at::kDouble);
    auto& gdn = *model.decoder->layers[0]->mixer_as<actmem::GatedDeltaNet>();
    // Give dt_bias and out_norm values other than their ones.
    {
      at::NoGradGuard no_grad;
      gdn.dt_bias.copy_(at::linspace(-0.5, 0.5, 4, at::kDouble));
      gdn.out_norm->weight.copy_(at::linspace(0.5, 1.5, 6, at::kDouble));
    }
    const int64_t s = 10, b = 2, h = 32, Hk = key_heads, Hv = 4, dk = 8, dv = 6, K = 4;
    at::Generator gen = at::detail::createCPUGenerator(5);
    const at::Tensor x = at::randn({s, b, h}, gen, at::TensorOptions().dtype(at::kDouble));
    const at::Tensor out = gdn.forward(x, actmem::LayerContext{}).first;

    const at::Tensor W = gdn.in_proj->weight, P = at::matmul(x, W.t());  // [s, b, 88 or ...]
    const int64_t qk = Hk * dk, vd = Hv * dv, C = 2 * qk + vd;
    const at::Tensor w = gdn.conv1d_weight.squeeze(1);  // [C, K]
    const at::Tensor expected = at::zeros({s, b, h}, x.options());
    const double scale = 1.0 / std::sqrt(static_cast<double>(dk));
    for (int64_t bi = 0; bi < b; ++bi) {
      // Causal convolution then silu: u[t] = sum_j w[:, j] P[t - (K - 1) + j].
      at::Tensor conv = at::zeros({s, C}, x.options());
      for (int64_t t = 0; t < s; ++t) {
        for (int64_t j = 0; j < K; ++j) {
          const int64_t src = t - (K - 1) + j;
          if (src >= 0) conv[t] += w.select(1, j) * P[src][bi].narrow(0, 0, C);
        }
      }
      const at::Tensor u = conv * at::sigmoid(conv);
      at::Tensor gated = at::zeros({s, vd}, x.options());
      for (int64_t hv = 0; hv < Hv; ++hv) {
        const int64_t hk = hv / (Hv / Hk);
        at::Tensor S = at::zeros({dk, dv}, x.options());
        for (int64_t t = 0; t < s; ++t) {
          at::Tensor q = u[t].narrow(0, hk * dk, dk), k = u[t].narrow(0, qk + hk * dk, dk);
          q = q / (q.dot(q) + 1e-6).sqrt();
          k = k / (k.dot(k) + 1e-6).sqrt();
          const at::Tensor v = u[t].narrow(0, 2 * qk + hv * dv, dv);
          const at::Tensor row = P[t][bi];
          const double beta = 1.0 / (1.0 + std::exp(-row[C + vd + hv].item<double>()));
          const double a = row[C + vd + Hv + hv].item<double>() + gdn.dt_bias[hv].item<double>();
          const double g = -std::exp(gdn.A_log[hv].item<double>()) * std::log1p(std::exp(a));
          S = std::exp(g) * S;
          S = S + beta * at::outer(k, v - at::matmul(k, S));
          const at::Tensor o = at::matmul(q * scale, S);  // [dv]
          const at::Tensor normed =
              o / (o.square().mean() + c.layernorm_epsilon).sqrt() * gdn.out_norm->weight;
          const at::Tensor z = row.narrow(0, C + hv * dv, dv);
          gated[t].narrow(0, hv * dv, dv).copy_(normed * z * at::sigmoid(z));
        }
      }
      expected.select(1, bi).copy_(at::matmul(gated, gdn.out_proj->weight.t()));
    }
    EXPECT_TRUE(at::allclose(out, expected, 1e-10, 1e-12))
        << (out - expected).abs().max().item<double>();
  }
}

// ---- exactness ---------------------------------------------------------------------------------

const GDNCase kGDNVariants[] = {
    {"Hybrid", [](TransformerConfig&) {}},
    // One key head per value head, LayerNorm, s 80 (two chunks of 64, the second padded), b 1,
    // the flash kernel on the attention layer (no attention dropout), pattern attention-first.
    {"UngroupedLongLayerNorm",
     [](TransformerConfig& c) {
       c.micro_batch_size = 1;
       c.linear_num_key_heads = 4;
       c.normalization = "LayerNorm";
       c.seq_length = 80;
       c.attention_dropout = 0.0;
       c.linear_attention_freq = "[0,1,1,1]";
     }},
};

const GDNCase kGDNStrategies[] = {
    {"RecomputeGdnNormOut", [](TransformerConfig& c) { selective(c, {"gdn_norm_out"}); }},
    {"RecomputeEverySelective",
     [](TransformerConfig& c) {
       selective(c, {"core_attn", "layernorm", "mlp", "gdn_norm_out"});
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
    {"OffloadNorms",
     [](TransformerConfig& c) {
       offload(c, {"attn_norm", "mlp_norm"});
     }},
    {"OffloadEveryGroup",
     [](TransformerConfig& c) {
       offload(c, {"attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"});
     }},
    {"OffloadAttnNormRecomputeGdnNormOut",
     [](TransformerConfig& c) {
       offload(c, {"attn_norm", "core_attn"});
       selective(c, {"gdn_norm_out", "layernorm"});
     }},
    {"LayerOffload2",
     [](TransformerConfig& c) {
       c.cpu_offloading_num_layers = 2;
       c.min_offloaded_tensor_size = 64;
     }},
};

class GDNExactness : public ::testing::TestWithParam<actmem::testing::ExactnessCase> {};

TEST_P(GDNExactness, BitwiseEqualToPlainOverThreeSteps) {
  actmem::testing::expect_strategy_exact(gdn_model(), GetParam());
}

// 16 bits on the grouped hybrid (the other repeats the same paths).
INSTANTIATE_TEST_SUITE_P(
    Strategies, GDNExactness,
    ::testing::ValuesIn(actmem::testing::exactness_cases(kGDNVariants, kGDNStrategies, {"Hybrid"})),
    actmem::testing::exactness_case_name);

// ---- memory ------------------------------------------------------------------------------------

class GDNPredictor : public ::testing::TestWithParam<std::tuple<GDNCase, const char*>> {};

TEST_P(GDNPredictor, ExactAgainstTheTrackerAndTheLedgerPerModule) {
  const std::pair<const char*, void (*)(TransformerConfig&)> policies[] = {
      {"plain", [](TransformerConfig&) {}},
      {"gdn_norm_out", [](TransformerConfig& c) { selective(c, {"gdn_norm_out"}); }},
      {"core_attn+gdn_norm_out",
       [](TransformerConfig& c) {
         selective(c, {"core_attn", "gdn_norm_out"});
       }},
      {"layernorm+gdn_norm_out+mlp",
       [](TransformerConfig& c) {
         selective(c, {"layernorm", "gdn_norm_out", "mlp"});
       }},
      {"full block 2",
       [](TransformerConfig& c) {
         c.recompute_granularity = "full";
         c.recompute_method = "block";
         c.recompute_num_layers = 2;
       }},
  };
  for (const auto& [policy, apply] : policies) {
    TransformerConfig c = gdn_model();
    actmem::testing::set_precision(c, std::get<1>(GetParam()));
    std::get<0>(GetParam()).apply(c);
    apply(c);
    actmem::testing::expect_predictor_matches_tracker(c, policy);
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, GDNPredictor,
                         ::testing::Combine(::testing::ValuesIn(kGDNVariants),
                                            ::testing::Values("fp32", "bf16")),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param).name) + "_" +
                                  std::get<1>(info.param);
                         });

// The trainer's memory pre-check (Note [Memory pre-check]) bounds a hybrid's measured step peak:
// its GatedDeltaNet weights and widest tensors counted. An all-GDN model with wide value heads,
// where in_proj outweighs linear_qkv, at fp32 and bf16.
TEST(GDNPredictor, StepPeakBoundCoversHybridModels) {
  for (const char* precision : {"fp32", "bf16"}) {
    for (const char* pattern : {"4", "([1]*4)"}) {
      TransformerConfig c = gdn_model();
      actmem::testing::set_precision(c, precision);
      c.linear_attention_freq = pattern;
      c.linear_value_head_dim = 32;  // value width 128 = 4h
      TrainingConfig t;
      t.eval_interval = 0;
      Trainer trainer(c, t);
      int64_t peak = 0;
      for (int step = 0; step < 2; ++step) {
        peak = std::max(peak, trainer.train_step(false).peak_device_bytes);
      }
      EXPECT_GE(actmem::predict_step_peak_bound(c), static_cast<double>(peak))
          << precision << " " << pattern;
    }
  }
}

// What gdn_norm_out frees per GatedDeltaNet layer, measured, against the shapes (T = s b tokens,
// v = Hv dv, fp32). Without it the gated norm keeps the rule's output o and the gate z (silu's
// input), RMSNorm's 1/rms per row (T Hv), the norm output y and silu(z) (the product's operands),
// and out_proj keeps its input; with it the checkpoint keeps o and z and a random-state snapshot.
TEST(GDNRecompute, NormOutReplaysOncePerGdnLayerAndFreesWhatTheShapesSay) {
  auto run = [](bool recompute) {
    TransformerConfig c = gdn_model();
    if (recompute) selective(c, {"gdn_norm_out"});
    TrainingConfig t;
    t.eval_interval = 0;
    Trainer trainer(c, t);
    actmem::recompute_counters().reset();
    const auto st = trainer.train_step(false);
    return std::make_pair(actmem::recompute_counters().output_recomputes.load(),
                          st.activation_bytes);
  };
  const auto plain = run(false), recompute = run(true);
  EXPECT_EQ(plain.first, 0);
  EXPECT_EQ(recompute.first, 3);  // layers 0-2
  const int64_t T = 24 * 2, v = 4 * 6, Hv = 4;
  const int64_t per_layer =
      (T * v /* y */ + T * v /* silu(z) */ + T * Hv /* rstd */ + T * v /* out_proj's input */) * 4 -
      actmem::checkpoint_snapshot_bytes();
  EXPECT_EQ(plain.second - recompute.second, 3 * per_layer);
}

}  // namespace
