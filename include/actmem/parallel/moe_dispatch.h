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
//      rank's rows of q's experts; under expert tensor parallelism (etp = t) each tensor rank
//      then all-gathers what its t peers received (uneven sizes), since every one of them holds
//      a slice of the same experts;
//   3. regroups what arrived — source-rank-major, [(src 0, expert 0), (src 0, expert 1), ...] —
//      expert-major, [(src 0, expert 0), (src 1, expert 0), ...] (sort_chunks_by_idxs), so each
//      local expert's rows are contiguous for one grouped product;
// and combine() undoes 3 and 2 for the experts' outputs (the tensor ranks' partial sums
// reduce-scattered back to the rank that gathered them, then the reverse all-to-all). The
// all-to-all is an autograd function whose backward is the reverse all-to-all (Megatron's
// _AllToAll), so gradients follow the tokens back to the ranks that own them and reach the experts
// from every rank's tokens. Gloo has all-to-all with uneven splits for CPU tensors
// (ProcessGroup::alltoall_base); the counts travel as one all-gather of E int64 per rank.
#pragma once

#include "actmem/parallel/distributed.h"
#include "actmem/parallel/tensor_parallel.h"

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
/// every rank of the tensor-and-expert-parallel group: all_gather_tokens concatenates the group's
/// x along dim 0 (backward: the sum of the ranks' gradients, this rank's slice: a
/// reduce-scatter), each rank computes its local experts (its slice of them under expert tensor
/// parallelism) on the rows routed to them, and reduce_scatter_tokens sums the group's partial
/// outputs and keeps this rank's slice (backward: all-gather). On Gloo the reduce-scatter is an
/// all-reduce and a slice (Note [Reduce-scatter on Gloo] in tensor_parallel.cpp); 16-bit x sums
/// in its own type. Both are x itself for a group of one.
at::Tensor all_gather_tokens(const at::Tensor& x, const TensorParallelGroup& group);
at::Tensor reduce_scatter_tokens(const at::Tensor& x, const TensorParallelGroup& group);
/// The same with rank r holding sizes[r] rows (Note [Uneven all-gather on Gloo]): the all-to-all
/// dispatcher's exchange over the expert tensor-parallel group.
at::Tensor all_gather_tokens_v(const at::Tensor& x, const TensorParallelGroup& group,
                               const std::vector<int64_t>& sizes);
at::Tensor reduce_scatter_tokens_v(const at::Tensor& x, const TensorParallelGroup& group,
                                   const std::vector<int64_t>& sizes);

/// Note [All-to-all dispatch], for the expert-parallel group `ep` (this rank's experts are
/// [ep.rank E/e, (ep.rank+1) E/e)), the expert tensor-parallel group `tp` and both together,
/// `tp_ep` (rank ep.rank * t + tp.rank), over `num_experts` experts in all. One dispatch, then
/// one combine, per forward.
class AlltoAllTokenDispatcher {
 public:
  AlltoAllTokenDispatcher(const TensorParallelGroup& ep, const TensorParallelGroup& tp,
                          const TensorParallelGroup& tp_ep, int64_t num_experts);
  struct Dispatched {
    at::Tensor tokens;  // [R, h] this rank's experts' rows from every rank, expert-major
    at::Tensor probs;   // [R] their routing probabilities
    std::vector<int64_t> tokens_per_local_expert;  // sums to R
  };
  /// permuted: [N, h] this rank's rows expert-major over all experts; probs: [N];
  /// rows_per_expert: [E] (the sizes of permuted's expert chunks).
  Dispatched dispatch(const at::Tensor& permuted, const at::Tensor& probs,
                      const std::vector<int64_t>& rows_per_expert);
  /// The local experts' outputs [R, h] (dispatch's order; with expert tensor parallelism this
  /// rank's partial sums) back to this rank's permuted order, summed over the tensor ranks.
  at::Tensor combine(const at::Tensor& expert_output);
  int64_t local_experts() const { return local_; }

 private:
  TensorParallelGroup ep_, tp_, tp_ep_;
  int64_t experts_, local_;
  // From the last dispatch: what went to and came from each expert rank, what each tensor rank
  // contributed to the uneven all-gather, and the received chunks' sizes (tensor-rank, source-
  // rank, local-expert major) for the regrouping and its inverse.
  std::vector<int64_t> input_splits_, output_splits_, tp_splits_, received_chunks_;
};

}  // namespace actmem
