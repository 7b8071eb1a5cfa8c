// test_expert_parallel.cpp — expert parallelism (and expert x tensor parallelism) across real
// processes: the all-to-all dispatch, training against one process, every strategy bitwise
// against the plain run with the predictor exact per rank, expert dropout across ranks, and the
// launch rules.
#include "actmem/parallel/distributed.h"
#include "actmem/parallel/tensor_parallel.h"
#include "actmem/recompute/rng.h"
#include "actmem/train/trainer.h"
#include "parallel_workers.h"
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
using actmem::testing::rel;
using actmem::testing::run_workers;
using nlohmann::json;

TEST(ExpertParallel, AllToAllDispatchDeliversEveryRowToItsExpertAndBack) {
  // Note [All-to-all dispatch]: two and three ranks, each with its own number of tokens routed to
  // two of 2 x ranks experts (uneven splits); every rank checks the rows its experts received,
  // the combined output and both gradients against its own recomputation from the seeds.
  for (int nproc : {2, 3}) {
    const auto ranks = run_workers(nproc, {"dispatch"});
    ASSERT_EQ(ranks.size(), static_cast<size_t>(nproc));
    int64_t sent = 0, received = 0;
    for (const auto& r : ranks) {
      sent += r["dispatch"]["rows_sent"].get<int64_t>();
      received += r["dispatch"]["rows_received"].get<int64_t>();
    }
    EXPECT_EQ(sent, received) << nproc << " ranks";  // no row lost or duplicated
  }
}

// ---- expert-parallel training
// ------------------------------------------------------------------------

// The steps of strategy `name` in an experts-scenario result.
const json& expert_steps(const json& rank, const std::string& name) {
  return rank["experts"]["strategies"][name]["steps"];
}

// Every strategy of an experts-scenario rank against its plain run: bitwise losses, gradient
// digests and final parameters over the three steps, and (without offload) the predictor equal to
// the measured activation bytes.
void expect_strategies_bitwise_and_predicted(const json& rank, const std::string& label) {
  const json& all = rank["experts"]["strategies"];
  const json& plain = all["plain"];
  ASSERT_EQ(all.size(), 8u);
  for (const auto& [name, run] : all.items()) {
    const std::string what = label + " " + name + " rank " + rank["rank"].dump();
    EXPECT_EQ(run["param_digest"], plain["param_digest"]) << what;
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(run["steps"][i]["loss"], plain["steps"][i]["loss"]) << what << " step " << i;
      EXPECT_EQ(run["steps"][i]["grad_digest"], plain["steps"][i]["grad_digest"])
          << what << " step " << i;
      if (name.rfind("offload", 0) != 0) {
        EXPECT_EQ(run["steps"][i]["activation_bytes"],
                  run["steps"][i]["predicted_activation_bytes"])
            << what << " step " << i;
      }
    }
  }
}

// Steps of an experts-scenario rank against a one-process reference: loss, gradient norm and the
// logged auxiliary losses within 1e-5 relative at every step.
void expect_steps_within_tolerance(const json& steps, const json& ref, const std::string& what) {
  ASSERT_EQ(steps.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_LT(rel(steps[i]["loss"].get<double>(), ref[i]["loss"].get<double>()), 1e-5)
        << what << " step " << i;
    EXPECT_LT(rel(steps[i]["grad_norm"].get<double>(), ref[i]["grad_norm"].get<double>()), 1e-5)
        << what << " step " << i;
    for (const char* aux : {"load_balancing_loss", "z_loss"}) {
      EXPECT_LT(rel(steps[i][aux].get<double>(), ref[i][aux].get<double>()), 1e-5)
          << what << " step " << i << " " << aux;
    }
  }
}

TEST(ExpertParallel, TrainsLikeOneProcessWithinTolerance) {
  // Without dropout, e expert-parallel ranks (each a data-parallel rank with its own micro-batch,
  // its experts fed by every rank's tokens) against one process with all experts and the same
  // global batch: losses and gradient norms agree to 1e-5 relative over three steps, for both
  // dispatchers and for expert parallelism 2 x expert-data-parallel 2 (four processes). Not
  // bitwise by construction: an expert's weight gradient sums its rows from all ranks in one
  // product where one process accumulates one product per micro-batch, and the norm sums the
  // experts' squares per rank first. (On this machine the losses come out bitwise equal.)
  struct Case {
    int nproc;
    std::string dispatcher;
    int64_t global_batch;
  };
  std::map<int64_t, json> reference;
  for (const Case& k : {Case{2, "alltoall", 8}, Case{2, "allgather", 8}, Case{4, "alltoall", 16}}) {
    if (!reference.count(k.global_batch)) {
      const auto one =
          run_workers(1, {"experts", "--no-dropout", "--tp", "1", "--ep", "1", "--only", "plain",
                          "--global-batch", std::to_string(k.global_batch)});
      ASSERT_EQ(one.size(), 1u);
      reference[k.global_batch] = one[0];
    }
    const auto ranks = run_workers(
        k.nproc, {"experts", "--no-dropout", "--tp", "1", "--ep", "2", "--only", "plain",
                  "--dispatcher", k.dispatcher, "--global-batch", std::to_string(k.global_batch)});
    ASSERT_EQ(ranks.size(), static_cast<size_t>(k.nproc));
    const json& ref = expert_steps(reference[k.global_batch], "plain");
    for (const auto& r : ranks) {
      const std::string what =
          k.dispatcher + " " + std::to_string(k.nproc) + " ranks, rank " + r["rank"].dump();
      EXPECT_EQ(r["experts"]["ep_size"], 2) << what;
      EXPECT_EQ(r["experts"]["edp_size"], k.nproc / 2) << what;
      // The logged auxiliary losses are averaged over the data-parallel ranks (Megatron's
      // needs_dp_avg), so they are the global batch's.
      expect_steps_within_tolerance(expert_steps(r, "plain"), ref, what);
    }
    // Megatron's order: expert-parallel peers adjacent, expert-data-parallel ranks e apart.
    EXPECT_EQ(ranks[1]["experts"]["ep_rank"], 1);
    if (k.nproc == 4) EXPECT_EQ(ranks[2]["experts"]["ep_rank"], 0);
  }
}

TEST(ExpertParallel, WithDropoutTheLossStaysWithinTheMaskNoise) {
  // With dropout each expert-parallel rank draws its experts' masks from its own stream (and the
  // replicas' dense masks as data parallelism's do): within 1% of one process, not bitwise.
  const auto one = run_workers(
      1, {"experts", "--tp", "1", "--ep", "1", "--only", "plain", "--global-batch", "8"});
  const auto two = run_workers(
      2, {"experts", "--tp", "1", "--ep", "2", "--only", "plain", "--global-batch", "8"});
  ASSERT_EQ(two.size(), 2u);
  for (size_t i = 0; i < 3; ++i) {
    const double a = expert_steps(one[0], "plain")[i]["loss"].get<double>();
    const double b = expert_steps(two[0], "plain")[i]["loss"].get<double>();
    EXPECT_LT(rel(b, a), 0.01) << "step " << i;
    EXPECT_NE(a, b) << "step " << i << ": the expert masks should differ from one process's";
  }
}

TEST(ExpertParallel, EveryStrategyIsBitwiseEqualToThePlainRunAndThePredictorIsExactPerRank) {
  // Under expert parallelism 2 with dropout and expert dropout, every recompute and offload
  // strategy of the MoE layer (including moe, which replays the all-to-alls or all-gathers in
  // backward) trains bitwise like the plain run on each rank; without offload the exact
  // predictor equals each rank's measured activation bytes, given the routing its experts
  // received (dropless and capacity routing; each rank's experts see another number of rows).
  for (const auto& [dispatcher, variant] : std::vector<std::pair<std::string, std::string>>{
           {"alltoall", "base"}, {"allgather", "capacity"}, {"alltoall", "padded"}}) {
    const auto ranks = run_workers(2, {"experts", "--tp", "1", "--ep", "2", "--global-batch", "8",
                                       "--dispatcher", dispatcher, "--variant", variant});
    ASSERT_EQ(ranks.size(), 2u);
    std::set<int64_t> rank_bytes;
    for (const auto& r : ranks) {
      expect_strategies_bitwise_and_predicted(r, dispatcher + "/" + variant);
      const json& plain = r["experts"]["strategies"]["plain"];
      rank_bytes.insert(plain["steps"][0]["activation_bytes"].get<int64_t>());
      if (variant != "base") EXPECT_GT(plain["steps"][0]["dropped"].get<int64_t>(), 0) << variant;
    }
    // Dropless and unpadded, the ranks' experts computed different numbers of rows.
    if (variant != "padded") EXPECT_EQ(rank_bytes.size(), 2u) << dispatcher << "/" << variant;
  }
}

TEST(ExpertTensorParallel, TrainsLikeOneProcessWithinTolerance) {
  // MoE under tensor parallelism 2 (with sequence parallelism, as Megatron requires): each
  // tensor rank routes its s/t tokens, holds its half of every expert's columns, and the
  // dispatchers gather the tensor ranks' rows (all-gather over t x e; all-to-all then an uneven
  // all-gather over t). Without dropout against one process on the same global batch: losses
  // and gradient norms within 1e-5 relative over three steps, for t = 2 alone and t = 2 x e = 2
  // (four processes), both dispatchers. Not bitwise: the experts' products are split over the
  // tensor ranks and summed, and the router's gradient is summed over the sequence shards.
  // SwiGLU experts with biases (one MLP per expert) too: each tensor rank keeps its slice of
  // both gated halves, and fc2's bias is added once (by tensor rank 0). And seq_aux_loss: each
  // sequence's counts summed over the tensor ranks' shards of it.
  std::map<std::string, json> reference;
  struct Case {
    int nproc, ep;
    std::string dispatcher, variant;
  };
  for (const Case& k : {Case{2, 1, "alltoall", "base"}, Case{2, 1, "allgather", "base"},
                        Case{4, 2, "alltoall", "base"}, Case{4, 2, "allgather", "base"},
                        Case{2, 1, "alltoall", "gated_bias"}, Case{2, 1, "alltoall", "seq_aux"}}) {
    if (!reference.count(k.variant)) {
      const auto one =
          run_workers(1, {"experts", "--no-dropout", "--tp", "1", "--ep", "1", "--only", "plain",
                          "--global-batch", "8", "--variant", k.variant});
      ASSERT_EQ(one.size(), 1u);
      reference[k.variant] = one[0];
    }
    const json& ref = expert_steps(reference[k.variant], "plain");
    const auto ranks =
        run_workers(k.nproc, {"experts", "--no-dropout", "--tp", "2", "--ep", std::to_string(k.ep),
                              "--only", "plain", "--dispatcher", k.dispatcher, "--global-batch",
                              "8", "--variant", k.variant});
    ASSERT_EQ(ranks.size(), static_cast<size_t>(k.nproc));
    for (const auto& r : ranks) {
      const std::string what = k.dispatcher + "/" + k.variant + " tp 2 ep " + std::to_string(k.ep) +
                               ", rank " + r["rank"].dump();
      EXPECT_EQ(r["experts"]["ep_size"], k.ep) << what;
      // The logged auxiliary losses are those of all s tokens (the tensor ranks' shares summed,
      // the z-losses averaged).
      const json& steps = expert_steps(r, "plain");
      expect_steps_within_tolerance(steps, ref, what);
      for (size_t i = 0; i < 3; ++i) {
        // The global batch's routed pairs: every token of every rank, k = 2 each.
        EXPECT_EQ(steps[i]["routed"], ref[i]["routed"]) << what << " step " << i;
        for (const char* aux : {"load_balancing_loss", "z_loss"}) {
          ASSERT_GT(ref[i][aux].get<double>(), 0.0) << aux;
        }
      }
    }
    // Megatron's order: tensor peers adjacent, expert peers t apart.
    EXPECT_EQ(ranks[1]["experts"]["tp_rank"], 1);
    if (k.nproc == 4) {
      EXPECT_EQ(ranks[1]["experts"]["ep_rank"], 0);
      EXPECT_EQ(ranks[2]["experts"]["ep_rank"], 1);
    }
  }
}

TEST(ExpertTensorParallel, EveryStrategyIsBitwiseEqualToThePlainRunAndThePredictorIsExactPerRank) {
  // Tensor parallelism 2 x expert parallelism 2 (four processes) with dropout and expert dropout:
  // every recompute and offload strategy of the MoE layer trains bitwise like the plain run on
  // each rank, and without offload the predictor equals each rank's measured activation bytes
  // given the rows its experts' slices computed; t = 2 alone with the all-gather dispatcher and
  // capacity routing too.
  struct Case {
    int nproc, ep;
    std::string dispatcher, variant;
  };
  for (const Case& k : {Case{4, 2, "alltoall", "base"}, Case{2, 1, "allgather", "capacity"}}) {
    const auto ranks = run_workers(
        k.nproc, {"experts", "--tp", "2", "--ep", std::to_string(k.ep), "--global-batch", "8",
                  "--dispatcher", k.dispatcher, "--variant", k.variant});
    ASSERT_EQ(ranks.size(), static_cast<size_t>(k.nproc));
    for (const auto& r : ranks) {
      expect_strategies_bitwise_and_predicted(r, k.dispatcher + "/" + k.variant);
      if (k.variant != "base") {
        EXPECT_GT(r["experts"]["strategies"]["plain"]["steps"][0]["dropped"].get<int64_t>(), 0)
            << k.variant;
      }
    }
  }
}

TEST(ExpertParallel, ExpertDropoutMasksDifferAcrossExpertRanks) {
  // The same rows through each rank's experts: the masks differ between the ranks, and each is
  // what the stream seed + 1024 + 100 * ep_rank draws (every rank redraws the others').
  const auto ranks = run_workers(2, {"expert_masks", "--tp", "1", "--ep", "2"});
  ASSERT_EQ(ranks.size(), 2u);
  for (const auto& r : ranks) {
    const json& m = r["expert_masks"];
    const int me = m["ep_rank"].get<int>();
    for (int q = 0; q < 2; ++q) {
      EXPECT_EQ(m["equal_to_rank"][q].get<bool>(), q == me) << "rank " << me << " vs " << q;
      EXPECT_TRUE(m["redrawn_equal"][q].get<bool>()) << "rank " << me << " redrawing " << q;
    }
    EXPECT_NEAR(m["dropped_fraction"].get<double>(), 0.5, 0.05);
  }
}

TEST(ExpertParallel, LaunchRulesAndTheTrainLog) {
  const std::string moe =
      " --num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size "
      "2"
      " --num-experts 4 --moe-router-topk 2 --moe-grouped-gemm --moe-expert-capacity-factor 1"
      " --eval-interval 0 --threads 1";
  const auto odd = actmem::testing::run_actmem("launch --nproc-per-node 3 -- train" + moe +
                                               " --expert-model-parallel-size 2 --train-iters 1");
  EXPECT_NE(odd.exit_code, 0);
  EXPECT_NE(
      odd.output.find("--expert-model-parallel-size 2 = 2; the launch must be a multiple of it"),
      std::string::npos)
      << odd.output;
  const auto experts =
      actmem::testing::run_actmem("launch --nproc-per-node 2 -- train" + moe +
                                  " --num-experts 3 --expert-model-parallel-size 2 "
                                  "--train-iters 1");
  EXPECT_NE(experts.exit_code, 0);
  EXPECT_NE(
      experts.output.find("Number of experts should be a multiple of expert model parallel_size."),
      std::string::npos)
      << experts.output;
  const auto single = actmem::testing::run_actmem(
      "train" + moe + " --expert-model-parallel-size 2 --train-iters 1");
  EXPECT_NE(single.exit_code, 0);
  const auto ok = actmem::testing::run_actmem("launch --nproc-per-node 2 -- train" + moe +
                                              " --expert-model-parallel-size 2 --train-iters 2");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_NE(ok.output.find("expert parallel 2 ranks (2 experts each, allgather dispatcher)"),
            std::string::npos)
      << ok.output;
  EXPECT_NE(ok.output.find("| dropped "), std::string::npos) << ok.output;
}

// ---- data parallelism
// -----------------------------------------------------------------------------

}  // namespace
}  // namespace actmem
