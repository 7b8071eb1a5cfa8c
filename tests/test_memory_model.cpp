// test_memory_model.cpp — the activation ledger against the tracker, the exact predictor within
// 3% of measured over a sweep of shapes and every strategy, the hook stack, the paper's numbers
// for the 7B worked example (docs/memory-model.md), and the SVG plot.
#include "actmem/base/compat.h"
#include "actmem/flags/presets.h"
#include "actmem/memory/ledger.h"
#include "actmem/memory/memory_model.h"
#include "actmem/memory/memory_tracker.h"
#include "actmem/model/activation_bytes.h"
#include "actmem/train/plot.h"
#include "actmem/train/trainer.h"
#include "fixtures.h"
#include "test_util.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <map>
#include <sstream>

namespace actmem {
namespace {

using actmem::testing::expect_error_containing;

// ---- saved-tensor hook stack ------------------------------------------------------------------

struct Counter : SavedTensorHook {
  int packs = 0;
  std::shared_ptr<PackedTensor> pack(const at::Tensor&) override {
    ++packs;
    return nullptr;
  }
};

struct Doubler : SavedTensorHook {  // replaces every saved tensor by a handle
  struct Handle : PackedTensor {
    at::Tensor t;
    int* unpacks;
    at::Tensor unpack() override {
      ++*unpacks;
      return t;
    }
  };
  int unpacks = 0;
  std::shared_ptr<PackedTensor> pack(const at::Tensor& t) override {
    auto h = std::make_shared<Handle>();
    h->t = t.clone();
    h->unpacks = &unpacks;
    return h;
  }
};

TEST(SavedTensorHooks, EveryLayerObservesAndTheInnermostReplaces) {
  const at::Tensor x = at::randn({4}).requires_grad_(true);
  Counter outer;
  Doubler inner;
  at::Tensor y;
  {
    SavedTensorHooksGuard g1(outer);
    SavedTensorHooksGuard g2(inner);
    EXPECT_EQ(saved_tensor_hooks_depth(), 2u);
    y = x.sin() * x;  // sin saves x; mul saves sin(x) and x
  }
  EXPECT_EQ(saved_tensor_hooks_depth(), 0u);
  EXPECT_EQ(outer.packs, 3);
  y.sum().backward();
  EXPECT_EQ(inner.unpacks, 3);
  EXPECT_TRUE(at::allclose(x.grad(), x.detach().cos() * x.detach() + x.detach().sin()));
}

TEST(SavedTensorHooks, KeepAutogradsInPlaceCheck) {
  // libtorch skips its version check when hooks are set; ours must catch the in-place change.
  const at::Tensor x = at::randn({4}).requires_grad_(true);
  Counter observer;
  at::Tensor y;
  {
    SavedTensorHooksGuard guard(observer);
    y = x.sigmoid();  // saves its output
  }
  y.mul_(2);
  expect_error_containing([&] { y.sum().backward(); }, "modified by an inplace operation");
}

TEST(SavedTensorHooks, AGraphDroppedWithoutBackwardFreesItsMemory) {
  auto& mem = device_memory(at::kCPU);
  const at::Tensor x = at::randn({1 << 18}).requires_grad_(true);
  Counter observer;
  const int64_t before = mem.current_bytes();
  {
    SavedTensorHooksGuard guard(observer);
    at::Tensor y = x.exp();  // exp saves its own output: a cycle if the tensor itself were kept
  }
  EXPECT_EQ(mem.current_bytes(), before);
}

// ---- ledger -----------------------------------------------------------------------------------

TEST(ActivationLedger, CountsStoragesOnceExcludesParametersAndNamesModulesAndOps) {
  const at::Tensor w = at::randn({8, 8}).requires_grad_(true);
  const at::Tensor x = at::randn({4, 8}).requires_grad_(true);
  ActivationLedger ledger;
  ledger.exclude(w);
  at::Tensor out;  // keeps the graph (and what it saved) alive past the scope
  {
    LedgerScope scope(ledger);
    ModuleScope m("layers", 2);
    const at::Tensor h = at::matmul(x.relu(), w);  // relu saves its output; mm saves it again
    ModuleScope inner("act");
    out = h.tanh();  // tanh saves its output
  }
  ASSERT_GE(ledger.records().size(), 3u);
  int64_t counted = 0;
  for (const auto& r : ledger.records()) counted += r.counted;
  EXPECT_EQ(ledger.total_bytes(), 2 * 4 * 8 * 4);  // relu output once + tanh output
  EXPECT_EQ(counted, 2);
  EXPECT_EQ(ledger.records().front().module, "layers.2");
  EXPECT_EQ(ledger.records().back().module, "layers.2.act");
  EXPECT_EQ(ledger.records().back().op, "aten::tanh");
  for (const auto& r : ledger.records()) EXPECT_NE(r.shape, (std::vector<int64_t>{8, 8}));
  ledger.clear();
  EXPECT_EQ(ledger.total_bytes(), 0);
}

TransformerConfig sweep_base() {
  return actmem::testing::shaped_model(3, 48, 4, 72, 24, 3);
}

struct Shape {
  const char* name;
  void (*apply)(TransformerConfig&);
};
inline void PrintTo(const Shape& s, std::ostream* os) {
  *os << s.name;
}

const Shape kShapes[] = {
    {"Base", [](TransformerConfig&) {}},
    {"OddSizes",
     [](TransformerConfig& c) {
       c.hidden_size = 35;
       c.num_attention_heads = 5;
       c.ffn_hidden_size = 57;
       c.seq_length = 19;
       c.micro_batch_size = 1;
     }},
    {"ManyHeadsLongSeq",
     [](TransformerConfig& c) {
       c.hidden_size = 64;
       c.num_attention_heads = 16;
       c.seq_length = 96;
       c.micro_batch_size = 2;
       c.num_layers = 2;
     }},
    {"NoDropout",
     [](TransformerConfig& c) {
       c.attention_dropout = c.hidden_dropout = 0.0;
       c.attention_backend = "unfused";  // auto would run flash without attention dropout
     }},
    // The flash kernel (Note [The flash kernel's layout] in attention/attention.cpp): auto picks it
    // when the attention dropout is 0; with grouped-query attention its k and v stay at G heads.
    {"FlashAuto", [](TransformerConfig& c) { c.attention_dropout = 0.0; }},
    {"FlashOddSizesMultiQuery",
     [](TransformerConfig& c) {
       c.hidden_size = 35;
       c.num_attention_heads = 5;
       c.num_query_groups = 1;
       c.seq_length = 19;
       c.attention_dropout = 0.0;
       c.attention_backend = "flash";
     }},
    {"FlashGroupedQueryRope",
     [](TransformerConfig& c) {
       c.num_query_groups = 2;
       c.position_embedding_type = "rope";
       c.attention_dropout = 0.0;
       c.attention_backend = "flash";
     }},
    {"FlashRope",
     [](TransformerConfig& c) {
       c.position_embedding_type = "rope";
       c.attention_dropout = 0.0;
       c.attention_backend = "flash";
     }},
    // Grouped-query attention (Note [What standard attention keeps] in
    // attention/attention_part.cpp): 2 groups of 2 heads with learned positions, and one group
    // (multi-query) with RoPE.
    {"GroupedQuery", [](TransformerConfig& c) { c.num_query_groups = 2; }},
    {"MultiQuery", [](TransformerConfig& c) { c.num_query_groups = 1; }},  // q stays a view
    {"MultiQueryRope",
     [](TransformerConfig& c) {
       c.num_query_groups = 1;
       c.position_embedding_type = "rope";
     }},
    {"RmsSwigluRopeUntied",
     [](TransformerConfig& c) {
       c.normalization = "RMSNorm";
       c.gated_linear_unit = true;
       c.position_embedding_type = "rope";
       c.untie_embeddings_and_output_weights = true;
       c.add_bias_linear = false;
     }},
};

using actmem::testing::kRecomputePolicies;

class PredictorSweep : public ::testing::TestWithParam<std::tuple<Shape, const char*>> {};

TEST_P(PredictorSweep, ExactToTheByteForEveryStrategy) {
  for (const auto& [policy, apply] : kRecomputePolicies) {
    TransformerConfig c = sweep_base();
    std::get<0>(GetParam()).apply(c);
    actmem::testing::set_precision(c, std::get<1>(GetParam()));
    apply(c);
    TrainingConfig t;
    t.eval_interval = 0;
    Trainer trainer(c, t);
    ActivationLedger ledger;
    trainer.set_ledger(&ledger);
    const auto st = trainer.train_step(false);
    const auto predicted = predict_activation_bytes(c);
    EXPECT_EQ(c.flash_attention(),
              std::string(std::get<0>(GetParam()).name).rfind("Flash", 0) == 0);
    EXPECT_EQ(st.predicted_activation_bytes, predicted.total);
    ASSERT_FALSE(ledger.records().empty()) << policy;
    EXPECT_EQ(predicted.total, st.activation_bytes) << policy;
    // Module by module, the predictor names what the ledger saw (the ledger does not see the
    // checkpoints' random-state snapshots and the loss value, which the predictor adds).
    for (const auto& [module, bytes] : ledger.bytes_by_module()) {
      if (bytes == 0) continue;  // saved, then freed by output-discarding recompute
      const auto it = std::find_if(predicted.by_module.begin(), predicted.by_module.end(),
                                   [&](const auto& p) { return p.first == module; });
      ASSERT_NE(it, predicted.by_module.end()) << policy << ": ledger module " << module;
      EXPECT_LE(bytes, it->second) << policy << " " << module;
      EXPECT_GE(bytes, it->second - checkpoint_snapshot_bytes()) << policy << " " << module;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, PredictorSweep,
                         ::testing::Combine(::testing::ValuesIn(kShapes),
                                            ::testing::ValuesIn(actmem::testing::kPrecisions)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param).name) + "_" +
                                  std::get<1>(info.param);
                         });

TEST(ActivationLedger, SeesDiscardedNormOutputsAsFreed) {
  TransformerConfig c = sweep_base();
  c.recompute_granularity = "selective";
  c.recompute_modules = std::vector<std::string>{"layernorm"};
  TrainingConfig t;
  t.eval_interval = 0;
  Trainer trainer(c, t);
  ActivationLedger ledger;
  trainer.set_ledger(&ledger);
  trainer.train_step(false);
  int discarded = 0;
  for (const auto& r : ledger.records()) {
    if (r.discarded) {
      ++discarded;
      EXPECT_EQ(r.storage_bytes, 0);
    }
  }
  EXPECT_GE(discarded, 2 * c.num_layers);  // each norm output was saved, then freed
}

// ---- the paper's formulas ---------------------------------------------------------------------

TEST(Estimate, SeedSevenBillionExample) {
  const PaperShape m = paper_preset("7b");
  const LayerBytes l = paper_layer_bytes(m);
  const double GiB = 1024.0 * 1024 * 1024, MiB = 1024.0 * 1024;
  EXPECT_NEAR(l.none / GiB, 3.03, 0.005);      // 194 sbh / t
  EXPECT_NEAR(l.none * 16 / GiB, 48.5, 0.05);  // 16 layers per stage
  EXPECT_NEAR(l.s2_fraction, 0.825, 0.0005);   // 160 / 194
  EXPECT_DOUBLE_EQ(l.selective / GiB, 0.5);    // 32 sbh / t
  EXPECT_DOUBLE_EQ(l.selective * 16 / GiB, 8.0);
  EXPECT_DOUBLE_EQ(l.full / MiB, 32.0);  // 2 sbh / t
  EXPECT_DOUBLE_EQ(l.full * 16 / MiB, 512.0);
  EXPECT_NEAR(offload_round_trip_seconds(8 * GiB, 50.0), 0.34, 0.005);
}

TEST(Estimate, PaperTableTwoVariants) {
  PaperShape m = paper_preset("22b");  // a = 64, h = 6144, s = 2048: 5as/h = 106.67
  m.t = 8;
  m.sp = false;
  const double sbh = m.sbh(), sq = 5 * m.a * m.s / m.h;
  EXPECT_DOUBLE_EQ(paper_layer_bytes(m).none, sbh * (10 + 24.0 / 8 + sq / 8));  // eq. 2
  EXPECT_DOUBLE_EQ(paper_layer_bytes(m).selective, sbh * (10 + 24.0 / 8));
  m.sp = true;
  EXPECT_DOUBLE_EQ(paper_layer_bytes(m).none, sbh * (34 + sq) / 8);  // eq. 4
  EXPECT_DOUBLE_EQ(paper_layer_bytes(m).selective, sbh * 34 / 8);    // eq. 6
  EXPECT_DOUBLE_EQ(paper_layer_bytes(m).full, 2 * sbh / 8);
  m.t = 1;
  m.sp = false;
  EXPECT_DOUBLE_EQ(paper_layer_bytes(m).none, sbh * (34 + sq));  // eq. 1
  EXPECT_DOUBLE_EQ(paper_layer_bytes(m).full, 2 * sbh);
  expect_error_containing([] { paper_preset("13b"); }, "unknown preset '13b'; known: ");
}

TEST(Estimate, MegatronTheoreticalTerms) {
  PaperShape m = paper_preset("22b");  // p = 1: logits term, no pipeline factor
  const double sbh = m.sbh();
  EXPECT_DOUBLE_EQ(megatron_activation_memory(m),
                   (sbh * 34 * m.L + 8 * m.s * m.b + sbh + sbh * 4 * (1 + m.v / m.h)) / m.t);
  EXPECT_DOUBLE_EQ(megatron_activation_memory_without_sp(m),
                   1.05 * (sbh * (10 + 24 / m.t) * m.L + 8 * m.s * m.b + sbh +
                           2 * (m.s * m.b * m.v / m.t + sbh)));
  PaperShape p = paper_preset("175b");  // interleaved: factor 1 + (p - 1) / (p v)
  const double base = p.sbh() * 34 * p.L + 8 * p.s * p.b * p.p + p.sbh() * p.p;
  EXPECT_DOUBLE_EQ(megatron_activation_memory(p), base * (1 + 7.0 / 24.0) / p.t);
}

// Megatron's compute_weight_and_optimizer_memory, recounted module by module: per layer the QKV
// and output projections (4h^2), SwiGLU's fc1 (2f x h) and fc2 (h x f), two norms' weights and
// biases (4h); the final norm (2h); the word embedding and the untied output layer (vh each).
TEST(Estimate, WeightAndOptimizerMemoryAsMegatronCountsIt) {
  PaperShape m = paper_preset("7b");  // t 2, p 2, SwiGLU, untied
  const double h = 4096, L = 32, f = 14336, v = 32000;
  const double split = L * (4 * h * h + 3 * h * f), norms = L * 4 * h + 2 * h;
  const double layers = split + norms;
  WeightMemory w = megatron_weight_and_optimizer_memory(m);
  EXPECT_DOUBLE_EQ(w.parameters, layers + 2 * v * h);
  // The first of two stages holds half the layers and the embedding (the output layer is on the
  // last stage): the projections and the embedding split over t = 2, the norms replicated.
  EXPECT_DOUBLE_EQ(w.parameters_on_rank, (split / 2 + v * h) / 2 + norms / 2);
  EXPECT_DOUBLE_EQ(w.total(), 18 * w.parameters_on_rank);  // 2 + 4 + 4 + 8
  EXPECT_DOUBLE_EQ(w.weight_bytes, 2 * w.parameters_on_rank);
  m.distributed_optimizer = true;
  m.d = 4;
  w = megatron_weight_and_optimizer_memory(m);
  EXPECT_DOUBLE_EQ(w.total(), (6 + 12.0 / 4) * w.parameters_on_rank);
  m.p = 1;  // one stage holds everything, the untied output layer included
  w = megatron_weight_and_optimizer_memory(m);
  EXPECT_DOUBLE_EQ(w.parameters_on_rank, (split + 2 * v * h) / 2 + norms);
  PaperShape g = paper_preset("22b");  // GeLU (ffn 4h), tied: 12h^2 + 4h per layer
  const double gh = 6144;
  EXPECT_DOUBLE_EQ(megatron_weight_and_optimizer_memory(g).parameters,
                   48 * (12 * gh * gh + 4 * gh) + 2 * gh + 51200 * gh);
}

TEST(Estimate, CliPrintsTheSevenBillionNumbersAndJson) {
  const auto r = actmem::testing::run_actmem("estimate");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* want :
       {"3.03 GiB", "48.5 GiB", "82.5%", "512 MiB", "8.00 GiB", "32.0 MiB", "0.34 s"}) {
    EXPECT_NE(r.output.find(want), std::string::npos) << want << "\n" << r.output;
  }
  const auto j = actmem::testing::run_actmem("estimate --json");
  ASSERT_EQ(j.exit_code, 0);
  const auto parsed = nlohmann::json::parse(j.output);
  EXPECT_DOUBLE_EQ(parsed["per_stage_bytes"]["selective"].get<double>(), 8.0 * (1 << 30));
  EXPECT_DOUBLE_EQ(parsed["per_layer_bytes"]["full"].get<double>(), 32.0 * (1 << 20));
  // The whole device: weights and optimizer at 18 bytes per parameter, plus activations.
  const auto& w = parsed["weights_and_optimizer"];
  EXPECT_DOUBLE_EQ(w["total_bytes"].get<double>(), 18 * w["parameters_on_rank"].get<double>());
  EXPECT_DOUBLE_EQ(parsed["device_bytes_per_rank"]["selective"].get<double>(),
                   w["total_bytes"].get<double>() + 2 * 8.0 * (1 << 30));  // p = 2 in flight
  EXPECT_NE(r.output.find("18 B/param"), std::string::npos) << r.output;
  const auto d = actmem::testing::run_actmem(
      "estimate --json --use-distributed-optimizer "
      "--data-parallel-size 4");
  ASSERT_EQ(d.exit_code, 0) << d.output;
  EXPECT_DOUBLE_EQ(
      nlohmann::json::parse(d.output)["weights_and_optimizer"]["bytes_per_parameter"].get<double>(),
      9.0);
  EXPECT_NEAR(parsed["s2_fraction"].get<double>(), 0.825, 0.0005);
  const auto bad = actmem::testing::run_actmem("estimate --hidden-size -3");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.stderr_text.find("expected a positive number"), std::string::npos);
}

TEST(Estimate, PerStageActivationsFollowTheScheduleInFlight) {
  // 1F1B: stage r holds min(p - r, M) micro-batches; interleaved with v chunks (groups of p):
  // min(2 (p - r - 1) + (v - 1) p + 1, M v) chunk-micro-batches, i.e. p (1 + (p - 1)/(p v))
  // stage-micro-batches on the first stage (Korthikanti et al. 2022's interleaved factor).
  auto stages = [](const std::string& flags) {
    const auto r =
        actmem::testing::run_actmem("estimate --json --preset 7b --num-layers 32 " + flags);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return nlohmann::json::parse(r.output);
  };
  const auto plain = stages("--pipeline-model-parallel-size 4");
  ASSERT_EQ(plain["per_pipeline_stage"].size(), 4u);
  EXPECT_EQ(plain["schedule"], "1F1B");
  for (int r = 0; r < 4; ++r) {
    const auto& row = plain["per_pipeline_stage"][static_cast<size_t>(r)];
    EXPECT_DOUBLE_EQ(row["microbatches_in_flight"].get<double>(), 4.0 - r);
    EXPECT_DOUBLE_EQ(row["activation_bytes"]["selective"].get<double>(),
                     (4.0 - r) * plain["per_stage_bytes"]["selective"].get<double>());
  }
  const auto few = stages("--pipeline-model-parallel-size 4 --num-microbatches 2");
  EXPECT_DOUBLE_EQ(few["per_pipeline_stage"][0]["microbatches_in_flight"].get<double>(), 2.0);
  const auto inter =
      stages("--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 4");
  EXPECT_EQ(inter["schedule"], "interleaved 1F1B");
  EXPECT_DOUBLE_EQ(inter["virtual_pipeline_size"].get<double>(), 2.0);  // 8 layers per stage / 4
  EXPECT_DOUBLE_EQ(inter["per_pipeline_stage"][0]["microbatches_in_flight"].get<double>(),
                   4.0 * (1.0 + 3.0 / 8.0));
  EXPECT_DOUBLE_EQ(inter["per_pipeline_stage"][3]["microbatches_in_flight"].get<double>(), 2.5);
  // The first stage's total uses it.
  EXPECT_DOUBLE_EQ(inter["device_bytes_per_rank"]["selective"].get<double>(),
                   inter["weights_and_optimizer"]["total_bytes"].get<double>() +
                       5.5 * inter["per_stage_bytes"]["selective"].get<double>());
  const auto same =
      stages("--pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2");
  EXPECT_EQ(same["per_pipeline_stage"], inter["per_pipeline_stage"]);
  const auto bad = actmem::testing::run_actmem(
      "estimate --preset 7b --num-layers 32 --pipeline-model-parallel-size 4 "
      "--num-virtual-stages-per-pipeline-rank 2 --num-microbatches 6");
  EXPECT_NE(bad.exit_code, 0);
  // Megatron's interleaved rule (forward_backward_pipelining_with_interleaving): M mod p (the
  // default group) is 0 or at least p.
  EXPECT_NE(bad.output.find("The remainder of M"), std::string::npos) << bad.output;
  const auto uneven = actmem::testing::run_actmem(
      "estimate --preset 7b --num-layers 32 --pipeline-model-parallel-size 4 "
      "--num-layers-per-virtual-pipeline-stage 3");
  EXPECT_NE(uneven.exit_code, 0);
  EXPECT_NE(uneven.output.find("divisible number of layers per virtual pipeline stage"),
            std::string::npos)
      << uneven.output;
}

TEST(Estimate, ExplicitSizesDescribeExactlyTheirModel) {
  // Sizes without --preset are a model of their own with Megatron's defaults (LayerNorm, GeLU,
  // tied embeddings): nothing comes from the 7b preset. Parameters by Megatron's
  // compute_weight_and_optimizer_memory (theoretical_memory_usage.py), worked here:
  // per layer 4h^2 (attention) + 2 h ffn (MLP) + 2h x 2 (norms), plus V h and the final norm 2h.
  const std::string sizes =
      "estimate --json --num-layers 24 --hidden-size 2048 "
      "--num-attention-heads 16 --seq-length 2048 --micro-batch-size 1 "
      "--vocab-size 51200";
  const auto r = actmem::testing::run_actmem(sizes);
  ASSERT_EQ(r.exit_code, 0) << r.output << r.stderr_text;
  const auto j = nlohmann::json::parse(r.output);
  const double h = 2048, ffn = 4 * h, L = 24, V = 51200;
  EXPECT_EQ(j["model"]["ffn_hidden_size"].get<double>(), ffn);  // Megatron's 4h
  EXPECT_FALSE(j["model"]["swiglu"].get<bool>());
  EXPECT_FALSE(j["model"]["untied"].get<bool>());
  EXPECT_EQ(j["model"]["normalization"], "LayerNorm");
  EXPECT_TRUE(j["model"]["base"].is_null());
  EXPECT_EQ(j["model"]["tensor_model_parallel_size"].get<double>(), 1);
  EXPECT_EQ(j["model"]["pipeline_model_parallel_size"].get<double>(), 1);
  const double per_layer = 4 * h * h + 2 * h * ffn + 4 * h;
  EXPECT_DOUBLE_EQ(j["weights_and_optimizer"]["parameters"].get<double>(),
                   L * per_layer + V * h + 2 * h);
  // --swiglu without --ffn-hidden-size: Megatron's int((4h x 2/3) / 64) x 64 = 5440 for h 2048.
  const auto g =
      actmem::testing::run_actmem(sizes + " --swiglu --untie-embeddings-and-output-weights");
  ASSERT_EQ(g.exit_code, 0) << g.stderr_text;
  const auto jg = nlohmann::json::parse(g.output);
  EXPECT_EQ(jg["model"]["ffn_hidden_size"].get<double>(), 5440);
  EXPECT_DOUBLE_EQ(jg["weights_and_optimizer"]["parameters"].get<double>(),
                   L * (4 * h * h + 2 * h * 5440 * 1.5 + 4 * h) + 2 * V * h + 2 * h);
  // A preset named is the base, and what it brings can be switched off and is printed.
  const auto p = actmem::testing::run_actmem(
      "estimate --json --preset 7b --no-swiglu "
      "--tie-embeddings-and-output-weights");
  ASSERT_EQ(p.exit_code, 0) << p.stderr_text;
  const auto jp = nlohmann::json::parse(p.output);
  EXPECT_EQ(jp["model"]["base"], "7b");
  EXPECT_FALSE(jp["model"]["swiglu"].get<bool>());
  EXPECT_FALSE(jp["model"]["untied"].get<bool>());
  const auto text = actmem::testing::run_actmem("estimate --preset 7b --num-layers 16");
  EXPECT_NE(text.output.find("7b (with the flags given)"), std::string::npos) << text.output;
  EXPECT_NE(text.output.find("SwiGLU, untied embeddings, LayerNorm"), std::string::npos)
      << text.output;
  // Sizes that leave the model unsaid are refused, naming what is missing.
  const auto bad = actmem::testing::run_actmem("estimate --hidden-size 2048 --num-layers 24");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.stderr_text.find("missing: --num-attention-heads, --seq-length, "
                                 "--micro-batch-size, --vocab-size"),
            std::string::npos)
      << bad.stderr_text;
  // A switch and its negation: the last one given wins, as with Megatron's argparse.
  for (const auto& [flags, swiglu] :
       {std::pair{"--swiglu --no-swiglu", false}, std::pair{"--no-swiglu --swiglu", true}}) {
    const auto both = actmem::testing::run_actmem(std::string("estimate --json ") + flags);
    ASSERT_EQ(both.exit_code, 0) << both.stderr_text;
    EXPECT_EQ(nlohmann::json::parse(both.output)["model"]["swiglu"].get<bool>(), swiglu) << flags;
  }
}

TEST(Estimate, GroupedQueryAttentionCountsMegatronsParameters) {
  // Llama 3 8B's shape (grouped-query attention with 8 key/value groups of the 32 heads). The
  // expected values are Megatron-LM's own compute_weight_and_optimizer_memory
  // (megatron/training/theoretical_memory_usage.py, run on these args with t = p = d = 1):
  // 8,030,261,248 parameters (Meta's published 8.03B) and 144,544,702,464 bytes at 18 B/param.
  const auto r = actmem::testing::run_actmem(
      "estimate --json --num-layers 32 --hidden-size 4096 --num-attention-heads 32 "
      "--group-query-attention --num-query-groups 8 --ffn-hidden-size 14336 --seq-length 8192 "
      "--micro-batch-size 1 --vocab-size 128256 --swiglu --untie-embeddings-and-output-weights "
      "--normalization RMSNorm --disable-bias-linear --use-rotary-position-embeddings");
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["model"]["num_query_groups"].get<double>(), 8);
  EXPECT_DOUBLE_EQ(j["weights_and_optimizer"]["parameters"].get<double>(), 8030261248.0);
  EXPECT_DOUBLE_EQ(j["weights_and_optimizer"]["total_bytes"].get<double>(), 144544702464.0);
  // The groups must divide the heads, and --num-query-groups needs the switch.
  const auto bad =
      actmem::testing::run_actmem("estimate --group-query-attention --num-query-groups 6");
  EXPECT_NE(bad.stderr_text.find("num_query_groups (6) must divide num_attention_heads (32)"),
            std::string::npos)
      << bad.stderr_text;
  const auto unswitched = actmem::testing::run_actmem("estimate --num-query-groups 8");
  EXPECT_NE(unswitched.stderr_text.find("--num-query-groups needs --group-query-attention"),
            std::string::npos)
      << unswitched.stderr_text;
}

TEST(Estimate, OpenModelPresetsCountMegatronsParameters) {
  // Expected values from Megatron-LM's compute_weight_and_optimizer_memory
  // (megatron/training/theoretical_memory_usage.py) run on each model's arguments: Llama 3 70B
  // 70,553,706,496 parameters (Meta: 70.6B); Mixtral 8x7B 46,702,792,704 (Mistral: 46.7B, 12.9B
  // active), at one rank 18 bytes each.
  auto run = [](const std::string& flags) {
    const auto r = actmem::testing::run_actmem("estimate --json " + flags);
    EXPECT_EQ(r.exit_code, 0) << flags << "\n" << r.stderr_text;
    return nlohmann::json::parse(r.output)["weights_and_optimizer"];
  };
  const auto llama = run("--preset llama3-70b");
  EXPECT_DOUBLE_EQ(llama["parameters"].get<double>(), 70553706496.0);
  EXPECT_DOUBLE_EQ(llama["total_bytes"].get<double>(), 18 * 70553706496.0);
  const auto mixtral = run("--preset mixtral-8x7b");
  EXPECT_DOUBLE_EQ(mixtral["parameters"].get<double>(), 46702792704.0);
  EXPECT_DOUBLE_EQ(mixtral["total_bytes"].get<double>(), 840650268672.0);
  EXPECT_NEAR(mixtral["active_parameters"].get<double>() / 1e9, 12.88, 0.005);
  // On the t 8, p 4 layout Megatron's most loaded shard holds 2,270,758,912 parameters (the
  // norms replicated on every tensor-parallel rank, in both).
  const auto split =
      run("--preset llama3-70b --tensor-model-parallel-size 8 --sequence-parallel "
          "--pipeline-model-parallel-size 4");
  EXPECT_DOUBLE_EQ(split["parameters_on_rank"].get<double>(), 2270758912.0);
  const auto deepseek = run("--preset deepseek-v3");
  EXPECT_NEAR(deepseek["parameters"].get<double>() / 1e9, 671.0, 0.5);
}

TEST(Estimate, FlashReplacesTheSquaredTermByTheLogsumexp) {
  // Llama 3 8B trains without dropout, so auto estimates it with the flash kernel: per layer
  // sbh(34 + 4a/h) instead of the paper's sbh(34 + 5as/h) (docs/memory-model.md, "Attention
  // backends"); s 8192, b 1, h 4096, a 32. Selective and full are the paper's either way.
  auto run = [](const std::string& flags) {
    const auto r = actmem::testing::run_actmem("estimate --json --preset llama3-8b " + flags);
    EXPECT_EQ(r.exit_code, 0) << flags << "\n" << r.stderr_text;
    return nlohmann::json::parse(r.output);
  };
  const double sbh = 8192.0 * 4096.0;
  const auto flash = run("");
  EXPECT_EQ(flash["model"]["attention_kernel"], "flash");
  EXPECT_DOUBLE_EQ(flash["per_layer_bytes"]["none"].get<double>(), sbh * (34.0 + 4.0 * 32 / 4096));
  EXPECT_DOUBLE_EQ(flash["per_layer_bytes"]["selective"].get<double>(),
                   sbh * (18.0 + 4.0 * 14336 / 4096));
  const auto unfused = run("--attention-backend unfused");
  EXPECT_EQ(unfused["model"]["attention_kernel"], "unfused");
  EXPECT_DOUBLE_EQ(unfused["per_layer_bytes"]["none"].get<double>(),
                   sbh * (34.0 + 5.0 * 32 * 8192 / 4096));
  EXPECT_DOUBLE_EQ(unfused["per_layer_bytes"]["selective"].get<double>(),
                   flash["per_layer_bytes"]["selective"].get<double>());
  // With dropout back on, auto cannot run flash (the CPU kernel has no attention dropout).
  EXPECT_EQ(run("--attention-dropout 0.1")["model"]["attention_kernel"], "unfused");
}

TEST(Estimate, PresetInterleavingFollowsTheFlags) {
  // 175b: 96 layers, p = 8, 3 chunks per stage. --num-virtual-stages-per-pipeline-rank 1 turns
  // interleaving off (Megatron: one virtual stage is none); a layer count whose stages no longer
  // divide by the preset's 3 chunks is refused as Megatron's TransformerConfig refuses it; the
  // other spelling (layers per virtual stage) replaces the preset's chunk count.
  auto run = [](const std::string& flags) {
    return actmem::testing::run_actmem("estimate --json --preset 175b " + flags);
  };
  const auto inter = run("");
  ASSERT_EQ(inter.exit_code, 0) << inter.stderr_text;
  EXPECT_EQ(nlohmann::json::parse(inter.output)["schedule"], "interleaved 1F1B");
  const auto off = run("--num-virtual-stages-per-pipeline-rank 1");
  ASSERT_EQ(off.exit_code, 0) << off.stderr_text;
  const auto j = nlohmann::json::parse(off.output);
  EXPECT_EQ(j["schedule"], "1F1B");
  EXPECT_TRUE(j["virtual_pipeline_size"].is_null());
  // 1F1B: the first stage holds p = 8 micro-batches.
  EXPECT_DOUBLE_EQ(j["per_pipeline_stage"][0]["microbatches_in_flight"].get<double>(), 8.0);
  const auto one_per_stage = run("--num-layers-per-virtual-pipeline-stage 12");  // 12 per stage
  ASSERT_EQ(one_per_stage.exit_code, 0) << one_per_stage.stderr_text;
  EXPECT_EQ(nlohmann::json::parse(one_per_stage.output)["schedule"], "1F1B");
  const auto uneven = run("--num-layers 64");  // 8 layers per stage, 3 chunks
  EXPECT_NE(uneven.exit_code, 0);
  EXPECT_NE(uneven.stderr_text.find("the 8 layers of a pipeline stage cannot be split into 3 "
                                    "virtual stages"),
            std::string::npos)
      << uneven.stderr_text;
  EXPECT_EQ(run("--num-layers 64 --num-virtual-stages-per-pipeline-rank 2").exit_code, 0);
  // The interleaved count prints as a number (31/3 micro-batches), not 1e+01.
  const auto text = actmem::testing::run_actmem("estimate --preset 175b");
  EXPECT_NE(text.output.find("holds 10.33 micro-batches in flight"), std::string::npos)
      << text.output;
  EXPECT_EQ(text.output.find("e+01"), std::string::npos) << text.output;
}

TEST(Estimate, TheFormulaColumnNamesWhatWasComputed) {
  // Without SP and t > 1 (eq. 2), the norms and dropouts are replicated: the selective row is
  // sbh(10 + (8 + 4 ffn/h)/t), and the printed formula says so.
  const auto r = actmem::testing::run_actmem("estimate --no-sequence-parallel");
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  EXPECT_NE(r.output.find("sbh(10 + (8 + 4 ffn/h)/t)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("sbh(10 + 24/t + 5as/ht)"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("sbh(18 + 4 ffn/h)"), std::string::npos) << r.output;
  const auto sp = actmem::testing::run_actmem("estimate");
  EXPECT_NE(sp.output.find("sbh(18 + 4 ffn/h)/t"), std::string::npos) << sp.output;
  EXPECT_NE(sp.output.find("2sbh/t"), std::string::npos) << sp.output;
}

TEST(Inspect, LedgerAccountsForTheMeasuredBytesAndMatchesThePaperPerModule) {
  const auto r = actmem::testing::run_actmem(
      "inspect --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
      "--micro-batch-size 2 --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output.substr(0, r.output.rfind('}') + 1));
  // The plain step holds exactly what autograd saved, plus the 4-byte loss value.
  EXPECT_EQ(j["activation_bytes"].get<int64_t>(), j["ledger_bytes"].get<int64_t>() + 4);
  EXPECT_EQ(j["predicted_bytes"].get<int64_t>(), j["activation_bytes"].get<int64_t>());
  int with_paper = 0;
  for (const auto& m : j["modules"]) {
    if (!m.contains("korthikanti_bytes")) continue;
    ++with_paper;
    const auto name = m["module"].get<std::string>();
    const double paper = m["korthikanti_bytes"].get<double>(), bytes = m["bytes"].get<double>();
    if (name.find("layernorm") != std::string::npos) {
      EXPECT_EQ(bytes, paper + 2 * 16 * 2 * 4) << name;  // plus LayerNorm's mean and rstd [s, b, 1]
    } else {
      EXPECT_EQ(bytes, paper) << name;  // fp32 = the paper's 16-bit terms doubled, 1-byte masks
    }
  }
  EXPECT_EQ(with_paper, 2 * 10);
}

// ---- the plot ---------------------------------------------------------------------------------

TEST(Compare, WritesAValidSvgWithPeaksInOrder) {
  const std::string dir = ::testing::TempDir();
  const auto r = actmem::testing::run_actmem(
      "compare --num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 64 "
      "--micro-batch-size 2 --iters 2 --strategies plain selective-core_attn full-uniform-1 "
      "--svg " +
      dir + "cmp.svg --json " + dir + "cmp.json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // A real XML parser (Python's, installed with libtorch-dev) must accept the file.
  const std::string check =
      "python3 -c \"import sys,xml.etree.ElementTree as E; t=E.parse(sys.argv[1]); "
      "ns='{http://www.w3.org/2000/svg}'; "
      "print(' '.join(g.get('data-name')+'='+g.get('data-peak-bytes') for g in t.iter(ns+'g') "
      "if g.get('class')=='series'))\" " +
      dir + "cmp.svg";
  FILE* pipe = popen(check.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  char buf[1024] = {0};
  const size_t n = fread(buf, 1, sizeof(buf) - 1, pipe);
  ASSERT_EQ(pclose(pipe), 0) << "the SVG is not well-formed XML";
  const std::string series(buf, n);
  std::map<std::string, int64_t> peak;
  std::stringstream ss(series);
  std::string item;
  while (ss >> item)
    peak[item.substr(0, item.find('='))] = std::stoll(item.substr(item.find('=') + 1));
  ASSERT_EQ(peak.size(), 3u) << series;
  EXPECT_GT(peak["plain"], peak["selective-core_attn"]);
  EXPECT_GT(peak["selective-core_attn"], peak["full-uniform-1"]);
  // And the same order as the measured table.
  std::ifstream jf(dir + "cmp.json");
  const auto j = nlohmann::json::parse(jf);
  for (const auto& s : j["strategies"]) {
    EXPECT_EQ(s["activation_peak_bytes"].get<int64_t>(), peak[s["name"].get<std::string>()]);
    EXPECT_TRUE(s["bitwise_equal_to_plain"].get<bool>());
  }
}

TEST(Compare, RejectsUnknownStrategies) {
  const auto r = actmem::testing::run_actmem("compare --strategies plain full-diagonal-2 --svg ''");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.stderr_text.find("'full-diagonal-2' in strategy 'full-diagonal-2': full recompute "
                               "is full-uniform-N or full-block-N"),
            std::string::npos)
      << r.stderr_text;
  // An unknown module is named, with the modules there are (from activation_plan.h's table).
  const auto m =
      actmem::testing::run_actmem("compare --strategies selective-core_attn+attn --svg ''");
  EXPECT_NE(m.exit_code, 0);
  EXPECT_NE(m.stderr_text.find("unknown recompute module 'attn'"), std::string::npos)
      << m.stderr_text;
  EXPECT_NE(m.stderr_text.find(actmem::recompute_module_list(", ")), std::string::npos)
      << m.stderr_text;
  // A well-formed strategy the model cannot run is named as such, with the config's reason.
  const auto big = actmem::testing::run_actmem(
      "compare --num-layers 2 --strategies plain full-block-5 --svg ''");
  EXPECT_NE(big.exit_code, 0);
  EXPECT_NE(big.stderr_text.find("strategy 'full-block-5' cannot run: "), std::string::npos)
      << big.stderr_text;
  // The default set runs on a one-layer model (its block recompute takes the one layer).
  const auto one = actmem::testing::run_actmem(
      "compare --num-layers 1 --hidden-size 32 --seq-length 16 --warmup 0 --iters 1 --svg ''");
  EXPECT_EQ(one.exit_code, 0) << one.output;
  EXPECT_NE(one.output.find("full-block-1"), std::string::npos) << one.output;
}

}  // namespace
}  // namespace actmem
