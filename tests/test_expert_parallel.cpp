// test_expert_parallel.cpp — expert parallelism (and expert x tensor parallelism) across real
// processes: the all-to-all dispatch, training against one process, every strategy bitwise
// against the plain run with the predictor exact per rank, expert dropout across ranks, and the
// launch rules.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include "actmem/config/activation_plan.h"
#include "actmem/model/moe/moe.h"
#include "actmem/parallel/distributed.h"
#include "actmem/parallel/moe_dispatch.h"
#include "actmem/parallel/tensor_parallel.h"
#include "actmem/recompute/rng.h"
#include "actmem/recompute/saved_tensor_hooks.h"
#include "actmem/train/trainer.h"
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
using actmem::testing::rel;
using actmem::testing::run_workers;
using nlohmann::json;

// The ranks these tests start (Note [Ranks are the test binary] in parallel_workers.cpp).
using testing::MaskCollector;
using testing::moe_config;
using testing::moe_strategies;
using testing::three_steps;

// Note [All-to-all dispatch] checked against its definition: every rank routes its own tokens
// (a different number per rank) to two of E = 2 x ranks experts; each rank rebuilds every rank's
// tokens and routing from their seeds, so it knows which rows its experts must receive, in which
// order, and what the combined output and the gradients must be. Expert j of rank r multiplies
// its rows by a parameter w (initially its global index + 1).
nlohmann::json run_dispatch(const actmem::TensorParallelGroup& group) {
  const int ep = group.size, rank = group.rank;
  const int64_t E = 2 * ep, local = 2, h = 6;
  struct Data {
    at::Tensor x, c;                            // tokens [T, h], the loss's weights [T, h]
    std::vector<std::vector<int64_t>> experts;  // per token, its two experts
    std::vector<std::vector<double>> probs;
  };
  auto make = [&](int r) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1000 + r);
    Data d;
    const int64_t T = 5 + 3 * r;
    const auto f64 = at::TensorOptions().dtype(at::kDouble);
    d.x = at::randn({T, h}, gen, f64);
    d.c = at::randn({T, h}, gen, f64);
    for (int64_t t = 0; t < T; ++t) {
      const at::Tensor pick = at::randperm(E, gen, at::TensorOptions().dtype(at::kLong));
      d.experts.push_back({pick[0].item<int64_t>(), pick[1].item<int64_t>()});
      d.probs.push_back(
          {at::rand({1}, gen, f64).item<double>(), at::rand({1}, gen, f64).item<double>()});
    }
    return d;
  };
  std::vector<Data> data;
  for (int r = 0; r < ep; ++r) data.push_back(make(r));
  const Data& me = data[static_cast<size_t>(rank)];
  // This rank's rows expert-major, each expert's tokens in token order (Megatron's permute).
  std::vector<int64_t> token_of_row, rows_per_expert(static_cast<size_t>(E), 0);
  std::vector<double> prob_of_row;
  for (int64_t g = 0; g < E; ++g) {
    for (size_t t = 0; t < me.experts.size(); ++t) {
      for (int k = 0; k < 2; ++k) {
        if (me.experts[t][static_cast<size_t>(k)] != g) continue;
        token_of_row.push_back(static_cast<int64_t>(t));
        prob_of_row.push_back(me.probs[t][static_cast<size_t>(k)]);
        ++rows_per_expert[static_cast<size_t>(g)];
      }
    }
  }
  const at::Tensor x = me.x.clone().requires_grad_(true);
  const at::Tensor index = at::tensor(token_of_row, at::kLong);
  const at::Tensor permuted = x.index_select(0, index);
  const at::Tensor probs = at::tensor(prob_of_row, at::kDouble);
  actmem::AlltoAllTokenDispatcher dispatcher(group, actmem::TensorParallelGroup{}, group, E);
  const auto d = dispatcher.dispatch(permuted, probs, rows_per_expert);
  // What local expert j must have received: from each source rank in order, its tokens routed
  // to global expert rank * 2 + j, in token order.
  std::vector<at::Tensor> expect_rows;
  std::vector<double> expect_probs;
  for (int64_t j = 0; j < local; ++j) {
    const int64_t g = rank * local + j;
    for (int src = 0; src < ep; ++src) {
      const Data& s = data[static_cast<size_t>(src)];
      for (size_t t = 0; t < s.experts.size(); ++t) {
        for (int k = 0; k < 2; ++k) {
          if (s.experts[t][static_cast<size_t>(k)] != g) continue;
          expect_rows.push_back(s.x[static_cast<int64_t>(t)]);
          expect_probs.push_back(s.probs[t][static_cast<size_t>(k)]);
        }
      }
    }
    TORCH_CHECK(
        d.tokens_per_local_expert[static_cast<size_t>(j)] ==
            static_cast<int64_t>(expect_rows.size()) - (j == 0 ? 0 : d.tokens_per_local_expert[0]),
        "dispatch: expert ", g, " got ", d.tokens_per_local_expert[static_cast<size_t>(j)],
        " rows");
  }
  TORCH_CHECK(at::equal(d.tokens, at::stack(expect_rows)), "dispatch: rank ", rank,
              "'s experts received other rows than those routed to them");
  TORCH_CHECK(at::equal(d.probs, at::tensor(expect_probs, at::kDouble)),
              "dispatch: probabilities differ");
  // The experts, combine, unpermute; then backward.
  const at::Tensor w =
      at::arange(rank * local + 1, rank * local + local + 1, at::kDouble).requires_grad_(true);
  const at::Tensor scale = w.repeat_interleave(at::tensor(d.tokens_per_local_expert, at::kLong));
  const at::Tensor y = d.tokens * (scale * d.probs).unsqueeze(1);
  const at::Tensor back = dispatcher.combine(y);
  const at::Tensor out = at::zeros_like(me.x).index_add(0, index, back);
  (out * me.c).sum().backward();
  for (size_t t = 0; t < me.experts.size(); ++t) {
    double f = 0;
    for (int k = 0; k < 2; ++k)
      f += static_cast<double>(me.experts[t][static_cast<size_t>(k)] + 1) *
           me.probs[t][static_cast<size_t>(k)];
    const int64_t ti = static_cast<int64_t>(t);
    TORCH_CHECK(at::allclose(out[ti], me.x[ti] * f, 1e-12, 1e-12), "combine: token ", t,
                " of rank ", rank);
    TORCH_CHECK(at::allclose(x.grad()[ti], me.c[ti] * f, 1e-12, 1e-12), "backward: token ", t,
                " of rank ", rank);
  }
  for (int64_t j = 0; j < local; ++j) {  // each expert learns from every rank's tokens
    const int64_t g = rank * local + j;
    double expect = 0;
    for (const Data& s : data) {
      for (size_t t = 0; t < s.experts.size(); ++t) {
        for (int k = 0; k < 2; ++k) {
          if (s.experts[t][static_cast<size_t>(k)] != g) continue;
          expect +=
              s.probs[t][static_cast<size_t>(k)] *
              at::dot(s.x[static_cast<int64_t>(t)], s.c[static_cast<int64_t>(t)]).item<double>();
        }
      }
    }
    TORCH_CHECK(std::abs(w.grad()[j].item<double>() - expect) < 1e-10 * (1 + std::abs(expect)),
                "backward: expert ", g, "'s gradient ", w.grad()[j].item<double>(), ", expected ",
                expect);
  }
  return {{"rows_received", d.tokens.size(0)}, {"rows_sent", permuted.size(0)}};
}

nlohmann::json run_experts(int tp, int ep, bool dropout, int64_t global_batch,
                           const std::string& dispatcher, const std::string& only,
                           const std::string& variant) {
  nlohmann::json out;
  for (const auto& [name, mutate] : moe_strategies()) {
    if (!only.empty() && name != only) continue;
    TransformerConfig c = moe_config(tp, ep, dropout, dispatcher, variant);
    mutate(c);
    out[name] = three_steps(c, global_batch);
  }
  return {{"strategies", out},
          {"tp_rank", actmem::tensor_parallel_group().rank},
          {"ep_rank", actmem::expert_parallel_group().rank},
          {"ep_size", actmem::expert_parallel_group().size},
          {"edp_size", actmem::expert_data_parallel_group().size},
          {"dp_rank", actmem::data_parallel_group().rank},
          {"dp_size", actmem::data_parallel_group().size}};
}

// Expert dropout: the same rows through this rank's experts under the trainer's streams for
// expert-parallel rank r (seed + 1024 + 100 r); the saved dropout masks of all ranks gathered.
// Each rank also redraws every other rank's mask from that rank's seed: equal to what the rank
// drew, so the difference comes from the stream, not from the rows.
nlohmann::json run_expert_masks() {
  const auto& ep = actmem::expert_parallel_group();
  TransformerConfig c = moe_config(1, ep.size, true, "alltoall", "base");
  c.moe_expert_dropout = 0.5;
  const actmem::ActivationPlan plan = actmem::make_activation_plan(c);
  actmem::Experts experts(c, plan.layers[0], at::kFloat);
  experts.train();
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const int64_t rows = 64, local = c.num_moe_experts / ep.size;
  const at::Tensor x = at::randn({rows, c.hidden_size}, gen);
  const at::Tensor probs = at::ones({rows});
  std::vector<int64_t> counts(static_cast<size_t>(local), rows / local);
  auto draw = [&](int ep_rank) {
    actmem::RngStatesTracker streams = actmem::make_model_parallel_tracker(c.seed, 0, ep_rank, 0);
    std::swap(actmem::get_rng_tracker(), streams);
    MaskCollector collector;
    {
      actmem::SavedTensorHooksGuard guard(collector);
      experts.forward(x, counts, probs, nullptr);
    }
    std::swap(actmem::get_rng_tracker(), streams);
    TORCH_CHECK(collector.masks.size() == 1, "expert masks: ", collector.masks.size(),
                " masks saved");
    return collector.masks[0].second.to(at::kByte);
  };
  const at::Tensor mine = draw(ep.rank);
  const at::Tensor all = actmem::all_gather_tokens(mine.unsqueeze(0), ep);
  nlohmann::json out;
  out["dropped_fraction"] = 1.0 - mine.to(at::kDouble).mean().item<double>();
  out["ep_rank"] = ep.rank;
  for (int r = 0; r < ep.size; ++r) {
    out["equal_to_rank"].push_back(at::equal(all[r], mine));
    out["redrawn_equal"].push_back(at::equal(draw(r), all[r]));
  }
  return out;
}

// --rank dispatch DIR: the ranks as one expert-parallel group.
ACTMEM_RANK_SCENARIO(dispatch, [](const testing::RankOptions& o, const TensorParallelGroup& g) {
  return run_dispatch(g);
});

// --rank experts DIR --tp T --ep E --global-batch G [--dispatcher D] [--no-dropout] [--only S]
// [--variant base|capacity|padded|gated_bias|seq_aux]: WORLD_SIZE = E x the expert-data-parallel
// size.
ACTMEM_RANK_SCENARIO(experts, [](const testing::RankOptions& o, const TensorParallelGroup& g) {
  return run_experts(std::max(o.tp, 1), o.ep, o.dropout, o.global_batch, o.dispatcher, o.only,
                     o.variant);
});

// --rank expert_masks DIR --tp 1 --ep E: expert dropout masks per rank.
ACTMEM_RANK_SCENARIO(expert_masks, [](const testing::RankOptions& o, const TensorParallelGroup& g) {
  return run_expert_masks();
});

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
