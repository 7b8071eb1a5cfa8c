// test_parallel_layout.cpp — Megatron's rank groups: its documented examples, the explicit
// ("past code") formulas its own unit test compares RankGenerator with, its errors, and the
// groups built on c10d by a launch of four processes.
#include "actmem/base/compat.h"
#include "actmem/parallel/distributed.h"
#include "actmem/parallel/distributed_optimizer.h"
#include "actmem/parallel/parallel_layout.h"
#include "test_util.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
// TensorParallelGroup's process-group pointer needs the complete type to be destroyed.
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace {

using actmem::ParallelLayout;
using actmem::RankGenerator;
using Groups = std::vector<std::vector<int>>;

TEST(ParallelLayout, MegatronsDocumentedExamples) {
  // generate_masked_orthogonal_rank_groups' docstring (megatron/core/parallel_state.py).
  const Groups dp = actmem::masked_orthogonal_rank_groups(8, {2, 2, 2}, {false, false, true});
  EXPECT_EQ(dp, (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));  // order tp-pp-dp
  const Groups g = actmem::masked_orthogonal_rank_groups(24, {2, 3, 4}, {false, true, false});
  ASSERT_EQ(g.size(), 8u);
  EXPECT_EQ(g[0], (std::vector<int>{0, 2, 4}));
  EXPECT_EQ(g[1], (std::vector<int>{1, 3, 5}));
  EXPECT_EQ(g[7], (std::vector<int>{19, 21, 23}));
  // initialize_model_parallel's docstring: 16 GPUs, tensor 2, pipeline 4.
  const ParallelLayout l = ParallelLayout::make(16, 2, 4);
  EXPECT_EQ(l.dp, 2);
  EXPECT_EQ(l.dp_groups,
            (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}));
  EXPECT_EQ(l.tp_groups,
            (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}));
  EXPECT_EQ(l.pp_groups, (Groups{{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}}));
  EXPECT_EQ(l.embedding_groups, (Groups{{0, 12}, {1, 13}, {2, 14}, {3, 15}}));
  EXPECT_EQ(ParallelLayout::index_in(l.pp_groups, 9), 2);  // rank 9 is stage 2
}

TEST(ParallelLayout, MatchesTheExplicitFormulasOfMegatronsTest) {
  // test_parallel_state.py's golden_rank_result_from_past_code: ranks laid out as an array
  // (pp, dp, ep, tp) for the experts and (pp, dp, tp) for the dense part (cp = 1).
  for (const auto& [world, tp, pp, ep] : std::vector<std::tuple<int, int, int, int>>{
           {8, 1, 1, 2}, {8, 2, 1, 2}, {8, 2, 2, 2}, {16, 2, 2, 4}, {16, 1, 4, 2}, {32, 4, 2, 2}}) {
    const ParallelLayout l = ParallelLayout::make(world, tp, pp, ep);
    const int dp = world / (tp * pp), edp = world / (tp * ep * pp);
    ASSERT_EQ(l.dp, dp);
    ASSERT_EQ(l.edp, edp);
    Groups dense_dp, tp_groups, ep_groups, edp_groups;
    for (int p = 0; p < pp; ++p) {
      for (int t = 0; t < tp; ++t) {
        std::vector<int> g;
        for (int d = 0; d < dp; ++d) g.push_back((p * dp + d) * tp + t);
        dense_dp.push_back(g);
      }
      for (int d = 0; d < dp; ++d) {
        std::vector<int> g;
        for (int t = 0; t < tp; ++t) g.push_back((p * dp + d) * tp + t);
        tp_groups.push_back(g);
      }
    }
    auto rank = [&](int p, int d, int e, int t) { return ((p * edp + d) * ep + e) * tp + t; };
    for (int p = 0; p < pp; ++p) {
      for (int d = 0; d < edp; ++d) {
        for (int t = 0; t < tp; ++t) {
          std::vector<int> g;
          for (int e = 0; e < ep; ++e) g.push_back(rank(p, d, e, t));
          ep_groups.push_back(g);
        }
      }
      for (int e = 0; e < ep; ++e) {
        for (int t = 0; t < tp; ++t) {
          std::vector<int> g;
          for (int d = 0; d < edp; ++d) g.push_back(rank(p, d, e, t));
          edp_groups.push_back(g);
        }
      }
    }
    auto sorted = [](Groups g) {
      std::sort(g.begin(), g.end());
      return g;
    };
    const std::string at = std::to_string(world) + " " + std::to_string(tp) + " " +
                           std::to_string(pp) + " " + std::to_string(ep);
    EXPECT_EQ(sorted(l.dp_groups), sorted(dense_dp)) << at;
    EXPECT_EQ(sorted(l.tp_groups), sorted(tp_groups)) << at;
    EXPECT_EQ(sorted(l.ep_groups), sorted(ep_groups)) << at;
    EXPECT_EQ(sorted(l.edp_groups), sorted(edp_groups)) << at;
    // Expert parallelism is carved out of the data-parallel ranks: every expert-parallel group
    // lies inside one dense data-parallel group.
    for (const auto& g : l.ep_groups) {
      const auto& d = ParallelLayout::group_of(l.dp_groups, g[0]);
      for (int r : g) EXPECT_NE(std::find(d.begin(), d.end(), r), d.end()) << at;
    }
  }
}

TEST(ParallelLayout, RefusesSizesThatDoNotDivideTheWorld) {
  actmem::testing::expect_error_containing([] { ParallelLayout::make(6, 4, 1); },
                                           "world_size (6) is not divisible by 4");
  actmem::testing::expect_error_containing(
      [] { ParallelLayout::make(8, 2, 1, 8); },
      "is not divisible by expert_tensor_model_pipeline_parallel size (16)");
  actmem::testing::expect_error_containing(
      [] { RankGenerator(2, 1, 2, 2, 1, "tp-dp"); },
      "The size of (pp) is (2), but you haven't specified the order");
  // A dimension of size 1 may be left out of the order: it is appended.
  EXPECT_EQ(RankGenerator(2, 1, 2, 1, 1, "tp-dp").order(), "tp-dp-pp-ep-cp");
}

TEST(ParallelLayout, GroupsOnC10dAllReduceWithinTheirMembers) {
  // Four processes, tensor 2 x expert 2: dense data parallelism 2, the experts' 1; every group
  // of every kind is built on Gloo and all-reduces its members' ranks.
  const auto r = actmem::testing::run_actmem(
      "launch --nproc-per-node 4 -- dist-check --tensor-model-parallel-size 2 "
      "--expert-model-parallel-size 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("tp        [[0, 1], [2, 3]]"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("dp        [[0, 2], [1, 3]]"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("ep        [[0, 2], [1, 3]]"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("expert dp [[0], [1], [2], [3]]"), std::string::npos) << r.output;
  const auto pipeline = actmem::testing::run_actmem(
      "launch --nproc-per-node 4 -- dist-check --pipeline-model-parallel-size 2");
  ASSERT_EQ(pipeline.exit_code, 0) << pipeline.output;
  EXPECT_NE(pipeline.output.find("pp        [[0, 2], [1, 3]]"), std::string::npos)
      << pipeline.output;
  const auto bad = actmem::testing::run_actmem(
      "launch --nproc-per-node 2 -- dist-check --tensor-model-parallel-size 4");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("world_size (2) is not divisible by 4"), std::string::npos)
      << bad.output;
}

}  // namespace

// ---- the distributed optimizer's buffer layout ------------------------------------------------

namespace {

// Rank `rank`'s range of each parameter (numels given) in a group of `d`.
std::vector<std::pair<int64_t, int64_t>> shard_ranges(const std::vector<int64_t>& numels, int d,
                                                      int rank, std::optional<int64_t> bucket,
                                                      int64_t own = -1,
                                                      int64_t* buckets = nullptr) {
  actmem::TensorParallelGroup g;  // only the layout is computed: no process group needed
  g.rank = rank;
  g.size = d;
  std::vector<at::Tensor> params;
  actmem::OptimizerShards::Group group{&g, {}};
  for (size_t i = 0; i < numels.size(); ++i) {
    params.push_back(at::zeros({numels[i]}));
    group.params.push_back(i);
  }
  const actmem::OptimizerShards shards(params, {group}, bucket, own);
  std::vector<std::pair<int64_t, int64_t>> out;
  for (size_t i = 0; i < numels.size(); ++i) out.emplace_back(shards.begin(i), shards.end(i));
  if (buckets != nullptr) *buckets = shards.buckets();
  return out;
}

using Ranges = std::vector<std::pair<int64_t, int64_t>>;

}  // namespace

TEST(DistributedOptimizerLayout, MegatronsPaddingAndPieces) {
  // Parameters of 100, 50 and 300 elements, laid out in reverse (Megatron's
  // _compute_per_buffer_param_layout): the 300 at [0, 300), the 50 at the next multiple of 64,
  // [320, 370), the 100 at [384, 484); the bucket's end padded to lcm(2, 128) = 128: 512, two
  // pieces of 256. Worked by hand from those rules.
  EXPECT_EQ(shard_ranges({100, 50, 300}, 2, 0, std::nullopt), (Ranges{{0, 0}, {0, 0}, {0, 256}}));
  EXPECT_EQ(shard_ranges({100, 50, 300}, 2, 1, std::nullopt),
            (Ranges{{0, 100}, {0, 50}, {256, 300}}));
  // Buckets of 350 elements: the first closes after the 50 (370 >= 350), padded to 384 (pieces
  // of 192); the second holds the 100 at [384, 484), padded to 512 (pieces of 64).
  int64_t buckets = 0;
  EXPECT_EQ(shard_ranges({100, 50, 300}, 2, 0, 350, -1, &buckets),
            (Ranges{{0, 64}, {0, 0}, {0, 192}}));
  EXPECT_EQ(buckets, 2);
  EXPECT_EQ(shard_ranges({100, 50, 300}, 2, 1, 350), (Ranges{{64, 100}, {0, 50}, {192, 300}}));
  // The pipeline-tied embedding (the 50) alone in its bucket: [0, 300) padded to 384, then
  // [384, 434) padded to 512 (pieces of 64: all of it on rank 0), then the 100 at [512, 612)
  // padded to 640.
  EXPECT_EQ(shard_ranges({100, 50, 300}, 2, 0, std::nullopt, 1, &buckets),
            (Ranges{{0, 64}, {0, 50}, {0, 192}}));
  EXPECT_EQ(buckets, 3);
  EXPECT_EQ(shard_ranges({100, 50, 300}, 2, 1, std::nullopt, 1),
            (Ranges{{64, 100}, {0, 0}, {192, 300}}));
  // Three ranks: lcm(3, 128) = 384; 512 elements pad to 768, pieces of 256.
  EXPECT_EQ(shard_ranges({512}, 3, 2, std::nullopt), (Ranges{{0, 0}}));
  EXPECT_EQ(shard_ranges({512}, 3, 1, std::nullopt), (Ranges{{256, 512}}));
  // One rank holds everything.
  EXPECT_EQ(shard_ranges({100, 50}, 1, 0, std::nullopt), (Ranges{{0, 100}, {0, 50}}));
}

TEST(DistributedOptimizerLayout, BadInputIsRefused) {
  actmem::TensorParallelGroup g;
  std::vector<at::Tensor> params = {at::zeros({4}), at::zeros({4})};
  actmem::testing::expect_error_containing(
      [&] {
        actmem::OptimizerShards(params, {{&g, {0}}}, std::nullopt);
      },
      "is in no group");
  actmem::testing::expect_error_containing(
      [&] {
        actmem::OptimizerShards(params, {{&g, {0, 1}}}, 0);
      },
      "bucket_size must be positive");
  actmem::testing::expect_error_containing(
      [&] {
        actmem::OptimizerShards(params, {{&g, {0, 1, 1}}}, std::nullopt);
      },
      "in two groups");
  const actmem::OptimizerShards shards(params, {{&g, {0, 1}}}, std::nullopt);
  actmem::testing::expect_error_containing(
      [&] { shards.shard(at::zeros({5}), 0); },
      "expected a contiguous tensor of parameter 0's 4 elements");
}
