// test_mixed_precision.cpp — bf16/fp16 training as Megatron runs it: loss scalers, main
// parameters and main grads, skipped steps, the fp16 refusal on CPU, and the memory truth at
// 16 bits (ledger vs Korthikanti per module, the predictor to the byte).
#include "actmem/base/digest.h"
#include "actmem/memory/ledger.h"
#include "actmem/memory/memory_model.h"
#include "actmem/model/activation_bytes.h"
#include "actmem/model/model.h"
#include "actmem/train/mixed_precision.h"
#include "actmem/train/trainer.h"
#include "exactness.h"
#include "fixtures.h"
#include "test_util.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cmath>

namespace actmem {
namespace {

using actmem::testing::bitwise_equal;

// ---- the scalers ------------------------------------------------------------------------------

TEST(GradScaler, DynamicHalvesAfterHysteresisOverflowsAndGrowsAfterTheWindow) {
  GradScaler g = GradScaler::dynamic(/*initial=*/1024.0, /*min=*/128.0, /*window=*/3,
                                     /*hysteresis=*/2);
  EXPECT_TRUE(g.is_dynamic());
  g.update(true);  // first overflow: hysteresis 2 -> 1, scale kept
  EXPECT_EQ(g.scale(), 1024.0f);
  EXPECT_EQ(g.hysteresis_left(), 1);
  g.update(true);  // second: halves
  EXPECT_EQ(g.scale(), 512.0f);
  g.update(true);  // the tracker is only restored by growth: every further overflow halves
  EXPECT_EQ(g.scale(), 256.0f);
  g.update(true);
  g.update(true);  // floored at min_scale
  EXPECT_EQ(g.scale(), 128.0f);
  g.update(false);
  g.update(false);
  EXPECT_EQ(g.scale(), 128.0f);
  EXPECT_EQ(g.growth_tracker(), 2);
  g.update(false);  // third clean step in a row: doubles, hysteresis restored
  EXPECT_EQ(g.scale(), 256.0f);
  EXPECT_EQ(g.hysteresis_left(), 2);
  EXPECT_EQ(g.growth_tracker(), 0);
  g.update(false);
  g.update(true);  // an overflow resets the growth count
  EXPECT_EQ(g.growth_tracker(), 0);
  EXPECT_EQ(g.scale(), 256.0f);
  EXPECT_EQ(g.inv_scale(), 1.0f / 256.0f);
}

TEST(GradScaler, ConstantNeverChangesAndBadValuesAreRefused) {
  GradScaler g = GradScaler::constant(4096.0);
  g.update(true);
  g.update(false);
  EXPECT_EQ(g.scale(), 4096.0f);
  EXPECT_FALSE(g.is_dynamic());
  actmem::testing::expect_error_containing([] { GradScaler::constant(0.0); }, "positive");
  actmem::testing::expect_error_containing([] { GradScaler::constant(1e39); }, "finite in fp32");
  actmem::testing::expect_error_containing([] { GradScaler::dynamic(1.0, 2.0, 10, 2); },
                                           "min_scale <= initial_scale");
  actmem::testing::expect_error_containing([] { GradScaler::dynamic(8.0, 1.0, 10, 0); },
                                           "at least 1");
}

// ---- fp16 loss scaling on real float16 parameters ----------------------------------------------

// float16 overflows above 65504. The parameters are float16 leaves; the loss reads them through
// an fp32 cast, whose backward rounds the (scaled) gradient back to float16 — inf when
// scale * x exceeds the range. Every operation here has a CPU kernel for Half.
TEST(MixedPrecisionOptimizer, Fp16OverflowSkipsTheStepHalvesAfterHysteresisAndKeepsParameters) {
  const at::Tensor init = at::tensor({0.5f, -0.25f, 1.0f, 2.0f}).to(at::kHalf);
  at::Tensor p = init.clone().set_requires_grad(true);
  const at::Tensor x = at::tensor({1.0f, -2.0f, 0.5f, 1.5f});  // max |x| = 2
  AdamWSettings s;
  s.lr = 0.1;
  MixedPrecisionOptimizer opt({p}, s, at::kFloat,
                              GradScaler::dynamic(/*initial=*/std::ldexp(1.0, 20), /*min=*/1.0,
                                                  /*window=*/1000, /*hysteresis=*/2));
  auto step = [&] {
    opt.zero_grad();
    ((p.to(at::kFloat) * x).sum() * opt.loss_scale()).backward();
    EXPECT_FALSE(p.grad().defined()) << "the hook frees the 16-bit gradient";
    const bool skipped = opt.unscale_and_check(nullptr);
    if (!skipped) opt.step();
    return skipped;
  };
  // 2^20 * 2 and 2^16 * 2 overflow float16; 2^15 * 2 = 65536 still does; 2^14 * 2 fits.
  const std::vector<double> expected_scale_before = {0x1p20, 0x1p20, 0x1p19, 0x1p18,
                                                     0x1p17, 0x1p16, 0x1p15, 0x1p14};
  for (size_t i = 0; i + 1 < expected_scale_before.size(); ++i) {
    EXPECT_EQ(opt.loss_scale(), expected_scale_before[i]) << "step " << i;
    EXPECT_TRUE(step()) << "step " << i << " must overflow";
    EXPECT_TRUE(bitwise_equal(p.detach(), init)) << "a skipped step leaves the parameters";
    EXPECT_TRUE(bitwise_equal(opt.main_params()[0], init.to(at::kFloat)));
  }
  EXPECT_EQ(opt.loss_scale(), 0x1p14);
  EXPECT_FALSE(step());
  // The unscaled main grad is exactly x (power-of-two scale), and the step moved the parameters.
  EXPECT_TRUE(bitwise_equal(opt.main_grads()[0], x));
  EXPECT_FALSE(bitwise_equal(p.detach(), init));
  // The model parameter is the main parameter rounded to float16.
  EXPECT_TRUE(bitwise_equal(p.detach(), opt.main_params()[0].to(at::kHalf)));
}

TEST(MixedPrecisionOptimizer, MainGradsAccumulateMicroBatchesInFp32) {
  at::Tensor p = at::tensor({1.0f}).to(at::kBFloat16).set_requires_grad(true);
  MixedPrecisionOptimizer opt({p}, AdamWSettings{}, at::kFloat, std::nullopt);
  opt.zero_grad();
  // 1 + 2^-10 is not a bf16 value (8 significant bits) but is an fp32 one: accumulating the two
  // gradients in bf16 would lose the second; the fp32 main grad keeps it.
  (p.to(at::kFloat) * 1.0f).sum().backward();
  (p.to(at::kFloat) * std::ldexp(1.0f, -10)).sum().backward();
  EXPECT_EQ(opt.main_grads()[0].scalar_type(), at::kFloat);
  EXPECT_EQ(opt.main_grads()[0].item<float>(), 1.0f + std::ldexp(1.0f, -10));
}

// ---- the trainer at 16 bits --------------------------------------------------------------------

TrainingConfig quick_training() {
  TrainingConfig t;
  t.global_batch_size = 4;
  t.eval_interval = 0;
  return t;
}

// The PyTorch range actmem builds on (2.11 to 2.15) computes every operation of the model in
// float16 on CPU, so the trainer's kernel probe finds nothing missing and --fp16 trains there.
TEST(MixedPrecision, Fp16AndBf16HaveEveryKernelOnCpu) {
  EXPECT_EQ(missing_kernel(at::kHalf, at::kCPU).value_or(""), "");
  EXPECT_EQ(missing_kernel(at::kBFloat16, at::kCPU).value_or(""), "");
}

// ---- fp16 through the trainer ------------------------------------------------------------------

// Megatron's dynamic scaling (DynamicGradScaler.update in megatron/core/optimizer/grad_scaler.py)
// stated here on its own: an overflow uses up one unit of hysteresis and, once none is left,
// halves the scale (never below min); `window` successful steps in a row double it and restore
// the hysteresis.
struct ScalerRule {
  double scale;
  int64_t window, hysteresis, left, growth = 0;
  double next(bool overflow) {
    if (overflow) {
      growth = 0;
      if (--left <= 0) scale = std::max(scale / 2, 1.0);
    } else if (++growth == window) {
      growth = 0;
      left = hysteresis;
      scale *= 2;
    }
    return scale;
  }
};

// From Megatron's initial scale of 2^32 a tiny fp16 model overflows on its first steps: the
// trainer skips them (parameters, fp32 main parameters and the learning-rate schedule unchanged),
// the scale follows Megatron's rule step by step, training resumes once the gradients fit, and a
// short window grows the scale again.
TEST(MixedPrecisionFp16, DynamicScalingSkipsHalvesAndGrowsThroughTheTrainer) {
  TransformerConfig c = actmem::testing::small_model();
  actmem::testing::set_precision(c, "fp16");
  TrainingConfig t = quick_training();
  t.loss_scale_window = 3;  // hysteresis 2 and the initial 2^32: Megatron's defaults
  ASSERT_EQ(t.initial_loss_scale, 0x1p32);
  Trainer trainer(c, t);
  ScalerRule rule{t.initial_loss_scale, t.loss_scale_window, t.hysteresis, t.hysteresis};
  int skipped = 0, applied = 0, grown = 0;
  double previous_lr = -1.0;
  bool previous_skipped = false;
  for (int step = 1; step <= 40; ++step) {
    const auto params_before = digest_of(trainer.model().ordered_parameters());
    const auto main_before = digest_of(trainer.mixed_precision()->main_params());
    const double scale_before = rule.scale;
    const auto st = trainer.train_step(false);
    EXPECT_EQ(st.loss_scale, scale_before) << "step " << step;
    EXPECT_TRUE(std::isfinite(st.loss)) << "step " << step << ": the forward is fp16-safe";
    const double scale_after = rule.next(st.skipped);
    EXPECT_EQ(trainer.mixed_precision()->loss_scale(), scale_after) << "step " << step;
    grown += scale_after > scale_before ? 1 : 0;
    const bool params_same = digest_of(trainer.model().ordered_parameters()) == params_before;
    const bool main_same = digest_of(trainer.mixed_precision()->main_params()) == main_before;
    if (st.skipped) {
      ++skipped;
      EXPECT_TRUE(std::isnan(st.grad_norm)) << "step " << step;
      EXPECT_TRUE(params_same && main_same)
          << "step " << step << ": a skipped step changed weights";
    } else {
      ++applied;
      EXPECT_TRUE(std::isfinite(st.grad_norm)) << "step " << step;
      EXPECT_FALSE(params_same || main_same)
          << "step " << step << ": an applied step changed nothing";
    }
    // After a skipped step the schedule has not advanced: the same learning rate again.
    if (previous_skipped) EXPECT_EQ(st.lr, previous_lr) << "step " << step;
    previous_lr = st.lr;
    previous_skipped = st.skipped;
    if (skipped > 0 && applied > 6 && grown > 0) break;
  }
  EXPECT_GE(skipped, 2) << "2^32 must overflow float16 gradients (and hysteresis absorbs one)";
  EXPECT_GT(applied, 6);
  EXPECT_GT(grown, 0) << "three good steps in a row double the scale";
}

// Every recompute and offload strategy stays bitwise equal to the plain run at fp16 through a
// trajectory that skips steps: the overflow decision, and so the skipped steps, are the same.
// From 2^20 with hysteresis 1 the model below overflows on its first steps and then trains.
constexpr double kFp16SkipScale = 0x1p20;
TEST(MixedPrecisionFp16, StrategiesStayBitwiseThroughSkippedSteps) {
  const std::pair<const char*, void (*)(TransformerConfig&)> strategies[] = {
      {"full uniform 1",
       [](TransformerConfig& c) {
         c.recompute_granularity = "full";
         c.recompute_method = "uniform";
         c.recompute_num_layers = 1;
       }},
      {"selective all",
       [](TransformerConfig& c) {
         actmem::testing::selective(c, {"core_attn", "mlp", "layernorm"});
       }},
      {"layer offload 2", [](TransformerConfig& c) { c.cpu_offloading_num_layers = 2; }},
      {"fine-grained offload",
       [](TransformerConfig& c) {
         actmem::testing::offload(c, {"attn_norm", "core_attn", "mlp_norm"});
       }},
  };
  for (const auto& [name, apply] : strategies) {
    TransformerConfig base = actmem::testing::offload_model();
    actmem::testing::set_precision(base, "fp16");
    TransformerConfig other = base;
    apply(other);
    TrainingConfig t = quick_training();
    t.hysteresis = 1;
    t.initial_loss_scale = kFp16SkipScale;
    Trainer plain(base, t), strat(other, t);
    int skipped = 0;
    actmem::testing::expect_bitwise_equal_training(
        plain, strat, 6, [&](const IterationStats& st) { skipped += st.skipped ? 1 : 0; });
    EXPECT_GT(skipped, 0) << name << ": the trajectory skipped no step";
  }
}

TEST(MixedPrecision, Bf16KeepsFp32MainParamsAndGradsAndCopiesBackRounded) {
  TransformerConfig c = actmem::testing::small_model();
  c.bf16 = true;
  Trainer trainer(c, quick_training());
  ASSERT_NE(trainer.mixed_precision(), nullptr);
  const auto params = trainer.model().ordered_parameters();
  // Initialised as the fp32 model rounded.
  TransformerConfig c32 = c;
  c32.bf16 = false;
  GPTModel fp32(c32);
  const auto p32 = fp32.ordered_parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    ASSERT_EQ(params[i].scalar_type(), at::kBFloat16);
    EXPECT_TRUE(bitwise_equal(params[i], p32[i].to(at::kBFloat16))) << i;
  }
  for (int step = 0; step < 2; ++step) {
    const auto st = trainer.train_step();
    EXPECT_FALSE(st.skipped);
    EXPECT_EQ(st.loss_scale, 1.0);
  }
  const auto& main = trainer.mixed_precision()->main_params();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(main[i].scalar_type(), at::kFloat);
    EXPECT_EQ(trainer.gradients()[i].scalar_type(), at::kFloat);
    EXPECT_FALSE(params[i].grad().defined()) << "16-bit gradients are freed by the hook";
    EXPECT_TRUE(bitwise_equal(params[i], main[i].to(at::kBFloat16))) << i;
  }
  // The main parameters hold what bf16 cannot: some differ from their rounded copy.
  bool finer = false;
  for (size_t i = 0; i < params.size(); ++i) {
    finer = finer || !bitwise_equal(params[i].to(at::kFloat), main[i]);
  }
  EXPECT_TRUE(finer);
}

// Scaling by a power of two is exact in floating point (away from overflow and underflow), and
// backward is linear in the loss's gradient: a constant loss scale of 2^10 must give the very
// bits of the unscaled run once the main grads are unscaled.
TEST(MixedPrecision, PowerOfTwoLossScaleIsBitwiseInvisible) {
  TransformerConfig c = actmem::testing::small_model();
  actmem::testing::set_precision(c, "bf16");
  TrainingConfig scaled = quick_training();
  scaled.loss_scale = 1024.0;
  Trainer plain(c, quick_training()), other(c, scaled);
  actmem::testing::expect_bitwise_equal_training(
      plain, other, 3, [](const IterationStats& st) { EXPECT_EQ(st.loss_scale, 1024.0); });
}

// A loss scale near fp32's maximum overflows bf16 gradients (bf16 has fp32's range): the step
// is skipped, parameters, main parameters and the learning-rate schedule stay, and the log says
// so.
TEST(MixedPrecision, OverflowingLossScaleSkipsTheStepAndKeepsEverything) {
  TransformerConfig c = actmem::testing::small_model();
  c.bf16 = true;
  c.micro_batch_size = 1;
  c.seq_length = 1;  // one token: the label's logit gradient is about the whole loss scale
  TrainingConfig t = quick_training();
  t.global_batch_size = 1;
  t.loss_scale = 3e38;
  Trainer trainer(c, t);
  std::vector<at::Tensor> before;
  for (const auto& p : trainer.model().ordered_parameters()) before.push_back(p.clone());
  const auto main_before = trainer.mixed_precision()->main_params()[0].clone();
  const auto st = trainer.train_step();
  EXPECT_TRUE(st.skipped);
  EXPECT_TRUE(std::isnan(st.grad_norm));
  const auto params = trainer.model().ordered_parameters();
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(bitwise_equal(params[i], before[i])) << i;
  EXPECT_TRUE(bitwise_equal(trainer.mixed_precision()->main_params()[0], main_before));
  const nlohmann::json j = to_json(st);
  EXPECT_TRUE(j["skipped"].get<bool>());
  EXPECT_TRUE(j["grad_norm"].is_null());
  // The schedule did not advance: the next step uses the first step's learning rate again.
  const auto again = trainer.train_step();
  EXPECT_EQ(again.lr, st.lr);
}

TEST(MixedPrecision, ValidationFollowsMegatron) {
  TransformerConfig c = actmem::testing::small_model();
  c.bf16 = c.fp16 = true;
  actmem::testing::expect_error_containing([&] { c.validate(); }, "bf16 and fp16 are exclusive");
  c.fp16 = false;
  TrainingConfig t;
  t.accumulate_allreduce_grads_in_fp32 = false;
  actmem::testing::expect_error_containing([&] { t.validate(c); },
                                           "bf16 accumulates and reduces gradients in fp32");
  c.bf16 = false;
  t = TrainingConfig();
  t.loss_scale = 8.0;
  actmem::testing::expect_error_containing([&] { t.validate(c); }, "loss_scale applies to");
  t = TrainingConfig();
  t.accumulate_allreduce_grads_in_fp32 = true;
  actmem::testing::expect_error_containing([&] { t.validate(c); }, "applies to --bf16 or --fp16");
  const auto r = actmem::testing::run_actmem("train --bf16 --hysteresis 3 --train-iters 1");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--hysteresis applies to dynamic loss scaling"), std::string::npos)
      << r.output;
  const auto both = actmem::testing::run_actmem("train --bf16 --fp16 --train-iters 1");
  EXPECT_NE(both.exit_code, 0);
  EXPECT_NE(both.output.find("exclusive"), std::string::npos) << both.output;
}

// ---- memory truth at 16 bits -------------------------------------------------------------------

// Korthikanti et al. Table 1's per-module terms are 16-bit values and 1-byte masks, so at bf16
// the ledger must equal them exactly, plus what this implementation keeps beyond the paper, each
// derived here by hand: LayerNorm's mean and rstd (2 x [s, b, 1] in bf16 on CPU), RMSNorm's
// fp32 rstd ([s, b, 1] x 4 bytes), RoPE's rotated q and k (2sbh x 2), SwiGLU's 2f-wide fc1
// output plus silu's output (2sbf x 2 beyond the paper's GeLU input).
struct LedgerShape {
  const char* name;
  int64_t layers, h, a, f, s, b;
  bool rms_swiglu_rope;
};

TEST(MemoryAtBf16, LedgerEqualsThePaperPerModulePlusTheExplainedExtras) {
  const LedgerShape shapes[] = {
      {"base", 2, 32, 4, 0, 16, 2, false},
      {"s13_a3_head7_b3", 2, 21, 3, 50, 13, 3, false},  // s not a multiple of 8, odd head dim
      {"a5_s19_b1", 1, 35, 5, 0, 19, 1, false},
      {"rms_swiglu_rope", 2, 32, 4, 40, 12, 2, true},
  };
  for (const auto& sh : shapes) {
    TransformerConfig c = actmem::testing::shaped_model(sh.layers, sh.h, sh.a, sh.f, sh.s, sh.b);
    actmem::testing::set_precision(c, "bf16");
    if (sh.rms_swiglu_rope) {
      c.normalization = "RMSNorm";
      c.gated_linear_unit = true;
      c.position_embedding_type = "rope";
    }
    TrainingConfig t = quick_training();
    t.global_batch_size = 0;
    Trainer trainer(c, t);
    ActivationLedger ledger;
    trainer.set_ledger(&ledger);
    const auto st = trainer.train_step(false);
    const int64_t s = sh.s, b = sh.b, h = sh.h, f = c.ffn();
    int modules_with_a_term = 0;
    for (const auto& [module, bytes] : ledger.bytes_by_module()) {
      const double paper = korthikanti_module_bytes(module, c, 2);
      if (paper < 0) continue;
      ++modules_with_a_term;
      int64_t extra = 0;
      if (module.find("layernorm") != std::string::npos) {
        extra = sh.rms_swiglu_rope ? s * b * 4 : 2 * s * b * 2;
      } else if (module.find("core_attention") != std::string::npos && sh.rms_swiglu_rope) {
        extra = 2 * s * b * h * 2;
      } else if (module.find("activation_func") != std::string::npos && sh.rms_swiglu_rope) {
        extra = 2 * s * b * f * 2;
      }
      EXPECT_EQ(static_cast<double>(bytes), paper + static_cast<double>(extra))
          << sh.name << " " << module;
      // inspect's explanation column says the same.
      EXPECT_EQ(module_bytes_beyond_paper(module, c).bytes, extra) << sh.name << " " << module;
    }
    EXPECT_EQ(modules_with_a_term, 10 * sh.layers) << sh.name;
    // And the predictor is exact to the byte for the whole forward.
    EXPECT_EQ(st.predicted_activation_bytes, st.activation_bytes) << sh.name;
  }
}

// bf16 halves every 16-bit term: the same model's activations at bf16 are the fp32 ones less
// half of everything but the 1-byte masks, the int64 targets and the fp32 loss values. (Its
// step peak is not lower on a model this small: 18-20 bytes per parameter against fp32's 16.)
TEST(MemoryAtBf16, ActivationsAreAboutHalfOfFp32) {
  TransformerConfig c = actmem::testing::small_model();
  TrainingConfig t = quick_training();
  Trainer fp32(c, t);
  actmem::testing::set_precision(c, "bf16");
  Trainer bf16(c, t);
  const auto a = fp32.train_step(false), b = bf16.train_step(false);
  EXPECT_LT(b.activation_bytes, a.activation_bytes * 0.62);
  EXPECT_GT(b.activation_bytes, a.activation_bytes * 0.45);
}

}  // namespace
}  // namespace actmem
