// test_data_parallel.cpp — data parallelism across real processes: ranks split the global batch
// and train bitwise like one process, the overlapped bucketed reduction, the distributed
// optimizer, dropout, and the launch and batch rules.
#include "actmem/model/activation_bytes.h"
#include "actmem/parallel/distributed.h"
#include "actmem/parallel/distributed_optimizer.h"
#include "actmem/parallel/grad_reducer.h"
#include "actmem/parallel/tensor_parallel.h"
#include "actmem/recompute/rng.h"
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
using testing::base_config;
using testing::moe_config;
using testing::param_digest;
using testing::step_training;
using testing::three_steps;
using testing::with_pipeline;

// Data parallelism: the ranks train the base model on one global batch per step; each reports its
// steps (loss, gradient norm, its gradient digest) and its place in the layout.
nlohmann::json run_data(int t, bool dropout, int64_t global_batch,
                        const std::string& batch_schedule) {
  TransformerConfig c = base_config(t, false, dropout);
  return {{"steps", three_steps(c, global_batch, batch_schedule)["steps"]},
          {"tp_rank", actmem::tensor_parallel_group().rank},
          {"dp_rank", actmem::data_parallel_group().rank},
          {"dp_size", actmem::data_parallel_group().size}};
}

// Data parallelism with and without --overlap-grad-reduce (buckets of `bucket` elements) on the
// same layout (t x p x d, the interleaved schedule with vp > 1): three steps each, dropout as
// asked; per step what the tests compare and how many buckets started during backward.
nlohmann::json run_overlap(int t, int pp, int64_t vp, int64_t layers, bool dropout,
                           int64_t global_batch, int64_t bucket) {
  nlohmann::json out;
  for (const bool overlap : {false, true}) {
    const TransformerConfig c = with_pipeline(base_config(t, false, dropout), layers, pp, vp);
    actmem::TrainingConfig tc = step_training(global_batch);
    tc.overlap_grad_reduce = overlap;
    if (overlap) tc.ddp_bucket_size = bucket;
    actmem::Trainer trainer(c, tc);
    nlohmann::json r;
    for (int i = 0; i < 3; ++i) {
      const actmem::IterationStats st = trainer.train_step(true);
      nlohmann::json step = {
          {"loss", st.loss}, {"grad_norm", st.grad_norm}, {"grad_digest", st.grad_digest}};
      if (const actmem::GradReducer* reducer = trainer.grad_reducer()) {
        step["buckets"] = reducer->buckets();
        step["started_in_backward"] = reducer->started_in_backward();
      }
      r["steps"].push_back(step);
    }
    r["param_digest"] = param_digest(trainer.model());
    out[overlap ? "overlap" : "plain"] = r;
  }
  out["dp_size"] = actmem::data_parallel_group().size;
  out["pp_rank"] = actmem::pipeline_parallel_group().rank;
  return out;
}

// The distributed optimizer against the replicated one on the same layout (t x p x d, the
// interleaved schedule with vp > 1; buckets of `bucket` elements with --overlap-grad-reduce, one
// per group with bucket 0): three steps each, dropout as asked, clip-grad on. Reports per step what
// the tests compare, the parameters' digest, this rank's share of the optimizer state and the
// tracker's device bytes once the trainer holds its state. With p = 1 also resumes across the
// two: a checkpoint saved by either continues bitwise in the other.
nlohmann::json run_distopt(int t, int pp, int ep, int64_t vp, int64_t layers, bool dropout,
                           int64_t global_batch, int64_t bucket, const std::string& variant,
                           const std::string& dir) {
  auto make = [&](bool dist) {
    // variant moe: the MoE model of run_experts, its experts sharded over the
    // expert-data-parallel group and the rest over the data-parallel group.
    const TransformerConfig c =
        with_pipeline(variant == "moe" ? moe_config(t, ep, dropout, "alltoall", "base")
                                       : base_config(t, false, dropout, variant),
                      layers, pp, vp);
    actmem::TrainingConfig tc = step_training(global_batch);
    tc.clip_grad = 0.05;  // small enough to clip: the coefficient comes from the whole gradient
    tc.use_distributed_optimizer = dist;
    if (bucket > 0) {
      tc.overlap_grad_reduce = true;
      tc.ddp_bucket_size = bucket;
    }
    return std::make_unique<actmem::Trainer>(c, tc);
  };
  auto step_json = [](const actmem::IterationStats& st) {
    return nlohmann::json{
        {"loss", st.loss}, {"grad_norm", st.grad_norm}, {"grad_digest", st.grad_digest}};
  };
  nlohmann::json out;
  for (const bool dist : {false, true}) {
    auto trainer = make(dist);
    trainer->memory().reset_peak();
    nlohmann::json r;
    for (int i = 0; i < 3; ++i) r["steps"].push_back(step_json(trainer->train_step(true)));
    r["param_digest"] = param_digest(trainer->model());
    r["device_bytes"] = trainer->memory().current_bytes();
    r["peak"] = trainer->memory().peak_bytes();
    if (pp == 1) {
      // The trainer's memory pre-check, with the optimizer state split d ways.
      const int64_t d =
          std::min(actmem::data_parallel_group().size, actmem::expert_data_parallel_group().size);
      r["peak_bound"] =
          actmem::predict_step_peak_bound(trainer->model().config(), 0, 0, 1, dist ? d : 1);
    }
    if (const actmem::OptimizerShards* shards = trainer->optimizer_shards()) {
      r["owned"] = shards->owned_elements();
      r["total"] = shards->total_elements();
      r["buckets"] = shards->buckets();
    }
    out[dist ? "distributed" : "plain"] = r;
  }
  if (pp == 1) {
    // Two steps, a checkpoint, the third step: saved by one optimizer, resumed by the other.
    for (const bool dist : {false, true}) {
      const std::string ckpt = dir + (dist ? "/ckpt_distributed" : "/ckpt_plain");
      {
        auto saver = make(dist);
        saver->train_step(false);
        saver->train_step(false);
        saver->save_checkpoint(ckpt);
      }
      auto resumed = make(!dist);
      resumed->load_checkpoint(ckpt);
      nlohmann::json r = step_json(resumed->train_step(true));
      r["param_digest"] = param_digest(resumed->model());
      out[dist ? "resumed_from_distributed" : "resumed_from_plain"] = r;
    }
  }
  out["dp_size"] = actmem::data_parallel_group().size;
  out["dp_rank"] = actmem::data_parallel_group().rank;
  out["pp_rank"] = actmem::pipeline_parallel_group().rank;
  out["tp_rank"] = actmem::tensor_parallel_group().rank;
  return out;
}

// --rank data DIR --tp T (--global-batch G | --batch-schedule S) [--no-dropout]: t x d ranks.
ACTMEM_RANK_SCENARIO(data, [](const testing::RankOptions& o, const TensorParallelGroup& g) {
  return run_data(g.size, o.dropout, o.global_batch, o.batch_schedule);
});

// --rank overlap DIR --tp T --pp P [--vp V] --layers L --global-batch G --bucket N [--no-dropout].
ACTMEM_RANK_SCENARIO(overlap, [](const testing::RankOptions& o, const TensorParallelGroup& g) {
  return run_overlap(std::max(o.tp, 1), o.pp, o.vp, o.layers, o.dropout, o.global_batch, o.bucket);
});

// --rank distopt DIR --tp T --pp P [--vp V] --layers L --global-batch G --bucket N
// [--variant base|bf16|moe] [--ep E] [--no-dropout]: bucket 0, no --overlap-grad-reduce.
ACTMEM_RANK_SCENARIO(distopt, [](const testing::RankOptions& o, const TensorParallelGroup& g) {
  return run_distopt(std::max(o.tp, 1), o.pp, o.ep, o.vp, o.layers, o.dropout, o.global_batch,
                     o.bucket, o.variant, o.out_dir);
});

// The steps of a data-parallel launch against a reference launch of the same global batch.
void expect_same_steps(const json& a, const json& b, const std::string& what) {
  ASSERT_EQ(a["steps"].size(), b["steps"].size());
  for (size_t i = 0; i < a["steps"].size(); ++i) {
    EXPECT_EQ(a["steps"][i]["loss"].get<double>(), b["steps"][i]["loss"].get<double>())
        << what << " step " << i;
    EXPECT_EQ(a["steps"][i]["grad_norm"].get<double>(), b["steps"][i]["grad_norm"].get<double>())
        << what << " step " << i;
    EXPECT_EQ(a["steps"][i]["grad_digest"], b["steps"][i]["grad_digest"]) << what << " step " << i;
    EXPECT_EQ(a["steps"][i]["consumed"], b["steps"][i]["consumed"]) << what << " step " << i;
  }
}

TEST(DataParallel, RanksSplitTheGlobalBatchAndTrainBitwiseLikeOneProcess) {
  // Without dropout (data-parallel ranks draw the same dropout masks, as Megatron's do, where
  // one process advances its stream from micro-batch to micro-batch), two data-parallel ranks
  // with one micro-batch each train bitwise like one process with two micro-batches: the loss of
  // each is scaled by 1/2 before backward or the gradients after it, exactly (a power of two),
  // and the two-term sum commutes.
  const auto one = run_workers(1, {"data", "--no-dropout", "--tp", "1", "--global-batch", "8"});
  const auto two = run_workers(2, {"data", "--no-dropout", "--tp", "1", "--global-batch", "8"});
  ASSERT_EQ(one.size(), 1u);
  ASSERT_EQ(two.size(), 2u);
  EXPECT_EQ(two[1]["data"]["dp_rank"], 1);
  EXPECT_EQ(two[1]["data"]["dp_size"], 2);
  for (const auto& r : two)
    expect_same_steps(r["data"], one[0]["data"], "dp 2 rank " + r["rank"].dump());
  // Tensor 2 x data 2 (four processes) against tensor 2: each tensor-parallel rank's gradient
  // shard is the same in both, on both data-parallel ranks (ranks 0, 2 hold tp rank 0).
  const auto tp = run_workers(2, {"data", "--no-dropout", "--tp", "2", "--global-batch", "8"});
  const auto tp_dp = run_workers(4, {"data", "--no-dropout", "--tp", "2", "--global-batch", "8"});
  ASSERT_EQ(tp_dp.size(), 4u);
  for (const auto& r : tp_dp) {
    const int tp_rank = r["data"]["tp_rank"].get<int>();
    expect_same_steps(r["data"], tp[static_cast<size_t>(tp_rank)]["data"],
                      "tp 2 x dp 2 rank " + r["rank"].dump());
  }
  EXPECT_EQ(tp_dp[2]["data"]["tp_rank"], 0);  // Megatron's order: tensor-parallel peers adjacent
  EXPECT_EQ(tp_dp[2]["data"]["dp_rank"], 1);
}

TEST(DataParallel, AStepBatchSizeScheduleTrainsLikeOneProcess) {
  // --step-batch-size-schedule "0:8 256:16" (seq 32, micro-batch 4: 256 tokens are 8 samples):
  // one step at 8, two at 16. Two data-parallel ranks run 1 then 2 micro-batches each, one
  // process 2 then 4; the first step is bitwise (see above), the others sum their micro-batches
  // in another order: within rounding.
  const std::vector<std::string> args = {"data", "--no-dropout",     "--tp",
                                         "1",    "--batch-schedule", "0:8 256:16"};
  const auto one = run_workers(1, args);
  const auto two = run_workers(2, args);
  ASSERT_EQ(two.size(), 2u);
  for (const auto& r : two) {
    const json& a = r["data"]["steps"];
    const json& b = one[0]["data"]["steps"];
    ASSERT_EQ(a.size(), 3u);
    ASSERT_EQ(b.size(), 3u);
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(a[i]["global_batch"], b[i]["global_batch"]) << "step " << i;
      EXPECT_EQ(a[i]["consumed"], b[i]["consumed"]) << "step " << i;
      EXPECT_LT(rel(a[i]["loss"].get<double>(), b[i]["loss"].get<double>()), 1e-6) << "step " << i;
      EXPECT_LT(rel(a[i]["grad_norm"].get<double>(), b[i]["grad_norm"].get<double>()), 1e-5)
          << "step " << i;
    }
    EXPECT_EQ(a[0]["grad_digest"], b[0]["grad_digest"]);
    EXPECT_EQ(a[0]["global_batch"], 8);
    EXPECT_EQ(a[2]["global_batch"], 16);
    EXPECT_EQ(a[2]["consumed"], 40);
  }
}

TEST(DataParallel, OverlappedBucketedReductionIsBitwiseTheSameAndStartsDuringBackward) {
  // --overlap-grad-reduce with small buckets (20000 elements: several per layer), dropout on,
  // two micro-batches per data-parallel rank: d = 2, pipeline 2 x d 2 (1F1B) and pipeline 2 x
  // virtual 2 x d 2 (interleaved). Every rank's losses, gradient norms and gradient digests over
  // three steps and its final parameters are bitwise those of the same layout reducing in one
  // all-reduce after backward (each element sums the same two values). The first step only
  // counts when each parameter becomes ready (Megatron's golden counts); from the second, every
  // bucket starts during backward.
  struct Case {
    int nproc;
    std::vector<std::string> args;
    const char* what;
  };
  const std::vector<Case> cases = {
      {2, {"--pp", "1", "--layers", "4"}, "d 2"},
      {4, {"--pp", "2", "--layers", "4"}, "p 2 x d 2"},
      {4, {"--pp", "2", "--vp", "2", "--layers", "8"}, "p 2 x v 2 x d 2"},
  };
  for (const auto& k : cases) {
    std::vector<std::string> args = {"overlap", "--tp",     "1",    "--global-batch",
                                     "16",      "--bucket", "20000"};
    args.insert(args.end(), k.args.begin(), k.args.end());
    const auto ranks = run_workers(k.nproc, args);
    ASSERT_EQ(ranks.size(), static_cast<size_t>(k.nproc)) << k.what;
    for (const auto& r : ranks) {
      const json& o = r["overlap"];
      const std::string what = std::string(k.what) + " rank " + r["rank"].dump();
      EXPECT_EQ(o["dp_size"], 2) << what;
      const json& plain = o["plain"]["steps"];
      const json& overlap = o["overlap"]["steps"];
      ASSERT_EQ(overlap.size(), 3u) << what;
      for (size_t i = 0; i < 3; ++i) {
        EXPECT_EQ(overlap[i]["loss"], plain[i]["loss"]) << what << " step " << i;
        EXPECT_EQ(overlap[i]["grad_norm"], plain[i]["grad_norm"]) << what << " step " << i;
        EXPECT_EQ(overlap[i]["grad_digest"], plain[i]["grad_digest"]) << what << " step " << i;
        const int64_t buckets = overlap[i]["buckets"].get<int64_t>();
        EXPECT_GT(buckets, 2) << what;
        EXPECT_EQ(overlap[i]["started_in_backward"].get<int64_t>(), i == 0 ? 0 : buckets)
            << what << " step " << i;
      }
      EXPECT_EQ(o["overlap"]["param_digest"], o["plain"]["param_digest"]) << what;
    }
  }
}

TEST(DataParallel, DistributedOptimizerIsBitwiseTheReplicatedOneWithItsStateSharded) {
  // --use-distributed-optimizer against the replicated optimizer on the same layout, dropout
  // on, gradients clipped, three steps: every rank's losses, gradient norms, gradient digests
  // and final parameters are bitwise the same (each element gets the same AdamW arithmetic on the
  // same values); the data-parallel ranks' pieces cover every element once; the tracker's device
  // bytes drop by exactly the optimizer state of the elements another rank holds (AdamW's two
  // fp32 moments, and at 16 bits the fp32 main parameter: 8 or 12 bytes each). With p = 1 a
  // checkpoint saved by either optimizer resumes bitwise in the other (in the MoE case this also
  // needs every replica's random streams in the checkpoint: expert dropout draws per routed token,
  // so the two expert-data-parallel replicas' streams differ).
  struct Case {
    int nproc;
    std::vector<std::string> args;
    int64_t state_bytes;  // per element held
    const char* what;
  };
  const std::vector<Case> cases = {
      {2, {"--tp", "1", "--layers", "2", "--bucket", "0"}, 8, "d 2 fp32"},
      {2,
       {"--tp", "1", "--layers", "2", "--bucket", "20000", "--variant", "bf16"},
       12,
       "d 2 bf16, overlapped 20000-element buckets"},
      {4,
       {"--tp", "1", "--pp", "2", "--layers", "4", "--bucket", "20000"},
       8,
       "p 2 x d 2 fp32, overlapped"},
      {4,
       {"--tp", "2", "--layers", "2", "--bucket", "0", "--variant", "bf16"},
       12,
       "t 2 x d 2 bf16"},
      // Dense weights over d = 4, the experts over their expert-data-parallel group of 2.
      {4,
       {"--tp", "1", "--ep", "2", "--layers", "2", "--bucket", "0", "--variant", "moe"},
       8,
       "MoE e 2 x d 4"},
  };
  for (const auto& k : cases) {
    std::vector<std::string> args = {"distopt", "--global-batch", "16"};
    args.insert(args.end(), k.args.begin(), k.args.end());
    const auto ranks = run_workers(k.nproc, args);
    ASSERT_EQ(ranks.size(), static_cast<size_t>(k.nproc)) << k.what;
    std::map<std::pair<int, int>, int64_t> owned;  // summed over the data-parallel ranks
    for (const auto& r : ranks) {
      const json& o = r["distopt"];
      const std::string what = std::string(k.what) + " rank " + r["rank"].dump();
      const bool moe = k.args.back() == "moe";
      ASSERT_EQ(o["dp_size"], moe ? 4 : 2) << what;
      const json& plain = o["plain"];
      const json& dist = o["distributed"];
      ASSERT_EQ(dist["steps"].size(), 3u) << what;
      for (size_t i = 0; i < 3; ++i) {
        EXPECT_EQ(dist["steps"][i]["loss"], plain["steps"][i]["loss"]) << what << " step " << i;
        EXPECT_EQ(dist["steps"][i]["grad_norm"], plain["steps"][i]["grad_norm"])
            << what << " step " << i;
        EXPECT_EQ(dist["steps"][i]["grad_digest"], plain["steps"][i]["grad_digest"])
            << what << " step " << i;
      }
      EXPECT_EQ(dist["param_digest"], plain["param_digest"]) << what;
      const int64_t mine = dist["owned"].get<int64_t>(), total = dist["total"].get<int64_t>();
      EXPECT_GT(mine, 0) << what;
      EXPECT_LT(mine, total) << what;
      owned[{o["tp_rank"].get<int>(), o["pp_rank"].get<int>()}] += mine;
      EXPECT_EQ(plain["device_bytes"].get<int64_t>() - dist["device_bytes"].get<int64_t>(),
                (total - mine) * k.state_bytes)
          << what;
      if (dist.contains("peak_bound")) {
        // The trainer's memory pre-check stays a bound with the state split, and a tighter one.
        EXPECT_GE(dist["peak_bound"].get<double>(), dist["peak"].get<double>()) << what;
        EXPECT_LT(dist["peak_bound"].get<double>(), plain["peak_bound"].get<double>()) << what;
        EXPECT_GE(plain["peak_bound"].get<double>(), plain["peak"].get<double>()) << what;
      }
      if (o.contains("resumed_from_plain")) {
        for (const char* from : {"resumed_from_plain", "resumed_from_distributed"}) {
          EXPECT_EQ(o[from]["loss"], plain["steps"][2]["loss"]) << what << " " << from;
          EXPECT_EQ(o[from]["param_digest"], plain["param_digest"]) << what << " " << from;
        }
      }
    }
    if (k.args.back() == "moe") continue;  // each expert-parallel rank holds other experts
    for (const auto& r : ranks) {
      const json& o = r["distopt"];
      const std::pair<int, int> place(o["tp_rank"].get<int>(), o["pp_rank"].get<int>());
      EXPECT_EQ(owned[place], o["distributed"]["total"].get<int64_t>())
          << k.what << ": the pieces do not cover every element once";
    }
  }
}

TEST(DataParallel, WithDropoutTheLossStaysWithinTheMaskNoise) {
  // With dropout the data-parallel ranks' masks differ from one process's (see above): the
  // losses agree to within the noise dropout adds (here under 1%), not bitwise.
  const auto one = run_workers(1, {"data", "--tp", "1", "--global-batch", "8"});
  const auto two = run_workers(2, {"data", "--tp", "1", "--global-batch", "8"});
  ASSERT_EQ(two.size(), 2u);
  for (size_t i = 0; i < 3; ++i) {
    const double a = one[0]["data"]["steps"][i]["loss"].get<double>();
    const double b = two[0]["data"]["steps"][i]["loss"].get<double>();
    EXPECT_LT(std::abs(a - b) / a, 0.01) << "step " << i;
    EXPECT_EQ(b, two[1]["data"]["steps"][i]["loss"].get<double>());  // one reported mean
  }
}

TEST(DataParallel, LaunchSizeAndBatchRules) {
  const auto odd = actmem::testing::run_actmem(
      "launch --nproc-per-node 3 -- train --tensor-model-parallel-size 2 --train-iters 1");
  EXPECT_NE(odd.exit_code, 0);
  EXPECT_NE(odd.output.find("the launch must be a multiple of it"), std::string::npos)
      << odd.output;
  const auto batch = actmem::testing::run_actmem(
      "launch --nproc-per-node 2 -- train --num-layers 1 --hidden-size 32 --num-attention-heads 2 "
      "--seq-length 16 --micro-batch-size 2 --global-batch-size 2 --train-iters 1");
  EXPECT_NE(batch.exit_code, 0);
  EXPECT_NE(batch.output.find("global batch size (2) is not divisible by micro batch size (2) "
                              "times data parallel size (2)"),
            std::string::npos)
      << batch.output;
  // A run that fits: the split of the batch, and the overlapped reduction says how many buckets
  // it made (a bucket closes at 2000 elements or more).
  const auto overlap = actmem::testing::run_actmem(
      "launch --nproc-per-node 2 -- train --num-layers 1 --hidden-size 32 --num-attention-heads 2 "
      "--seq-length 16 --micro-batch-size 2 --train-iters 2 --overlap-grad-reduce "
      "--ddp-bucket-size 2000");
  EXPECT_EQ(overlap.exit_code, 0) << overlap.output;
  EXPECT_NE(overlap.output.find("micro-batch 2 x 1 micro-batches on each of 2 data-parallel ranks"),
            std::string::npos)
      << overlap.output;
  EXPECT_NE(overlap.output.find("buckets overlapping the last backward)"), std::string::npos)
      << overlap.output;
}

// ---- pipeline parallelism -------------------------------------------------------------------

}  // namespace
}  // namespace actmem
