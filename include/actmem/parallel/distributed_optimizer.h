// distributed_optimizer.h — the optimizer state sharded over the data-parallel ranks (Megatron's
// DistributedOptimizer: megatron/core/optimizer/distrib_optimizer.py, its buffer layout in
// _compute_per_buffer_param_layout and megatron/core/optimizer/param_layout.py).
// docs/parallelism.md, "Distributed optimizer".
#pragma once

#include "actmem/parallel/tensor_parallel.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace actmem {

/// Note [Distributed optimizer]
/// Megatron lays each group's parameters (the dense ones over the data-parallel group; the routed
/// experts over the expert-data-parallel group when expert parallelism splits them) end to end in
/// one flat buffer, in reverse order, each parameter starting at a multiple of 64 elements; a
/// bucket closes once it holds at least `bucket_size` elements (one bucket per group without a
/// size), or before and after a pipeline-tied embedding, and its end is padded to a multiple of
/// lcm(d, 128). Rank r of the group owns the r-th of d equal pieces of every bucket: the optimizer
/// state (AdamW's two moments; at 16 bits also the fp32 main parameters) exists for those elements
/// only, so it takes 1/d of the bytes. After each rank stepped its pieces, an all-gather per
/// bucket gives every rank every updated parameter.
///
/// The gradients are still all-reduced (not reduce-scattered, as Megatron does on NCCL): Gloo has
/// no reduce-scatter (group_reduce_scatter_dim0 is an all-reduce whose other pieces are dropped),
/// so on it the all-reduce costs the same, and every rank keeps the whole reduced gradient, from
/// which the norm, the clip and the loss-scale check run as without the distributed optimizer.
/// Each element is updated by the same AdamW arithmetic on the same values, so the parameters are
/// bitwise the non-distributed run's (tested over several steps).
class OptimizerShards {
 public:
  struct Group {
    const TensorParallelGroup* group;  // process-wide, outlives this object
    std::vector<size_t> params;        // indices into the parameter list, in the model's order
  };
  /// `params`: every parameter (their shapes and types; not kept). `bucket_size`: elements per
  /// bucket, or nullopt for one bucket per group. `own_bucket`: a parameter that gets a bucket of
  /// its own (the embedding tied across pipeline stages), or -1.
  OptimizerShards(const std::vector<at::Tensor>& params, std::vector<Group> groups,
                  std::optional<int64_t> bucket_size, int64_t own_bucket = -1);

  /// This rank's elements of parameter i: [begin, end) of its flattened view (possibly empty).
  int64_t begin(size_t i) const { return ranges_[i].first; }
  int64_t end(size_t i) const { return ranges_[i].second; }
  /// This rank's elements of `full` (shaped like parameter i, contiguous) as a 1-D view.
  at::Tensor shard(const at::Tensor& full, size_t i) const;
  /// Elements whose optimizer state this rank holds, and all parameters' elements.
  int64_t owned_elements() const { return owned_; }
  int64_t total_elements() const { return total_; }
  int64_t buckets() const { return static_cast<int64_t>(buckets_.size()); }
  /// Collective over each bucket's group: `tensors` (one per parameter, shaped like it, all of one
  /// type within a group) end up holding, everywhere, the values of the rank that owns each
  /// element. One all-gather per bucket, in bucket order (the same on every rank).
  void all_gather(const std::vector<at::Tensor>& tensors) const;

 private:
  struct Member {
    size_t param;
    int64_t offset;  // of the parameter's first element within the bucket
  };
  struct Bucket {
    const TensorParallelGroup* group = nullptr;
    int64_t size = 0;  // padded: a multiple of the group's size
    std::vector<Member> members;
  };
  std::vector<Bucket> buckets_;
  std::vector<std::pair<int64_t, int64_t>> ranges_;
  std::vector<int64_t> numel_;
  int64_t owned_ = 0, total_ = 0;
};

}  // namespace actmem
