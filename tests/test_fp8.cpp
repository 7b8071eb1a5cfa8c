// test_fp8.cpp — FP8 training (model/fp8.h, docs/fp8.md): the formats' rounding, Transformer
// Engine's scaling rules traced by hand, the FP8 linear against a dequantized reference, Megatron's
// FP8 rules, every recompute and offload strategy bitwise equal to the plain FP8 run (scaling
// state included), a naive recompute shown to differ, and the exact predictor under FP8.
#include "actmem/model/fp8.h"
#include "actmem/model/model.h"
#include "actmem/train/trainer.h"
#include "exactness.h"
#include "fixtures.h"
#include "test_util.h"

#include <ATen/ATen.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace {

using actmem::DelayedScale;
using actmem::Fp8Recipe;
using actmem::Trainer;
using actmem::TrainingConfig;
using actmem::TransformerConfig;
using actmem::testing::expect_error_containing;
using actmem::testing::offload;
using actmem::testing::selective;

float quantized(float x, at::ScalarType type) {
  return actmem::quantize_fp8(at::full({1}, x), at::ones({}), type).to(at::kFloat).item<float>();
}

TEST(Fp8Numerics, QuantizationRoundsToTheFormatsGridAndSaturates) {
  // E4M3: 3 mantissa bits, steps of 0.25 in [2, 4); E5M2: 2 bits, steps of 0.5. Ties to even.
  EXPECT_EQ(quantized(3.3f, at::kFloat8_e4m3fn), 3.25f);
  EXPECT_EQ(quantized(3.4f, at::kFloat8_e4m3fn), 3.5f);
  EXPECT_EQ(quantized(3.375f, at::kFloat8_e4m3fn), 3.5f);  // the tie goes to the even mantissa
  EXPECT_EQ(quantized(3.3f, at::kFloat8_e5m2), 3.5f);
  EXPECT_EQ(quantized(2.7f, at::kFloat8_e5m2), 2.5f);
  // Magnitudes beyond the largest finite value saturate (448 and 57344), as TE's casts do.
  EXPECT_EQ(quantized(1000.0f, at::kFloat8_e4m3fn), 448.0f);
  EXPECT_EQ(quantized(-1e6f, at::kFloat8_e5m2), -57344.0f);
  // The scale multiplies before the cast.
  EXPECT_EQ(actmem::quantize_fp8(at::full({1}, 0.1f), at::full({}, 32.0f), at::kFloat8_e4m3fn)
                .to(at::kFloat)
                .item<float>(),
            3.25f);
}

TEST(Fp8Numerics, CurrentScalingFollowsTransformerEnginesComputeScaleFromAmax) {
  auto scale = [](float amax) {
    return actmem::scale_from_amax(at::full({}, amax), 448.0).item<float>();
  };
  EXPECT_EQ(scale(2.0f), 224.0f);
  EXPECT_EQ(scale(0.0f), 1.0f);  // recipe_common.cuh: 1 for an amax of 0, inf or nan
  EXPECT_EQ(scale(std::numeric_limits<float>::infinity()), 1.0f);
  EXPECT_EQ(scale(std::nanf("")), 1.0f);
  EXPECT_EQ(scale(1e-42f), std::numeric_limits<float>::max());  // the quotient overflows
}

TEST(Fp8Numerics, DelayedScalingUpdatesAsTransformerEnginesAmaxAndScaleUpdate) {
  // TE's _amax_and_scale_update traced by hand for a history of 3, amax_compute_algo max and
  // margin 1: amax = max(history); scale = 448 / amax / 2; the history rolls one place left and
  // entry 0 is zeroed.
  Fp8Recipe r;
  r.delayed = true;
  r.history_len = 3;
  r.amax_max = true;
  r.margin = 1;
  DelayedScale d(3);
  auto step = [&](float amax) {
    d.history[0].fill_(amax);
    d.update(r, 448.0);
  };
  auto history = [&] {
    return std::vector<float>{d.history[0].item<float>(), d.history[1].item<float>(),
                              d.history[2].item<float>()};
  };
  step(2.0f);  // [2,0,0]: amax 2 -> 112; rolled [0,0,2]
  EXPECT_EQ(d.scale.item<float>(), 112.0f);
  EXPECT_EQ(history(), (std::vector<float>{0, 0, 2}));
  step(4.0f);  // [4,0,2]: amax 4 -> 56; rolled [0,2,4]
  EXPECT_EQ(d.scale.item<float>(), 56.0f);
  EXPECT_EQ(history(), (std::vector<float>{0, 2, 4}));
  step(1.0f);  // [1,2,4]: 56; rolled [2,4,1], entry 0 zeroed: [0,4,1]
  EXPECT_EQ(d.scale.item<float>(), 56.0f);
  EXPECT_EQ(history(), (std::vector<float>{0, 4, 1}));
  step(0.5f);  // [0.5,4,1]: 56; [0,1,0.5]
  step(0.5f);  // [0.5,1,0.5]: amax 1 -> 224
  EXPECT_EQ(d.scale.item<float>(), 224.0f);
  // most_recent with an amax of 0 keeps the scale.
  r.amax_max = false;
  d.history.zero_();
  d.update(r, 448.0);
  EXPECT_EQ(d.scale.item<float>(), 224.0f);
}

TEST(Fp8Numerics, LinearEqualsTheDequantizedGemmForwardAndBackward) {
  // Current scaling, hybrid: the output is the fp32 product of the dequantized operands rounded
  // to bf16; the gradients are products of the E5M2-quantized output gradient (written here
  // from the formulas, in double precision).
  TransformerConfig c;
  c.fp8 = "hybrid";
  c.fp8_recipe = "tensorwise";
  auto registry = std::make_shared<actmem::Fp8Registry>(Fp8Recipe::from(c));
  auto gemm = registry->add_gemm(registry);
  at::manual_seed(3);
  const at::Tensor x = (at::randn({6, 5, 24}) * 3).to(at::kBFloat16).requires_grad_();
  const at::Tensor w = (at::randn({40, 24}) * 0.2).to(at::kBFloat16).requires_grad_();
  const at::Tensor b = at::randn({40}).to(at::kBFloat16).requires_grad_();
  const at::Tensor y = actmem::fp8_linear(x, w, b, *gemm, false);
  auto dq = [](const at::Tensor& t, double max, at::ScalarType type) {
    const double s = max / t.abs().max().item<double>();
    const at::Tensor q = (t.to(at::kDouble) * s).clamp(-max, max).to(type);
    return q.to(at::kDouble) / s;
  };
  const at::Tensor xd = dq(x.detach().reshape({-1, 24}), 448.0, at::kFloat8_e4m3fn);
  const at::Tensor wd = dq(w.detach(), 448.0, at::kFloat8_e4m3fn);
  const at::Tensor expected = (xd.mm(wd.t()) + b.detach().to(at::kDouble)).to(at::kBFloat16);
  ASSERT_EQ(y.sizes(), (std::vector<int64_t>{6, 5, 40}));
  EXPECT_TRUE(
      at::allclose(y.reshape({-1, 40}).to(at::kFloat), expected.to(at::kFloat), 1e-2, 1e-2));
  const at::Tensor g = at::randn({6, 5, 40}).to(at::kBFloat16);
  y.backward(g);
  const at::Tensor gd = dq(g.reshape({-1, 40}), 57344.0, at::kFloat8_e5m2);
  EXPECT_TRUE(at::allclose(x.grad().reshape({-1, 24}).to(at::kFloat),
                           gd.mm(wd).to(at::kBFloat16).to(at::kFloat), 1e-2, 1e-2));
  EXPECT_TRUE(at::allclose(w.grad().to(at::kFloat), gd.t().mm(xd).to(at::kBFloat16).to(at::kFloat),
                           1e-2, 2e-2));
  EXPECT_TRUE(
      at::allclose(b.grad().to(at::kFloat), g.reshape({-1, 40}).to(at::kFloat).sum(0), 1e-2, 1e-2));
}

// ---- Megatron's rules
// ----------------------------------------------------------------------------

TransformerConfig fp8_model(const std::string& recipe) {
  TransformerConfig c = actmem::testing::small_model();
  c.bf16 = true;
  c.attention_softmax_in_fp32 = true;
  c.fp8 = "hybrid";
  c.fp8_recipe = recipe;
  return c;
}

TEST(Fp8Config, MegatronsRulesWithItsMessages) {
  auto refused = [](const std::function<void(TransformerConfig&)>& edit,
                    const std::string& needle) {
    TransformerConfig c = fp8_model("tensorwise");
    edit(c);
    expect_error_containing([&] { c.validate(); }, needle);
  };
  EXPECT_NO_THROW(fp8_model("delayed").validate());
  EXPECT_NO_THROW(fp8_model("tensorwise").validate());
  // TransformerConfig.__post_init__.
  refused([](TransformerConfig& c) { c.fp4 = "e2m1"; },
          "fp4 and fp8 cannot be used simultaneously. Please choose one.");
  refused(
      [](TransformerConfig& c) {
        c.fp8_recipe = "delayed";
        c.first_last_layers_bf16 = true;
      },
      "Delayed scaling does not support first / last layer in BF16.");
  refused(
      [](TransformerConfig& c) {
        c.first_last_layers_bf16 = true;
        c.num_layers_at_end_in_bf16 = 5;
      },
      "num_layers_at_end_in_bf16 (5) must be between 0 and number of layers per pipeline stage "
      "(4).");
  refused(
      [](TransformerConfig& c) {
        c.fp8_recipe = "delayed";
        selective(c, {"layernorm"});
      },
      "Delayed scaling does not support moe_act and layernorm recompute for fp8.");
  refused([](TransformerConfig& c) { c.fp8_recipe = "custom"; },
          "fp8_quantizer_factory must be provided when fp8_recipe is 'custom'.");
  // actmem's: FP8 quantizes 16-bit runs; the values.
  refused(
      [](TransformerConfig& c) {
        c.bf16 = false;
        c.attention_softmax_in_fp32 = false;
      },
      "add --bf16");
  refused([](TransformerConfig& c) { c.fp8 = "e5m2"; }, "--fp8-format must be e4m3 or hybrid");
  refused([](TransformerConfig& c) { c.fp8_amax_history_len = 0; },
          "--fp8-amax-history-len must be in [1, 65536]");
  refused([](TransformerConfig& c) { c.fp8_amax_history_len = 1 << 20; },
          "--fp8-amax-history-len must be in [1, 65536]");
  refused([](TransformerConfig& c) { c.fp8_margin = 1000; }, "--fp8-margin must be in [-64, 64]");
  // What is not built yet says so.
  refused([](TransformerConfig& c) { c.fp8_recipe = "mxfp8"; }, "not implemented in actmem yet");
  refused([](TransformerConfig& c) { c.num_moe_experts = 4; }, "MoE experts' and MLA's FP8 GEMMs");
  refused([](TransformerConfig& c) { c.tensor_model_parallel_size = 2; },
          "FP8 under tensor parallelism");
  // Layer-norm recompute is allowed with current scaling (TE >= 2.6 in Megatron).
  TransformerConfig ok = fp8_model("tensorwise");
  selective(ok, {"layernorm"});
  EXPECT_NO_THROW(ok.validate());
}

TEST(Fp8Config, FirstAndLastLayersStayIn16BitsAsMegatronsIsFirstLastBf16Layer) {
  // 4 layers, 1 at the start and 2 at the end in bf16: only layer 1 is quantized.
  TransformerConfig c = fp8_model("tensorwise");
  c.first_last_layers_bf16 = true;
  c.num_layers_at_end_in_bf16 = 2;
  EXPECT_FALSE(c.quantized_layer(0));
  EXPECT_TRUE(c.quantized_layer(1));
  EXPECT_FALSE(c.quantized_layer(2));
  EXPECT_FALSE(c.quantized_layer(3));
  actmem::GPTModel model(c);
  for (const auto& layer : model.all_layers()) {
    for (const auto& m : layer->modules(false)) {
      if (auto* linear = dynamic_cast<actmem::Linear*>(m.get())) {
        EXPECT_EQ(linear->fp8 != nullptr, layer->layer_number() == 2)
            << "layer " << layer->layer_number();
      }
    }
  }
}

// ---- exactness
// -----------------------------------------------------------------------------------

struct Fp8Variant {
  const char* name;
  void (*apply)(TransformerConfig&);
};

const Fp8Variant kFp8Variants[] = {
    // Delayed scaling with a window of 4 and its maximum, a margin: the state every strategy
    // must leave as the plain run does.
    {"DelayedHybridMax4",
     [](TransformerConfig& c) {
       c.fp8_recipe = "delayed";
       c.fp8_amax_history_len = 4;
       c.fp8_amax_compute_algo = "max";
       c.fp8_margin = 1;
     }},
    {"TensorwiseE4m3",
     [](TransformerConfig& c) {
       c.fp8 = "e4m3";
       c.fp8_recipe = "tensorwise";
       c.gated_linear_unit = true;
     }},
    {"DelayedNoFp8Wgrad",
     [](TransformerConfig& c) {
       c.fp8_recipe = "delayed";
       c.fp8_wgrad = false;
     }},
    // A 3:1 GatedDeltaNet hybrid (fixtures.h): in_proj and out_proj in FP8.
    {"GdnHybridDelayed", [](TransformerConfig& c) { actmem::testing::make_gdn_hybrid(c); }},
};

const actmem::testing::ConfigEdit kFp8Strategies[] = {
    {"RecomputeCoreAttn", [](TransformerConfig& c) { selective(c, {"core_attn"}); }},
    {"RecomputeMlp", [](TransformerConfig& c) { selective(c, {"mlp"}); }},
    {"FullUniform1",
     [](TransformerConfig& c) {
       c.recompute_granularity = "full";
       c.recompute_method = "uniform";
       c.recompute_num_layers = 1;
     }},
    {"FullBlock3",
     [](TransformerConfig& c) {
       c.recompute_granularity = "full";
       c.recompute_method = "block";
       c.recompute_num_layers = 3;
     }},
    {"OffloadEveryGroup",
     [](TransformerConfig& c) {
       offload(c, {"attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"});
     }},
    {"LayerOffload2",
     [](TransformerConfig& c) {
       c.cpu_offloading_num_layers = 2;
       c.min_offloaded_tensor_size = 64;
     }},
};

TrainingConfig fp8_training() {
  TrainingConfig t;
  t.global_batch_size = 4;  // two micro-batches per step
  t.eval_interval = 0;
  return t;
}

struct PlainFp8Run {
  actmem::testing::TrainingRecord record;
  std::vector<at::Tensor> state;  // the FP8 scaling state after the last step
};

// Note [One plain run per configuration] in exactness.h, with the FP8 state kept beside it.
const PlainFp8Run& plain_run(const TransformerConfig& c, int steps) {
  static std::map<std::string, std::unique_ptr<PlainFp8Run>> runs;
  const std::string key = to_json(c).dump() + "/" + std::to_string(steps);
  auto& run = runs[key];
  if (!run) {
    Trainer plain(c, fp8_training());
    run = std::make_unique<PlainFp8Run>();
    run->record = actmem::testing::record_training(plain, steps);
    run->state = actmem::testing::clones(plain.model().fp8()->state_tensors());
  }
  return *run;
}

void expect_same_state(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b,
                       const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(actmem::testing::bitwise_equal(a[i], b[i]))
        << what << ": scaling tensor " << i << " differs";
  }
}

class Fp8Exactness
    : public ::testing::TestWithParam<std::tuple<Fp8Variant, actmem::testing::ConfigEdit>> {};

TEST_P(Fp8Exactness, BitwiseEqualToThePlainFp8RunScalingStateIncluded) {
  const auto& [variant, strategy] = GetParam();
  TransformerConfig plain = fp8_model("delayed");
  variant.apply(plain);
  TransformerConfig strat = plain;
  strategy.apply(strat);
  const PlainFp8Run& ref = plain_run(plain, 3);
  Trainer other(strat, fp8_training());
  actmem::recompute_counters().reset();
  int64_t offloaded = 0;
  actmem::testing::expect_bitwise_equal_training(
      ref.record, other, [&](const actmem::IterationStats& s) { offloaded += s.offloaded_bytes; });
  expect_same_state(ref.state, other.model().fp8()->state_tensors(), strategy.name);
  const auto& rc = actmem::recompute_counters();
  EXPECT_GT(rc.recomputes.load() + rc.output_recomputes.load() + offloaded, 0)
      << "the strategy did nothing";
  if (plain.fp8_recipe == "delayed") {
    // One forward and one backward update per micro-batch: 3 steps x 2.
    EXPECT_EQ(other.model().fp8()->forward_updates(), 6);
    EXPECT_EQ(other.model().fp8()->backward_updates(), 6);
  }
}

std::string fp8_case_name(
    const ::testing::TestParamInfo<std::tuple<Fp8Variant, actmem::testing::ConfigEdit>>& info) {
  return std::string(std::get<0>(info.param).name) + "_" + std::get<1>(info.param).name;
}

INSTANTIATE_TEST_SUITE_P(Strategies, Fp8Exactness,
                         ::testing::Combine(::testing::ValuesIn(kFp8Variants),
                                            ::testing::ValuesIn(kFp8Strategies)),
                         fp8_case_name);

TEST(Fp8Recompute, LayernormRecomputeWithCurrentScalingKeepsTheNormOutputAndIsExact) {
  // Megatron's set_for_recompute_input_layernorm: linear_qkv and linear_fc1 keep the norm output
  // the recompute frees, and quantize it again in the backward.
  TransformerConfig plain = fp8_model("tensorwise");
  TransformerConfig strat = plain;
  selective(strat, {"layernorm", "mlp"});
  const PlainFp8Run& ref = plain_run(plain, 3);
  Trainer other(strat, fp8_training());
  actmem::testing::expect_bitwise_equal_training(ref.record, other);
}

TEST(Fp8Recompute, GdnNormOutRecomputeIsExactUnderDelayedScaling) {
  // out_proj keeps its quantized copy of the norm output the recompute frees.
  TransformerConfig plain = fp8_model("delayed");
  actmem::testing::make_gdn_hybrid(plain);
  TransformerConfig strat = plain;
  selective(strat, {"gdn_norm_out", "core_attn"});
  const PlainFp8Run& ref = plain_run(plain, 3);
  Trainer other(strat, fp8_training());
  actmem::testing::expect_bitwise_equal_training(ref.record, other);
  expect_same_state(ref.state, other.model().fp8()->state_tensors(), "gdn_norm_out");
}

TEST(Fp8Recompute, ANaiveRecomputeThatUpdatesTheScalingStateAgainDiffers) {
  // What te_checkpoint prevents: a replay that quantizes with the scales updated after the
  // forward and records its amaxes again gives other gradients and another scaling state.
  TransformerConfig plain = fp8_model("delayed");
  plain.fp8_amax_history_len = 4;
  plain.fp8_amax_compute_algo = "max";
  TransformerConfig strat = plain;
  strat.recompute_granularity = "full";
  strat.recompute_method = "uniform";
  strat.recompute_num_layers = 1;
  const PlainFp8Run& ref = plain_run(plain, 3);
  Trainer naive(strat, fp8_training());
  naive.model().fp8()->naive_recompute_for_test = true;
  const auto record = actmem::testing::record_training(naive, 3);
  bool gradients_differ = false;
  for (size_t i = 0; i < record.steps.size(); ++i) {
    gradients_differ |= record.steps[i].stats.grad_digest != ref.record.steps[i].stats.grad_digest;
  }
  EXPECT_TRUE(gradients_differ);
  bool state_differs = false;
  const auto state = naive.model().fp8()->state_tensors();
  for (size_t i = 0; i < state.size(); ++i) {
    state_differs |= !actmem::testing::bitwise_equal(state[i], ref.state[i]);
  }
  EXPECT_TRUE(state_differs);
}

// ---- checkpoints
// ---------------------------------------------------------------------------------

TEST(Fp8Checkpoint, AResumedDelayedScalingRunIsBitwiseTheUninterruptedOne) {
  // The amax windows and scales travel in the checkpoint ("fp8_scaling"), so the resumed run
  // quantizes with the scales the uninterrupted one has at that step.
  TransformerConfig c = fp8_model("delayed");
  c.fp8_amax_history_len = 4;
  c.fp8_amax_compute_algo = "max";
  TrainingConfig t = fp8_training();
  t.train_iters = 6;
  Trainer whole(c, t);
  const auto ref = actmem::testing::record_training(whole, 6);
  const std::string dir = actmem::testing::fresh_temp_dir("fp8_resume");
  {
    Trainer first(c, t);
    actmem::testing::record_training(first, 3);
    const auto state = first.model().fp8()->state_tensors();
    bool moved = false;  // the scales left 1: the state is worth carrying
    for (size_t i = 1; i < state.size(); i += 2) moved |= state[i].item<float>() != 1.0f;
    ASSERT_TRUE(moved);
    first.save_checkpoint(dir);
  }
  Trainer second(c, t);
  ASSERT_EQ(second.load_checkpoint(dir), 3);
  const auto rest = actmem::testing::record_training(second, 3);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(rest.steps[i].stats.loss, ref.steps[3 + i].stats.loss) << "iteration " << 4 + i;
    EXPECT_EQ(rest.steps[i].stats.grad_digest, ref.steps[3 + i].stats.grad_digest)
        << "iteration " << 4 + i;
  }
  expect_same_state(whole.model().fp8()->state_tensors(), second.model().fp8()->state_tensors(),
                    "resumed");
  std::filesystem::remove_all(dir);
}

// ---- memory
// --------------------------------------------------------------------------------------

TEST(Fp8Memory, PredictorExactAgainstTheTrackerAndTheLedgerForEveryStrategy) {
  const std::pair<const char*, void (*)(TransformerConfig&)> policies[] = {
      {"plain", [](TransformerConfig&) {}},
      {"core_attn", [](TransformerConfig& c) { selective(c, {"core_attn"}); }},
      {"mlp", [](TransformerConfig& c) { selective(c, {"mlp"}); }},
      {"full block 2",
       [](TransformerConfig& c) {
         c.recompute_granularity = "full";
         c.recompute_method = "block";
         c.recompute_num_layers = 2;
       }},
  };
  for (const char* recipe : {"delayed", "tensorwise"}) {
    for (const bool wgrad : {true, false}) {
      for (const auto& [policy, apply] : policies) {
        TransformerConfig c = fp8_model(recipe);
        c.fp8_wgrad = wgrad;
        apply(c);
        actmem::testing::expect_predictor_matches_tracker(
            c, std::string(recipe) + (wgrad ? "" : " no-wgrad") + " " + policy);
      }
    }
  }
  // Current scaling with layer-norm recompute: fc1 and linear_qkv keep the 16-bit norm output.
  TransformerConfig c = fp8_model("tensorwise");
  selective(c, {"layernorm"});
  actmem::testing::expect_predictor_matches_tracker(c, "tensorwise layernorm");
  // The GatedDeltaNet hybrid, with and without gdn_norm_out recompute.
  for (const bool norm_out : {false, true}) {
    TransformerConfig g = fp8_model("delayed");
    actmem::testing::make_gdn_hybrid(g);
    if (norm_out) selective(g, {"gdn_norm_out"});
    actmem::testing::expect_predictor_matches_tracker(g, norm_out ? "gdn norm_out" : "gdn");
  }
}

TEST(Fp8Memory, QuantizedInputsShrinkTheLinearLayersTerms) {
  // Per layer of small_model (s 24, b 2, h 32, ffn 48): linear_qkv keeps sbh = 1536 elements,
  // linear_fc2 sb ffn = 2304; at bf16 2 bytes each, quantized 1 byte plus two fp32 scales.
  auto bytes = [](const TransformerConfig& c, const std::string& module) {
    for (const auto& [m, b] : actmem::predict_activation_bytes(c).by_module) {
      if (m == module) return b;
    }
    return int64_t{-1};
  };
  TransformerConfig bf16 = fp8_model("delayed");
  bf16.fp8.clear();
  const TransformerConfig fp8 = fp8_model("delayed");
  EXPECT_EQ(bytes(bf16, "decoder.layers.1.self_attention.linear_qkv"), 1536 * 2);
  EXPECT_EQ(bytes(fp8, "decoder.layers.1.self_attention.linear_qkv"), 1536 + 8);
  EXPECT_EQ(bytes(bf16, "decoder.layers.1.mlp.linear_fc2"), 2304 * 2);
  EXPECT_EQ(bytes(fp8, "decoder.layers.1.mlp.linear_fc2"), 2304 + 8);
}

}  // namespace
