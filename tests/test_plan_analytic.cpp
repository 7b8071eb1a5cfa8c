// Tests for the analytic planner (plan_analytic.h, docs/planner.md "Paper presets"): its memory
// terms against the paper's formulas and percentages, its step ratios against the papers' FLOP
// counts, the offload cost, the front and the choice, and `actmem plan --preset`.
#include "actmem/config/activation_plan.h"
#include "actmem/flags/presets.h"
#include "actmem/memory/memory_model.h"
#include "actmem/plan/plan_analytic.h"
#include "actmem/plan/planner.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

namespace actmem {
namespace {

const PlanEstimate& find(const std::vector<PlanEstimate>& all, const std::string& name) {
  for (const auto& e : all) {
    if (e.strategy.name() == name) return e;
  }
  throw std::runtime_error("no strategy " + name);
}

// Element-wise ops and copies free: only the GEMMs cost time.
DeviceSpec gemms_only() {
  DeviceSpec gpu = device_spec("h100");
  gpu.memory_bandwidth = 1e30;
  gpu.d2h_bandwidth = gpu.h2d_bandwidth = 1e30;
  return gpu;
}

TEST(PlanAnalytic, ActivationTermsSumToThePapersFormulas) {
  for (const char* name : {"22b", "175b", "530b", "1t"}) {
    SCOPED_TRACE(name);
    const PaperShape m = paper_preset(name);
    const DeviceSpec gpu = device_spec("h100");
    const auto all = estimate_plans_analytic(m, analytic_strategies(m), gpu);
    const AnalyticBasis basis = analytic_basis(m, gpu);
    const double layers = basis.microbatches_in_flight * basis.layers_per_stage;
    const double plain = static_cast<double>(find(all, "plain").kept_bytes);
    const double selective = static_cast<double>(find(all, "selective core_attn").kept_bytes);
    const double full = static_cast<double>(find(all, "full uniform 1").kept_bytes);
    // Megatron's compute_activation_memory is selective core_attn recompute with SP, first stage.
    EXPECT_NEAR(selective, megatron_activation_memory(m), 2.0);
    // Per layer: the paper's eq. (4) without recompute, 34 sbh/t with selective, 2sbh/t full.
    const LayerBytes lb = paper_layer_bytes(m);
    EXPECT_NEAR(plain - selective, layers * (lb.none - lb.selective), 4.0);
    EXPECT_NEAR(selective - full, layers * (lb.selective - lb.full), 4.0);
  }
  // The paper's §5 percentages: selective recompute saves 70% of a GPT-3 layer's activations
  // and 65% of an MT-NLG layer's (5as/h = 80 and 64 against 34).
  for (const auto& [name, saved] : {std::pair<const char*, double>{"175b", 0.70}, {"530b", 0.65}}) {
    PaperShape m = paper_preset(name);
    m.p = 1;
    m.vpp.reset();
    const auto all = estimate_plans_analytic(m, analytic_strategies(m), device_spec("h100"));
    const double plain = static_cast<double>(find(all, "plain").kept_bytes);
    const double selective = static_cast<double>(find(all, "selective core_attn").kept_bytes);
    const double full = static_cast<double>(find(all, "full uniform 1").kept_bytes);
    const double layer_input = 2 * m.sbh() / m.t;
    const double per_layer = (plain - full) / m.L + layer_input;
    EXPECT_NEAR((plain - selective) / m.L / per_layer, saved, 0.005) << name;
  }
  // Without sequence parallelism: eq. (2), sbh(10 + 24/t + 5as/(ht)) per layer.
  PaperShape m = paper_preset("22b");
  m.sp = false;
  const auto all = estimate_plans_analytic(m, analytic_strategies(m), device_spec("h100"));
  const double sbh = m.sbh(), t = m.t;
  const double per_layer = sbh * (10 + 24 / t + 5 * m.a * m.s / (m.h * t));
  // Full recompute keeps each layer's (replicated) input, 2sbh.
  EXPECT_NEAR(static_cast<double>(find(all, "plain").kept_bytes -
                                  find(all, "full uniform 1").kept_bytes),
              m.L * (per_layer - 2 * sbh), 4.0);
}

TEST(PlanAnalytic, StepRatiosAreTheFlopCountsWhenOnlyGemmsCost) {
  // One stage with the output layer: Korthikanti Eq. (7) for the plain step, Narayanan et al.
  // 2021 Eq. (3) with full recompute (one more forward of every layer).
  PaperShape m = paper_preset("175b");
  m.p = 1;
  m.vpp.reset();
  const auto all = estimate_plans_analytic(m, analytic_strategies(m), gemms_only());
  const double s = m.s, h = m.h, L = m.L, v = m.v;
  const double eq7 = 1 + s / (6 * h) + v / (12 * h * L);
  EXPECT_NEAR(find(all, "full uniform 1").step_ratio,
              96 * (1 + s / (6 * h) + v / (16 * h * L)) / (72 * eq7), 1e-9);
  // Full block N rebuilds N of the L layers.
  EXPECT_NEAR(find(all, "full block 24").step_ratio - 1,
              (find(all, "full uniform 1").step_ratio - 1) * 24 / L, 1e-9);
  // Selective core_attn repeats the forward of the two s^2 GEMMs, 4bs^2h per layer: s/(18h) of
  // Eq. (7)'s leading term. The MLP's forward is 16bsh^2 of the 72bsh^2.
  EXPECT_NEAR(find(all, "selective core_attn").step_ratio, 1 + s / (18 * h) / eq7, 1e-9);
  EXPECT_NEAR(find(all, "selective mlp").step_ratio, 1 + 16.0 / 72 / eq7, 1e-9);
  // Norms cost no GEMM; offload with a link that keeps up costs nothing.
  EXPECT_EQ(find(all, "selective layernorm").step_ratio, 1.0);
  EXPECT_EQ(find(all, "offload core_attn+attn_proj+attn_norm+mlp_norm+qkv_linear").step_ratio, 1.0);
  // A pipeline stage without the output layer: exactly one forward more in four.
  const PaperShape stage = paper_preset("530b");
  const auto staged = estimate_plans_analytic(stage, analytic_strategies(stage), gemms_only());
  EXPECT_NEAR(find(staged, "full uniform 1").step_ratio, 4.0 / 3.0, 1e-12);
}

// Seed §4.3 under the analytic planner: with the flash kernel a layer keeps its fp32 logsumexp,
// 4asb/t, where the unfused kernel keeps 5as^2b/t of scores; core_attn recompute then frees only
// that, and the backward computes Q K^T again (2bs^2h/t more GEMM work per layer).
TEST(PlanAnalytic, FlashKeepsTheLogsumexpAndItsBackwardRecomputesTheScores) {
  PaperShape m = paper_preset("175b");
  m.p = 1;
  m.vpp.reset();
  PaperShape flash = m;
  flash.flash = true;
  const DeviceSpec gpu = gemms_only();
  const auto unfused_all = estimate_plans_analytic(m, analytic_strategies(m), gpu);
  const auto flash_all = estimate_plans_analytic(flash, analytic_strategies(flash), gpu);
  const double sb = m.s * m.b, t = m.t, L = m.L;
  auto kept = [](const std::vector<PlanEstimate>& all, const char* name) {
    return static_cast<double>(find(all, name).kept_bytes);
  };
  // Plain: the scores replaced by the logsumexp in every layer; core_attn recompute frees it.
  EXPECT_NEAR(kept(unfused_all, "plain") - kept(flash_all, "plain"),
              L * (5 * m.a * m.s * sb - 4 * m.a * sb) / t, 8.0);
  EXPECT_NEAR(kept(flash_all, "plain") - kept(flash_all, "selective core_attn"),
              L * 4 * m.a * sb / t, 8.0);
  // Without the scores the two kernels keep the same: core_attn recompute's result is the same.
  EXPECT_NEAR(kept(flash_all, "selective core_attn"), kept(unfused_all, "selective core_attn"),
              8.0);
  // Only GEMMs cost: the flash step is the unfused one plus Q K^T again in every backward.
  const double plain_unfused = analytic_basis(m, gpu).plain_step_s;
  const double plain_flash = analytic_basis(flash, gpu).plain_step_s;
  EXPECT_NEAR((plain_flash - plain_unfused) * gpu.matmul_flops, L * 2 * m.b * m.s * m.s * m.h / t,
              1e-6 * L * 2 * m.b * m.s * m.s * m.h / t);
  // core_attn recompute repeats both s^2 GEMMs (4bs^2h/t) under either kernel.
  EXPECT_NEAR(
      (find(flash_all, "selective core_attn").step_ratio - 1) * plain_flash * gpu.matmul_flops,
      L * 4 * m.b * m.s * m.s * m.h / t, 1e-6 * L * 4 * m.b * m.s * m.s * m.h / t);
}

TEST(PlanAnalytic, OffloadMovesItsTensorsAndCostsTheCopyItsLayerCannotHide) {
  const PaperShape m = paper_preset("7b");  // t 2 with SP, p 2, SwiGLU
  DeviceSpec gpu = device_spec("h100");
  const AnalyticBasis basis = analytic_basis(m, gpu);
  const double sb = m.s * m.b, t = m.t;
  const double moved_per_layer = (6 * sb * m.h + 5 * m.a * m.s * sb) / t;  // q, k, v and scores
  const double layers_moved = basis.microbatches_in_flight * basis.layers_per_stage - 1;  // margin
  auto all = estimate_plans_analytic(m, analytic_strategies(m), gpu);
  const PlanEstimate& plain = find(all, "plain");
  const PlanEstimate& off = find(all, "offload core_attn");
  EXPECT_NEAR(static_cast<double>(plain.kept_bytes - off.kept_bytes),
              layers_moved * moved_per_layer, 4.0);
  // The copy out hides behind the next layer's forward, the reload behind the layer's backward.
  const double f = basis.layer_forward_s;
  const double exposed = std::max(0.0, moved_per_layer / gpu.d2h_bandwidth - f) +
                         std::max(0.0, moved_per_layer / gpu.h2d_bandwidth - 2 * f);
  EXPECT_GT(exposed, 0.0);  // 7b's scores do not fit PCIe's window
  EXPECT_NEAR(off.step_ratio,
              1 + layers_moved / basis.microbatches_in_flight * exposed / basis.plain_step_s, 1e-9);
  // A link that keeps up hides it; a faster link never costs more.
  gpu.d2h_bandwidth = gpu.h2d_bandwidth = 1e30;
  EXPECT_EQ(find(estimate_plans_analytic(m, {off.strategy}, gpu), "offload core_attn").step_ratio,
            1.0);
  DeviceSpec pcie_link = device_spec("gh200");  // the same GPU behind PCIe Gen5
  pcie_link.d2h_bandwidth = pcie_link.h2d_bandwidth = 55.6e9;
  const auto c2c = estimate_plans_analytic(m, analytic_strategies(m), device_spec("gh200"));
  const auto pcie = estimate_plans_analytic(m, analytic_strategies(m), pcie_link);
  ASSERT_EQ(c2c.size(), pcie.size());
  for (size_t i = 0; i < c2c.size(); ++i) {
    if (c2c[i].strategy.offload_modules.empty()) continue;
    EXPECT_LE(c2c[i].step_ratio, pcie[i].step_ratio) << c2c[i].strategy.name();
    if (c2c[i].strategy.offload_modules == std::vector<OffloadModule>{OffloadModule::kCoreAttn}) {
      EXPECT_LT(c2c[i].step_ratio, pcie[i].step_ratio);  // q, k, v and the scores: exposed on PCIe
    }
  }
  // Layer-level offload only without pipeline stages (Megatron's rule), every K < L.
  std::set<std::string> names;
  for (const auto& s : analytic_strategies(m)) names.insert(s.name());
  EXPECT_EQ(names.count("layer offload 1"), 0u);
  EXPECT_EQ(names.count("full block 16"), 1u);  // N up to the stage's 16 layers
  EXPECT_EQ(names.count("full block 17"), 0u);
  PaperShape one = m;
  one.p = 1;
  names.clear();
  for (const auto& s : analytic_strategies(one)) names.insert(s.name());
  EXPECT_EQ(names.count("layer offload 1"), 1u);
  EXPECT_EQ(names.count("layer offload 31"), 1u);
  EXPECT_EQ(names.count("layer offload 32"), 0u);
}

TEST(PlanAnalytic, FrontIsMonotonicAndEveryBudgetChoosesAPlanThatFits) {
  for (const char* name : {"7b", "175b"}) {
    SCOPED_TRACE(name);
    const PaperShape m = paper_preset(name);
    const std::vector<Strategy> strategies = analytic_strategies(m);
    const TransformerConfig c = analytic_config(m);
    std::set<std::string> names;
    for (const auto& s : strategies) {
      EXPECT_NO_THROW(make_activation_plan(s.apply(c))) << s.name();
      EXPECT_TRUE(names.insert(s.name()).second) << "twice: " << s.name();
    }
    const auto all = estimate_plans_analytic(m, strategies, device_spec("h100"));
    const auto front = pareto_front(all);
    ASSERT_GE(front.size(), 3u);
    for (size_t i = 1; i < front.size(); ++i) {
      EXPECT_GT(front[i].peak_bytes, front[i - 1].peak_bytes);
      EXPECT_LT(front[i].step_ratio, front[i - 1].step_ratio);
    }
    for (const auto& e : all) {  // nothing off the front beats it
      const bool dominated = std::any_of(front.begin(), front.end(), [&e](const PlanEstimate& f) {
        return f.peak_bytes <= e.peak_bytes && f.step_ratio <= e.step_ratio;
      });
      EXPECT_TRUE(dominated) << e.strategy.name();
    }
    double last_ratio = std::numeric_limits<double>::infinity();
    const int64_t lo = front.front().peak_bytes, hi = front.back().peak_bytes;
    for (int k = 0; k <= 40; ++k) {
      const int64_t budget = lo + (hi - lo) / 40 * k;
      const PlanEstimate& chosen = choose_plan(front, budget);
      EXPECT_LE(chosen.peak_bytes, budget);
      EXPECT_LE(chosen.step_ratio, last_ratio);  // a larger budget is never slower
      last_ratio = chosen.step_ratio;
    }
    try {
      choose_plan(front, lo - 1);
      ADD_FAILURE() << "a budget below the minimum was accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("smallest predicted peak"), std::string::npos);
    }
  }
}

TEST(PlanAnalytic, PlansAHundredLayerModelAndRefusesWhatItDoesNotModel) {
  PaperShape m = paper_preset("530b");  // 105 layers
  m.p = 1;
  m.vpp.reset();
  const std::vector<Strategy> strategies = analytic_strategies(m);
  std::set<std::string> names;
  for (const auto& s : strategies) names.insert(s.name());
  EXPECT_EQ(names.count("full uniform 105"), 1u);
  EXPECT_EQ(names.count("layer offload 104"), 1u);
  for (const auto& e : estimate_plans_analytic(m, strategies, device_spec("a100"))) {
    EXPECT_GT(e.peak_bytes, e.kept_bytes);
    EXPECT_GE(e.step_ratio, 1.0);
  }
  PaperShape moe = paper_preset("7b");
  moe.moe.experts = 8;
  moe.moe.ffn = 1024;
  moe.moe.layers = 32;
  EXPECT_THROW(analytic_strategies(moe), c10::Error);
  EXPECT_THROW(device_spec("tpu"), c10::Error);
  PaperShape odd = paper_preset("7b");
  odd.a = 30;  // 4096 is not a multiple of 30 heads
  EXPECT_THROW(analytic_strategies(odd), c10::Error);
}

TEST(PlanCli, PlansAPresetAnalytically) {
  const std::string dir = testing::fresh_temp_dir("plan-preset");
  auto r = testing::run_actmem("plan --preset 7b --gpu h100 --json " + dir + "/p.json --svg " +
                               dir + "/p.svg");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("analytic"), std::string::npos) << r.output;
  const auto plan = nlohmann::json::parse(std::ifstream(dir + "/p.json"));
  // The budget defaults to the GPU's memory; the choice fits it and is on the front.
  EXPECT_EQ(plan["memory_budget_bytes"].get<double>(), 80.0 * 1024 * 1024 * 1024);
  EXPECT_LE(plan["chosen"]["peak_bytes"].get<int64_t>(), plan["memory_budget_bytes"].get<int64_t>());
  EXPECT_NE(r.output.find("flags: "), std::string::npos);
  std::stringstream svg;
  svg << std::ifstream(dir + "/p.svg").rdbuf();
  size_t dots = 0;
  for (size_t at = svg.str().find("<circle data-name="); at != std::string::npos;
       at = svg.str().find("<circle data-name=", at + 1)) {
    ++dots;
  }
  EXPECT_EQ(dots, plan["legal_strategies"].get<size_t>());
  // Shape and layout flags change the preset.
  r = testing::run_actmem("plan --preset 7b --seq-length 8192 --pipeline-model-parallel-size 1 "
                          "--memory-budget 120GiB --json " + dir + "/q.json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto q = nlohmann::json::parse(std::ifstream(dir + "/q.json"));
  EXPECT_EQ(q["shape"]["s"].get<double>(), 8192.0);
  EXPECT_EQ(q["shape"]["p"].get<double>(), 1.0);
  EXPECT_EQ(q["memory_budget_bytes"].get<int64_t>(), int64_t{120} << 30);
  // Seed §4.3 for a published shape: Llama 3 8B (L 32, a 32, s 8192, b 1) at t 8 with SP. The
  // flags choose flash (no dropout); core_attn recompute frees its logsumexp only, 4asb/t per
  // layer, where under the unfused kernel it frees the scores, 5as^2b/t.
  r = testing::run_actmem(
      "plan --preset llama3-8b --tensor-model-parallel-size 8 "
      "--sequence-parallel --json " +
      dir + "/k.json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("attention flash (auto"), std::string::npos) << r.output;
  const auto k = nlohmann::json::parse(std::ifstream(dir + "/k.json"));
  ASSERT_EQ(k["attention_kernels"].size(), 2u);
  const auto& unfused = k["attention_kernels"][0];
  const auto& flash = k["attention_kernels"][1];
  EXPECT_EQ(unfused["kernel"], "unfused");
  EXPECT_FALSE(unfused["chosen_by_the_flags"].get<bool>());
  EXPECT_TRUE(flash["chosen_by_the_flags"].get<bool>());
  const int64_t L = 32, a = 32, s = 8192, t = 8;
  EXPECT_EQ(flash["core_attn_freed_bytes"].get<int64_t>(), L * 4 * a * s / t);
  EXPECT_EQ(unfused["core_attn_freed_bytes"].get<int64_t>(), L * 5 * a * s * s / t);
  EXPECT_LT(flash["plain"]["peak_bytes"].get<int64_t>(),
            unfused["plain"]["peak_bytes"].get<int64_t>());
  // Below the minimum and unknown presets: clear errors (flags that need a run, unknown GPUs
  // and the preset-only flags without --preset: Refused/BadValues in test_robustness.cpp).
  r = testing::run_actmem("plan --preset 7b --memory-budget 1GiB");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("smallest predicted peak"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--gpu"), std::string::npos) << r.output;  // what else would lower it
  r = testing::run_actmem("plan --preset 9b");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("unknown preset"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace actmem
