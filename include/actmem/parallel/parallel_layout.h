// parallel_layout.h — which global ranks form each parallel group: Megatron-LM's RankGenerator
// (megatron/core/parallel_state.py) for world = t x c x e x d x p, in Megatron's rank order.
//
// Note [Megatron's rank order]
// Megatron numbers ranks by an order string, default "tp-cp-ep-dp-pp": the first name varies
// fastest, so tensor-parallel peers are adjacent ranks (one node's NVLink) and pipeline stages
// are farthest apart. A group of kind "dp" holds the ranks that differ only in their dp index;
// "tp-pp" (the model-parallel group) those that differ in tp or pp. Two generators share the
// world: the dense one (ep = 1; dp = world / (t c p)) for attention and dense MLPs, and the
// expert one (tensor size etp, ep, expert dp = world / (etp e p), cp = 1) for MoE experts —
// expert parallelism is carved out of the data-parallel ranks. This header computes the groups
// (pure integer arithmetic, no processes); distributed.h builds c10d groups from them.
#pragma once

#include <string>
#include <vector>

namespace actmem {

/// Megatron's generate_masked_orthogonal_rank_groups: for sizes in order (first fastest) and a
/// mask of the dimensions a group spans, every group's global ranks.
std::vector<std::vector<int>> masked_orthogonal_rank_groups(int world_size,
                                                            const std::vector<int>& sizes,
                                                            const std::vector<bool>& mask);

/// Megatron's RankGenerator: sizes of tp, ep, dp, pp, cp and their order ("tp-cp-ep-dp-pp";
/// names not in it are appended, which Megatron allows only for size-1 dimensions).
class RankGenerator {
 public:
  RankGenerator(int tp, int ep, int dp, int pp, int cp, const std::string& order);
  /// The groups of `token`, one name or several joined by '-' ("tp", "dp-cp", "tp-pp").
  std::vector<std::vector<int>> ranks(const std::string& token) const;
  int world_size() const { return world_size_; }
  const std::string& order() const { return order_; }

 private:
  int world_size_;
  std::string order_;
  std::vector<std::string> names_;
  std::vector<int> sizes_;
};

/// The sizes of a launch and every group of Megatron's initialize_model_parallel that actmem
/// uses, for all ranks.
struct ParallelLayout {
  int world = 1, tp = 1, pp = 1, cp = 1, dp = 1;  // dense: world = tp * cp * dp * pp
  int ep = 1, etp = 1, edp = 1;                   // experts: world = etp * ep * edp * pp
  std::string order = "tp-cp-ep-dp-pp";
  std::vector<std::vector<int>> tp_groups, pp_groups, dp_groups, cp_groups, mp_groups;
  std::vector<std::vector<int>> ep_groups, etp_groups, edp_groups;
  /// The expert tensor- and expert-parallel ranks together (Megatron's
  /// _TENSOR_AND_EXPERT_PARALLEL_GROUP): the all-gather dispatcher's group.
  std::vector<std::vector<int>> tp_ep_groups;
  /// Per pipeline group, its first and last stage (Megatron's default_embedding_ranks: the
  /// word embedding and the output layer are kept in sync through it); one rank when p = 1.
  std::vector<std::vector<int>> embedding_groups;

  /// Megatron's checks with its messages: world divisible by t*c*p and by etp*e*p; order names.
  /// etp 0 means t (Megatron's default expert tensor-parallel size).
  static ParallelLayout make(int world, int tp, int pp, int ep = 1, int etp = 0, int cp = 1,
                             const std::string& order = "tp-cp-ep-dp-pp");
  /// The group of `groups` that holds `rank`, and `rank`'s index in it.
  static const std::vector<int>& group_of(const std::vector<std::vector<int>>& groups, int rank);
  static int index_in(const std::vector<std::vector<int>>& groups, int rank);
  /// Which of `groups` holds `rank` (its number, for naming the group's rendezvous).
  static int group_index(const std::vector<std::vector<int>>& groups, int rank);
  /// One line per group kind ("tp  [[0, 1], [2, 3]]"), as a reader checks a launch's layout.
  std::string describe() const;
};

}  // namespace actmem
