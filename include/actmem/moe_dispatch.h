// moe_dispatch.h — expert parallelism's token exchange: Megatron-LM's all-to-all token dispatcher
// (megatron/core/transformer/moe/token_dispatcher.py, MoEAlltoAllTokenDispatcher) on c10d.
//
// Note [All-to-all dispatch]
// Each expert-parallel rank routes its own tokens over all E experts and permutes its (token,
// expert) rows expert-major (moe.h). Rank r owns experts [r E/e, (r+1) E/e). The dispatcher
//   1. all-gathers every rank's rows per expert (Megatron's num_global_tokens_per_expert), so
//      each rank knows how many rows it sends to and receives from every other one (the splits
//      are uneven: they follow the routing);
//   2. all-to-alls the rows (and their routing probabilities): the chunk for rank q is this
//      rank's rows of q's experts;
//   3. regroups what arrived — source-rank-major, [(src 0, expert 0), (src 0, expert 1), ...] —
//      expert-major, [(src 0, expert 0), (src 1, expert 0), ...] (sort_chunks_by_idxs), so each
//      local expert's rows are contiguous for one grouped product;
// and combine() undoes 3 and 2 for the experts' outputs. The all-to-all is an autograd function
// whose backward is the reverse all-to-all (Megatron's _AllToAll), so gradients follow the
// tokens back to the ranks that own them and reach the experts from every rank's tokens.
// Gloo in libtorch 1.13 has all-to-all with uneven splits for CPU tensors (alltoall_base); the
// counts travel as one all-gather of E int64 per rank.
#pragma once

#include "actmem/distributed.h"

#include <ATen/core/Tensor.h>

#include <vector>

namespace actmem {

/// Rows of `x` split by `input_splits` go to the group's ranks in order; the result holds the
/// rows from each rank, sized by `output_splits`. Backward: the reverse all-to-all.
at::Tensor all_to_all(const at::Tensor& x, const std::vector<int64_t>& output_splits,
                      const std::vector<int64_t>& input_splits,
                      const c10::intrusive_ptr<CollectiveGroup>& group);

/// Megatron's sort_chunks_by_idxs: the row chunks of x (sizes `split_sizes`) in the order
/// `order` (indices into the chunks).
at::Tensor sort_chunks_by_idxs(const at::Tensor& x, const std::vector<int64_t>& split_sizes,
                               const std::vector<int64_t>& order);

/// Megatron's MoEAllGatherTokenDispatcher (token_dispatcher.py) moves every rank's tokens to
/// every rank: all_gather_tokens concatenates the group's x along dim 0 (backward: the sum of the
/// ranks' gradients, this rank's slice: a reduce-scatter), each rank computes its local experts
/// on the rows routed to them, and reduce_scatter_tokens sums the group's partial outputs and
/// keeps this rank's slice (backward: all-gather). On Gloo the reduce-scatter is an all-reduce
/// and a slice (Note [Reduce-scatter on Gloo] in tensor_parallel.cpp); bf16 sums in fp32.
at::Tensor all_gather_tokens(const at::Tensor& x, const c10::intrusive_ptr<CollectiveGroup>& group);
at::Tensor reduce_scatter_tokens(const at::Tensor& x,
                                 const c10::intrusive_ptr<CollectiveGroup>& group);

/// Note [All-to-all dispatch], for `ep_size` ranks (this one `ep_rank`) and `num_experts`
/// experts in all. One dispatch, then one combine, per forward.
class AlltoAllTokenDispatcher {
 public:
  AlltoAllTokenDispatcher(c10::intrusive_ptr<CollectiveGroup> group, int ep_rank, int ep_size,
                          int64_t num_experts);
  struct Dispatched {
    at::Tensor tokens;  // [R, h] this rank's experts' rows from every rank, expert-major
    at::Tensor probs;   // [R] their routing probabilities
    std::vector<int64_t> tokens_per_local_expert;  // sums to R
  };
  /// permuted: [N, h] this rank's rows expert-major over all experts; probs: [N];
  /// rows_per_expert: [E] (the sizes of permuted's expert chunks).
  Dispatched dispatch(const at::Tensor& permuted, const at::Tensor& probs,
                      const std::vector<int64_t>& rows_per_expert);
  /// The local experts' outputs [R, h] (dispatch's order) back to this rank's permuted order.
  at::Tensor combine(const at::Tensor& expert_output);
  int64_t local_experts() const { return local_; }

 private:
  c10::intrusive_ptr<CollectiveGroup> group_;
  int ep_rank_, ep_size_;
  int64_t experts_, local_;
  // From the last dispatch: what went to and came from each rank, and the received chunks'
  // sizes (source-rank-major) for the regrouping and its inverse.
  std::vector<int64_t> input_splits_, output_splits_, received_chunks_;
};

}  // namespace actmem
