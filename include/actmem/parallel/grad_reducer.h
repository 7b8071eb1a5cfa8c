// grad_reducer.h — the data-parallel gradient reduction in buckets that start during backward
// (Megatron's DistributedDataParallel with overlap_grad_reduce: megatron/core/distributed/
// distributed_data_parallel.py and param_and_grad_buffer.py). docs/parallelism.md, "Data
// parallelism".
#pragma once

#include "actmem/base/compat.h"
#include "actmem/parallel/tensor_parallel.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace torch::autograd {
struct Node;
}  // namespace torch::autograd

namespace actmem {

/// Note [Overlapped gradient reduction]
/// Parameters go into buckets in reverse order (the order backward produces their gradients),
/// a bucket closing once it holds at least `bucket_size` elements (Megatron's
/// _compute_default_per_buffer_param_layout); parameters reduced over another group (the routed
/// experts, over the expert-data-parallel group) have buckets of their own. A hook after each
/// parameter's gradient accumulator (registered after any main-grad hook, so it sees the
/// accumulated gradient) counts the parameter ready, but only during the step's last backward of
/// that parameter (set_last_microbatch: Megatron's no_sync turned off for the last micro-batch,
/// per model chunk under the interleaved schedule). The first step only counts how often each
/// parameter becomes ready (Megatron's golden_per_param_grad_ready_counts) and reduces at
/// finish(); from the second on, a bucket whose parameters all reached their count starts its
/// all-reduce (scaled by `scale`, as Megatron's gradient_scaling_factor) while backward goes on,
/// and finish() starts whatever has not started and waits for all. Each element is summed over
/// the same ranks as one flat all-reduce would, so with two ranks the result is bitwise the
/// same; with more, Gloo's ring may add in another order for an element near a bucket's edge.
class GradReducer {
 public:
  struct Group {
    const TensorParallelGroup* group;  // process-wide, outlives this object
    std::vector<at::Tensor> params;    // leaf parameters, in the model's order
    std::vector<at::Tensor> grads;     // what is reduced for each (its main grad or .grad)
  };
  GradReducer(std::vector<Group> groups, int64_t bucket_size, double scale);
  ~GradReducer();
  GradReducer(const GradReducer&) = delete;
  GradReducer& operator=(const GradReducer&) = delete;

  /// Whether the backward about to run is the parameters' last of this step.
  void set_last_microbatch(bool last);
  /// Starts the buckets not started, waits for all, writes the sums into the gradients, and
  /// re-arms for the next step.
  void finish();

  int64_t buckets() const { return static_cast<int64_t>(buckets_.size()); }
  /// Buckets whose all-reduce started during the last step's backward (the rest at finish()).
  int64_t started_in_backward() const { return started_in_backward_; }

 private:
  struct Bucket {
    const TensorParallelGroup* group = nullptr;
    std::vector<size_t> members;  // indices into params_
    int64_t ready = 0, needed = 0;
    PendingAllReduce pending;
    bool started = false;
  };
  void on_grad_ready(size_t index);
  void start(Bucket& b);

  std::vector<at::Tensor> params_, grads_;
  std::vector<size_t> bucket_of_;
  std::vector<int64_t> count_, golden_;
  std::vector<Bucket> buckets_;
  std::vector<compat::NodePtr> accumulators_;
  double scale_;
  bool last_microbatch_ = true, first_step_ = true;
  int64_t started_in_backward_ = 0, started_now_ = 0;
  bool late_ = false;  // a gradient changed after its bucket's all-reduce started
  std::mutex mutex_;
};

}  // namespace actmem
