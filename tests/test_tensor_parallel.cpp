// test_tensor_parallel.cpp — tensor and sequence parallelism across real processes: each test
// launches ranks of this test binary (Gloo over loopback, run_workers) and compares what they
// wrote. TP = 2 against TP = 1 without dropout, every recompute and offload strategy bitwise
// against the TP = 2 plain run with dropout, dropout masks across ranks, and per-rank memory
// against the predictor.
#include <ATen/ATen.h>
#include "actmem/base/digest.h"
#include "actmem/parallel/distributed.h"
#include "actmem/parallel/tensor_parallel.h"
#include "actmem/recompute/rng.h"
#include "actmem/recompute/saved_tensor_hooks.h"
#include "actmem/train/trainer.h"
#include "fixtures.h"
#include "parallel_workers.h"
#include "rank_models.h"
#include "test_util.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace actmem {
namespace {

using actmem::testing::expect_error_containing;
using actmem::testing::run_workers;
using nlohmann::json;

// The ranks these tests start (Note [Ranks are the test binary] in parallel_workers.cpp).
using testing::base_config;
using testing::MaskCollector;
using testing::param_digest;
using testing::strategies;

nlohmann::json run_strategies(int t, bool sp, bool dropout, const std::string& only,
                              const std::string& variant) {
  nlohmann::json out;
  for (const auto& [name, mutate] : strategies(sp, variant.rfind("mla", 0) == 0)) {
    if (!only.empty() && name != only) continue;
    TransformerConfig c = base_config(t, sp, dropout, variant);
    mutate(c);
    actmem::TrainingConfig tc;
    if (c.fp16) tc.initial_loss_scale = actmem::testing::kFp16TestLossScale;
    tc.global_batch_size = 2 * c.micro_batch_size;  // two micro-batches per step
    tc.train_iters = 3;
    tc.eval_interval = 0;
    actmem::Trainer trainer(c, tc);
    nlohmann::json r;
    for (int i = 0; i < 3; ++i) {
      const actmem::IterationStats st = trainer.train_step(true);
      r["loss"].push_back(st.loss);
      r["grad_norm"].push_back(st.grad_norm);
      r["grad_digest"].push_back(st.grad_digest);
      r["activation_bytes"].push_back(st.activation_bytes);
      r["predicted_activation_bytes"] = st.predicted_activation_bytes;
    }
    r["param_digest"] = param_digest(trainer.model());
    // The parameters every tensor-parallel rank holds whole: equal on every rank unless a
    // partial gradient went unreduced (GatedDeltaNet's out_norm without sequence parallelism).
    actmem::Digest replicated;
    const auto attributes = trainer.model().parameter_attributes();
    const auto params = trainer.model().ordered_parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      if (!attributes[i].tensor_parallel) replicated.update(params[i]);
    }
    r["replicated_digest"] = replicated.hex();
    out[name] = r;
  }
  return out;
}

nlohmann::json run_masks(int t, bool sp) {
  TransformerConfig c = base_config(t, sp, /*dropout=*/true);
  c.num_layers = 2;
  actmem::TrainingConfig tc;
  tc.eval_interval = 0;
  actmem::Trainer trainer(c, tc);
  MaskCollector collector;
  {
    actmem::SavedTensorHooksGuard guard(collector);
    trainer.train_step(false);
  }
  // The attention mask buffer is a parameter-like constant, not a dropout mask.
  nlohmann::json out = nlohmann::json::array();
  for (const auto& [module, mask] : collector.masks) {
    if (mask.sizes() == trainer.model().attention_mask().sizes()) continue;
    const at::Tensor all = actmem::all_gather_dim0(mask.to(at::kByte).unsqueeze(0));
    bool same = true;
    for (int64_t r = 1; r < all.size(0); ++r) same = same && at::equal(all[0], all[r]);
    out.push_back({{"module", module},
                   {"shape", mask.sizes().vec()},
                   {"same_on_all_ranks", same},
                   {"dropped_fraction", 1.0 - mask.to(at::kDouble).mean().item<double>()}});
  }
  return out;
}

// --rank strategies DIR [--sp] [--no-dropout] [--only NAME] [--variant V]: t = every rank.
ACTMEM_RANK_SCENARIO(strategies, [](const testing::RankOptions& o, const TensorParallelGroup& g) {
  return run_strategies(g.size, o.sp, o.dropout, o.only, o.variant);
});

// --rank masks DIR [--sp]: every dropout mask of one forward, compared over the ranks.
ACTMEM_RANK_SCENARIO(masks, [](const testing::RankOptions& o, const TensorParallelGroup& g) {
  return run_masks(g.size, o.sp);
});

using actmem::testing::rel;

// Both model variants: LayerNorm/GeLU/learned positions/tied output/biases, and
// RMSNorm/SwiGLU (its [gate; up] split per rank)/RoPE/untied output/no biases.
class TwoRanksMatchOneRank : public ::testing::TestWithParam<std::string> {};

TEST_P(TwoRanksMatchOneRank, WithoutDropoutWithAndWithoutSequenceParallel) {
  const std::string variant = GetParam();
  const auto one =
      run_workers(1, {"strategies", "--no-dropout", "--only", "plain", "--variant", variant});
  ASSERT_EQ(one.size(), 1u);
  for (const bool sp : {false, true}) {
    std::vector<std::string> args = {"strategies", "--no-dropout", "--only",
                                     "plain",      "--variant",    variant};
    if (sp) args.push_back("--sp");
    const auto two = run_workers(2, args);
    ASSERT_EQ(two.size(), 2u);
    const json& ref = one[0]["strategies"]["plain"];
    // Replicated parameters stay bitwise equal across the ranks.
    EXPECT_EQ(two[0]["strategies"]["plain"]["replicated_digest"],
              two[1]["strategies"]["plain"]["replicated_digest"])
        << "sp " << sp;
    for (const auto& rank : two) {
      const json& got = rank["strategies"]["plain"];
      for (int i = 0; i < 3; ++i) {
        // Losses after two optimizer steps reflect the parameters the gradients produced.
        EXPECT_LT(rel(got["loss"][i], ref["loss"][i]), 1e-5) << "sp " << sp << " step " << i;
        EXPECT_LT(rel(got["grad_norm"][i], ref["grad_norm"][i]), 1e-5) << "sp " << sp;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, TwoRanksMatchOneRank,
                         // Without dropout auto runs the flash kernel ("base", "swiglu",
                         // "gqa"); "unfused" asks for the unfused path.
                         ::testing::Values("base", "unfused", "swiglu", "gqa", "mla",
                                           "mla_no_q_lora", "gdn", "gated"));

void expect_strategies_bitwise_equal_to_plain(bool sp, const std::string& variant = "base") {
  std::vector<std::string> args = {"strategies", "--variant", variant};
  if (sp) args.push_back("--sp");
  const auto ranks = run_workers(2, args);
  ASSERT_EQ(ranks.size(), 2u);
  for (const auto& rank : ranks) {
    const json& all = rank["strategies"];
    const json& plain = all["plain"];
    ASSERT_GE(all.size(), sp ? 10u : 12u);
    for (const auto& [name, got] : all.items()) {
      if (name == "plain") continue;
      for (int i = 0; i < 3; ++i) {
        EXPECT_EQ(got["loss"][i], plain["loss"][i]) << name << " rank " << rank["rank"];
        EXPECT_EQ(got["grad_digest"][i], plain["grad_digest"][i]) << name << " step " << i;
        EXPECT_EQ(got["grad_norm"][i], plain["grad_norm"][i]) << name;
      }
      EXPECT_EQ(got["param_digest"], plain["param_digest"]) << name;
    }
    // The predictor is exact per rank for what each strategy saves (offload moves part of it).
    for (const auto& [name, got] : all.items()) {
      if (name.rfind("offload", 0) == 0) continue;
      EXPECT_EQ(got["predicted_activation_bytes"], got["activation_bytes"][0])
          << variant << " " << name << " rank " << rank["rank"];
    }
  }
  // The ranks hold different slices: their gradients differ, their losses agree.
  EXPECT_NE(ranks[0]["strategies"]["plain"]["grad_digest"][0],
            ranks[1]["strategies"]["plain"]["grad_digest"][0]);
  EXPECT_EQ(ranks[0]["strategies"]["plain"]["loss"], ranks[1]["strategies"]["plain"]["loss"]);
}

TEST(TensorParallel, EveryStrategyBitwiseEqualsPlainWithDropout) {
  expect_strategies_bitwise_equal_to_plain(false);
}

TEST(TensorParallel, EveryStrategyBitwiseEqualsPlainWithSequenceParallelAndDropout) {
  expect_strategies_bitwise_equal_to_plain(true);
}

TEST(TensorParallel, EveryStrategyBitwiseEqualsPlainRmsSwigluRopeUntiedNoBias) {
  expect_strategies_bitwise_equal_to_plain(true, "swiglu");
}

// Grouped-query attention: each rank holds one of the 2 key/value groups and its 2 query heads.
TEST(TensorParallel, EveryStrategyBitwiseEqualsPlainWithGroupedQueryAttention) {
  expect_strategies_bitwise_equal_to_plain(true, "gqa");
}

// Multi-latent attention: each rank holds 2 of the 4 heads; the latents are replicated.
TEST(TensorParallel, EveryStrategyBitwiseEqualsPlainWithMultiLatentAttention) {
  expect_strategies_bitwise_equal_to_plain(true, "mla");
  expect_strategies_bitwise_equal_to_plain(false, "mla_no_q_lora");
}

// Qwen3-Next's attention (wider heads, q/k norms, output gate, partial RoPE, zero-centred norms):
// each rank holds one group, its 2 query heads and their gates; the strategies' predicted bytes
// per rank equal the measured ones.
TEST(TensorParallel, EveryStrategyBitwiseEqualsPlainWithGatedAttention) {
  expect_strategies_bitwise_equal_to_plain(false, "gated");
}

// The flash kernel under TP + SP with grouped-query attention (hidden dropout on).
TEST(TensorParallel, EveryStrategyBitwiseEqualsPlainWithFlashAttention) {
  expect_strategies_bitwise_equal_to_plain(true, "flash_gqa");
}

// bf16 parameters and activations: the collectives carry bf16 (Note [16-bit collectives]), the
// sequence-parallel gradients are reduced in the fp32 main grads.
TEST(TensorParallel, EveryStrategyBitwiseEqualsPlainAtBf16WithSequenceParallel) {
  expect_strategies_bitwise_equal_to_plain(true, "bf16");
}

// Without sequence parallelism the sweep adds distribute_saved_activations (1/t bf16 shards of
// the checkpoint inputs, gathered in backward).
TEST(TensorParallel, EveryStrategyBitwiseEqualsPlainAtBf16) {
  expect_strategies_bitwise_equal_to_plain(false, "bf16");
}

// fp16 at a loss scale the gradients fit: the collectives carry float16 natively.
TEST(TensorParallel, EveryStrategyBitwiseEqualsPlainAtFp16WithSequenceParallel) {
  expect_strategies_bitwise_equal_to_plain(true, "fp16");
}

// Masks in the tensor-parallel region (attention dropout, model-parallel stream) differ across
// ranks; masks on replicated data (embedding and bias-dropout-add, default stream) agree. With
// sequence parallelism each rank drops its own tokens from the model-parallel stream.
TEST(TensorParallel, DropoutMasksFollowTheRegion) {
  for (const bool sp : {false, true}) {
    std::vector<std::string> args = {"masks"};
    if (sp) args.push_back("--sp");
    const auto ranks = run_workers(2, args);
    ASSERT_EQ(ranks.size(), 2u);
    int attention = 0, hidden = 0;
    for (const auto& m : ranks[0]["masks"]) {
      const std::string module = m["module"];
      const bool same = m["same_on_all_ranks"];
      const double dropped = m["dropped_fraction"];
      EXPECT_GT(dropped, 0.05) << module;  // a real dropout mask (p = 0.1)
      EXPECT_LT(dropped, 0.15) << module;
      if (module.find("core_attention") != std::string::npos) {
        ++attention;
        EXPECT_FALSE(same) << "sp " << sp << ": " << module;
      } else {
        ++hidden;
        EXPECT_EQ(same, !sp) << "sp " << sp << ": " << module;
      }
    }
    EXPECT_EQ(attention, 2);   // one per layer
    EXPECT_EQ(hidden, 1 + 4);  // embedding + two bias-dropout-adds per layer
  }
}

// Per-rank activation bytes: the predictor is exact on every rank, and the measured drops from
// TP = 1 to TP = 2, to sequence parallelism and to distributed checkpoint inputs are the
// predicted ones.
TEST(TensorParallel, PerRankActivationMemoryMatchesThePredictor) {
  const auto one = run_workers(1, {"strategies", "--only", "plain"});
  const auto two = run_workers(2, {"strategies"});
  const auto sp = run_workers(2, {"strategies", "--sp"});
  ASSERT_TRUE(one.size() == 1 && two.size() == 2 && sp.size() == 2);
  auto measured = [](const json& rank, const char* name) {
    return rank["strategies"][name]["activation_bytes"][0].get<double>();
  };
  auto predicted = [](const json& rank, const char* name) {
    return rank["strategies"][name]["predicted_activation_bytes"].get<double>();
  };
  for (const auto* runs : {&two, &sp}) {
    for (const auto& rank : *runs) {
      for (const auto& [name, r] : rank["strategies"].items()) {
        // The predictor counts what is saved; offload moves part of it to host memory.
        if (name.rfind("offload", 0) == 0) continue;
        const double m = r["activation_bytes"][0], p = r["predicted_activation_bytes"];
        EXPECT_EQ(p, m) << name;
      }
    }
  }
  const double t1 = measured(one[0], "plain"), t2 = measured(two[0], "plain");
  const double t2sp = measured(sp[0], "plain");
  EXPECT_LT(rel(t2 / t1, predicted(two[0], "plain") / predicted(one[0], "plain")), 0.03);
  EXPECT_LT(rel(t2sp / t2, predicted(sp[0], "plain") / predicted(two[0], "plain")), 0.03);
  EXPECT_LT(t2, 0.75 * t1);
  EXPECT_LT(t2sp, 0.9 * t2);
  // distribute_saved_activations keeps each checkpoint input as a half: 4 inputs of sbh floats.
  const double sbh4 = 32.0 * 4 * 64 * 4;
  EXPECT_DOUBLE_EQ(measured(two[0], "full_uniform_1") - measured(two[0], "distribute_uniform_1"),
                   4 * sbh4 / 2);
  EXPECT_DOUBLE_EQ(measured(two[1], "full_block_2") - measured(two[1], "distribute_block_2"),
                   2 * sbh4 / 2);
}

// `actmem inspect` under launch: rank 0's ledger per module against Korthikanti Table 2's terms
// (tensor-parallel region divided by t; the replicated rest only with sequence parallelism).
TEST(TensorParallel, InspectMatchesTableTwoPerModule) {
  for (const bool sp : {false, true}) {
    const auto r = actmem::testing::run_actmem(
        std::string("launch --nproc-per-node 2 -- inspect --tensor-model-parallel-size 2 ") +
        (sp ? "--sequence-parallel " : "") +
        "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --threads 1 --json");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto j = json::parse(r.output.substr(0, r.output.rfind('}') + 1));
    EXPECT_EQ(j["predicted_bytes"].get<int64_t>(), j["activation_bytes"].get<int64_t>());
    int with_paper = 0;
    const double stats = 2.0 * (sp ? 8 : 16) * 2 * 4;  // LayerNorm mean and rstd, [s(/t), b, 1]
    for (const auto& m : j["modules"]) {
      if (!m.contains("korthikanti_bytes")) continue;
      ++with_paper;
      const auto name = m["module"].get<std::string>();
      const double paper = m["korthikanti_bytes"].get<double>(), bytes = m["bytes"].get<double>();
      EXPECT_EQ(bytes, paper + (name.find("layernorm") != std::string::npos ? stats : 0.0))
          << "sp " << sp << ": " << name;
    }
    EXPECT_EQ(with_paper, 2 * 10);
  }
}

// A Trainer keeps its named streams in its own tracker: the process-wide tracker (states, seeds)
// is the same after a step, and a step inside someone else's fork is refused.
TEST(TensorParallel, TrainerLeavesTheProcessTrackerAsItWas) {
  model_parallel_manual_seed(77);
  const auto before = get_rng_tracker().get_states();
  TransformerConfig c;
  c.num_layers = 1;
  c.hidden_size = 32;
  c.num_attention_heads = 2;
  c.seq_length = 16;
  c.micro_batch_size = 2;
  TrainingConfig t;
  t.eval_interval = 0;
  Trainer trainer(c, t);
  trainer.train_step(false);
  const auto after = get_rng_tracker().get_states();
  ASSERT_EQ(after.size(), before.size());
  for (const auto& [name, state] : before) {
    EXPECT_TRUE(actmem::testing::bitwise_equal(after.at(name), state)) << name;
  }
  expect_error_containing([&] { get_rng_tracker().add("another", 77); }, "seed 77 already exists");
  {
    auto fork = get_rng_tracker().fork(kModelParallelRng);
    expect_error_containing([&] { trainer.train_step(false); },
                            "called inside an RNG fork ('model-parallel-rng')");
  }
  get_rng_tracker().reset();
}

TEST(TensorParallel, SingleProcessRefusesTensorParallelSize) {
  TransformerConfig c;
  c.tensor_model_parallel_size = 2;
  TrainingConfig t;
  expect_error_containing([&] { Trainer trainer(c, t); },
                          "tensor_model_parallel_size is 2 but this process is in a "
                          "tensor-parallel group of 1 (run it under `actmem launch "
                          "--nproc-per-node 2`)");
}

TEST(TensorParallel, SingleRankMappingsAreIdentity) {
  ASSERT_EQ(tensor_parallel_group().size, 1);
  const at::Tensor x = at::randn({4, 2, 3});
  for (const auto& y :
       {copy_to_tensor_parallel_region(x), reduce_from_tensor_parallel_region(x),
        scatter_to_sequence_parallel_region(x), gather_from_sequence_parallel_region(x),
        reduce_scatter_to_sequence_parallel_region(x)}) {
    EXPECT_TRUE(y.is_same(x));  // the very tensor: a single process builds its old graph
  }
  EXPECT_TRUE(actmem::testing::bitwise_equal(
      gather_split_1d_tensor(split_tensor_into_1d_equal_chunks(x)), x.reshape({-1})));
}

TEST(TensorParallel, TrainUnderLaunchLogsEveryRanksMemory) {
  const std::string log = ::testing::TempDir() + "tp_train.jsonl";
  const auto r = actmem::testing::run_actmem(
      "launch --nproc-per-node 2 -- train --tensor-model-parallel-size 2 --sequence-parallel "
      "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
      "--micro-batch-size 2 --train-iters 2 --eval-interval 2 --threads 1 --log-json " +
      log);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("tensor parallel 2 ranks with sequence parallelism"), std::string::npos)
      << r.output;
  const auto parsed = actmem::testing::read_json_log(log);
  EXPECT_EQ(parsed.config["runtime"]["world_size"], 2);
  EXPECT_EQ(parsed.config["model"]["tensor_model_parallel_size"], 2);
  int lines = 0;
  for (const json& j : parsed.iterations) {
    ++lines;
    // Both ranks' activations, gathered in rank order: each within 3% of the predictor (exact
    // on libtorch 1.13), and rank 0's entry is the line's own activation_bytes.
    ASSERT_EQ(j["activation_bytes_per_rank"].size(), 2u);
    EXPECT_EQ(j["activation_bytes_per_rank"][0], j["activation_bytes"]);
    for (const auto& bytes : j["activation_bytes_per_rank"]) {
      EXPECT_LT(rel(bytes.get<double>(), j["predicted_activation_bytes"].get<double>()), 0.03);
    }
    ASSERT_EQ(j["peak_device_bytes_per_rank"].size(), 2u);
    // Each rank holds its own slices of the split weights, so the gradient digests differ.
    ASSERT_EQ(j["grad_digest_per_rank"].size(), 2u);
    EXPECT_EQ(j["grad_digest_per_rank"][0], j["grad_digest"]);
    EXPECT_NE(j["grad_digest_per_rank"][0], j["grad_digest_per_rank"][1]);
  }
  EXPECT_EQ(lines, 2);
}

// ---- expert parallelism's token exchange
// ---------------------------------------------------------

}  // namespace
}  // namespace actmem
