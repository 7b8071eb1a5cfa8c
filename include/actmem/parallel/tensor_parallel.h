// tensor_parallel.h — Megatron's tensor and sequence parallelism on a c10d process group:
// the process-wide tensor-parallel group, the autograd mappings between the replicated,
// tensor-parallel and sequence-parallel regions, and the parallel linear layers' forwards.
//
// With a group of size 1 (the default, no process group) every mapping is the identity and
// returns its input unchanged, so a single-process model builds exactly the graph it always did.
//
//   mapping                                forward              backward
//   copy_to_tensor_parallel_region         identity             all-reduce
//   reduce_from_tensor_parallel_region     all-reduce           identity
//   scatter_to_sequence_parallel_region    split dim 0          all-gather dim 0
//   gather_from_sequence_parallel_region   all-gather dim 0     reduce-scatter dim 0, or split
//                                                               when the consumer is replicated
//   reduce_scatter_to_sequence_parallel    reduce-scatter dim 0 all-gather dim 0
#pragma once

#include "actmem/parallel/distributed.h"

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <string>
#include <vector>

namespace c10d {
class Work;
}  // namespace c10d

namespace actmem {

/// The ranks that split each layer's weights (here: every process of the launch).
struct TensorParallelGroup {
  c10::intrusive_ptr<CollectiveGroup> pg;  // null when size == 1
  int rank = 0;
  int size = 1;
};

/// The process-wide group (Megatron's parallel_state); size 1 until set.
const TensorParallelGroup& tensor_parallel_group();
void set_tensor_parallel_group(TensorParallelGroup group);

/// The device a launched rank trains on: "cuda" becomes "cuda:LOCAL_RANK" under a launch of
/// several processes (one GPU per rank, as torchrun users expect); anything else is kept.
std::string device_for_rank(const std::string& device, const DistEnv& env);

/// The ranks that hold the same model slice and split every global batch (Megatron's
/// data-parallel group); size 1 until set.
const TensorParallelGroup& data_parallel_group();
void set_data_parallel_group(TensorParallelGroup group);
/// Sum of x over the data-parallel group (x itself for size 1).
at::Tensor data_parallel_all_reduce_sum(const at::Tensor& x);

/// The ranks that split each MoE layer's experts between them (Megatron's expert-model-parallel
/// group, parallel_layout.h): rank r holds experts [r E/e, (r+1) E/e); size 1 until set.
const TensorParallelGroup& expert_parallel_group();
/// The ranks that hold the same experts (Megatron's expert-data-parallel group: world / (etp e p)
/// ranks); expert gradients are summed over it. Size 1 until set.
const TensorParallelGroup& expert_data_parallel_group();
/// The expert tensor- and expert-parallel ranks together (t e adjacent ranks; Megatron's
/// tensor-and-expert-parallel group): what the all-gather token dispatcher gathers over.
const TensorParallelGroup& tensor_and_expert_parallel_group();
void set_expert_parallel_groups(TensorParallelGroup ep, TensorParallelGroup edp,
                                TensorParallelGroup tp_ep);

/// The ranks of this rank's pipeline (Megatron's pipeline-model-parallel group): rank i of it
/// runs pipeline stage i. Size 1 until set.
const TensorParallelGroup& pipeline_parallel_group();
/// The first and last stage of this rank's pipeline (Megatron's embedding group), which keep the
/// tied word embedding and output layer in sync; size 1 (no process group) on the other stages
/// and without pipeline parallelism.
const TensorParallelGroup& embedding_group();
void set_pipeline_parallel_groups(TensorParallelGroup pp, TensorParallelGroup embedding);

// ---- collectives on any group (x itself for size 1); inputs are not modified -----------------

/// Waits for a collective and then, briefly (at most 200 ms), for Gloo to drop its reference to
/// the work, so the buffers it used are freed when this returns (Note [Collective buffers] in
/// tensor_parallel.cpp). Every collective of actmem waits this way.
void wait_and_release(c10::intrusive_ptr<c10d::Work> work);

/// Sum of x over `group`; bf16 summed in fp32 as all_reduce_sum does.
at::Tensor group_all_reduce_sum(const TensorParallelGroup& group, const at::Tensor& x);
/// An all-reduce started and not yet waited for (start_group_all_reduce_sum).
class PendingAllReduce {
 public:
  // Out of line: c10d::Work is only declared here.
  PendingAllReduce();
  ~PendingAllReduce();
  PendingAllReduce(PendingAllReduce&&) noexcept;
  PendingAllReduce& operator=(PendingAllReduce&&) noexcept;
  PendingAllReduce(const PendingAllReduce&) = delete;
  PendingAllReduce& operator=(const PendingAllReduce&) = delete;
  /// Waits for the collective (wait_and_release) and returns the group's sum, in x's type.
  at::Tensor wait();
  bool pending() const { return static_cast<bool>(work_); }

 private:
  friend PendingAllReduce start_group_all_reduce_sum(const TensorParallelGroup&, const at::Tensor&);
  c10::intrusive_ptr<c10d::Work> work_;
  at::Tensor buffer_;
};
/// group_all_reduce_sum without waiting: the collective runs on the process group's own thread
/// (Gloo) or stream (NCCL) while the caller goes on; x is copied first, so the caller may change
/// it. With size 1 the result is x itself.
PendingAllReduce start_group_all_reduce_sum(const TensorParallelGroup& group, const at::Tensor& x);
/// Every rank's x (same shape everywhere) concatenated along dim 0 in group-rank order.
at::Tensor group_all_gather_dim0(const TensorParallelGroup& group, const at::Tensor& x);
/// This rank's 1/size slice along dim 0, as a new tensor.
at::Tensor group_split_dim0(const TensorParallelGroup& group, const at::Tensor& x);
/// This rank's 1/size dim-0 slice of the group's sum (Note [Reduce-scatter on Gloo]).
at::Tensor group_reduce_scatter_dim0(const TensorParallelGroup& group, const at::Tensor& x);
/// Uneven all-gather: rank r contributes sizes[r] rows (x is this rank's); the result holds
/// every rank's rows in rank order (Note [Uneven all-gather on Gloo] in tensor_parallel.cpp).
at::Tensor group_all_gather_v(const TensorParallelGroup& group, const at::Tensor& x,
                              const std::vector<int64_t>& sizes);
/// Uneven reduce-scatter, group_all_gather_v's reverse: x holds sum(sizes) rows; the result is
/// this rank's sizes[rank] rows of the group's sum.
at::Tensor group_reduce_scatter_v(const TensorParallelGroup& group, const at::Tensor& x,
                                  const std::vector<int64_t>& sizes);

/// Under `actmem launch` (WORLD_SIZE > 1): joins the c10d process group of all workers (Gloo, or
/// NCCL for a CUDA device). With `tensor_parallel_size` t (0: the whole launch) and
/// `pipeline_parallel_size` p the world is t x d x p in Megatron's rank order
/// (parallel_layout.h): this rank's tensor-parallel group of t adjacent ranks, its data-parallel
/// group of d, its pipeline of p and (first and last stages) its embedding group are built on the
/// launch's store, and with `expert_parallel_size` e its expert-parallel group of e and
/// expert-data-parallel group of world / (t e p) (the expert tensor-parallel size is t,
/// Megatron's default). A no-op in a single process.
const TensorParallelGroup& init_tensor_parallel_from_environment(
    const DistEnv& env, const c10::Device& device = c10::kCPU, int tensor_parallel_size = 0,
    int expert_parallel_size = 1, int pipeline_parallel_size = 1,
    std::chrono::milliseconds timeout = kDefaultDistributedTimeout);

/// Drops the process groups (tensor, data, expert and pipeline parallel: size 1 again).
void reset_tensor_parallel_group();

/// init_tensor_parallel_from_environment for the object's lifetime, then
/// reset_tensor_parallel_group(): commands hold one, so a NCCL group is torn down while the CUDA
/// runtime is still alive rather than in static destruction.
class TensorParallelSession {
 public:
  TensorParallelSession(const DistEnv& env, const c10::Device& device, int tensor_parallel_size = 0,
                        int expert_parallel_size = 1, int pipeline_parallel_size = 1,
                        std::chrono::milliseconds timeout = kDefaultDistributedTimeout);
  ~TensorParallelSession();
  TensorParallelSession(const TensorParallelSession&) = delete;
  TensorParallelSession& operator=(const TensorParallelSession&) = delete;
};

// ---- collectives on the tensor-parallel group (identity for size 1) ---------------------------

at::Tensor all_reduce_sum(const at::Tensor& x);
/// Concatenation of every rank's x along dim 0 (x must have the same shape on every rank).
at::Tensor all_gather_dim0(const at::Tensor& x);
/// This rank's 1/size slice of the rank-wise sum, along dim 0 (dim 0 divisible by size).
at::Tensor reduce_scatter_dim0(const at::Tensor& x);
/// This rank's 1/size slice along dim 0, as a new tensor (not a view).
at::Tensor split_dim0(const at::Tensor& x);

// ---- autograd mappings (Megatron's tensor_parallel/mappings.py) ------------------------------

at::Tensor copy_to_tensor_parallel_region(const at::Tensor& x);
at::Tensor reduce_from_tensor_parallel_region(const at::Tensor& x);
at::Tensor scatter_to_sequence_parallel_region(const at::Tensor& x);
/// tensor_parallel_output_grad: the consumer is tensor-parallel (its gradient is a partial sum
/// to reduce-scatter); false when it is replicated (each rank holds the full gradient: split).
at::Tensor gather_from_sequence_parallel_region(const at::Tensor& x,
                                                bool tensor_parallel_output_grad = true);
at::Tensor reduce_scatter_to_sequence_parallel_region(const at::Tensor& x);

// ---- parallel linear layers ------------------------------------------------------------------

/// ColumnParallelLinear: weight [out/t, in] (and bias [out/t]) hold this rank's output columns.
/// Without sequence parallelism x is the replicated [s, b, in] (copied into the region); with
/// it x is this rank's [s/t, b, in] shard, all-gathered in forward and again in backward, so
/// only the shard is saved (Megatron's LinearWithGradAccumulationAndAsyncCommunication).
at::Tensor column_parallel_linear(const at::Tensor& x, const at::Tensor& weight,
                                  const at::Tensor& bias, bool sequence_parallel);
/// RowParallelLinear without its bias (skip_bias_add): x [s, b, in/t] -> all-reduced [s, b, out],
/// or with sequence parallelism reduce-scattered to [s/t, b, out].
at::Tensor row_parallel_linear(const at::Tensor& x, const at::Tensor& weight,
                               bool sequence_parallel);

// ---- distribute_saved_activations (Megatron's CheckpointFunction, random.py) ------------------

/// This rank's contiguous 1/size chunk of x flattened, in a new buffer (Megatron's
/// split_tensor_into_1d_equal_chunks(new_buffer=True)); x.numel() must divide by the size.
at::Tensor split_tensor_into_1d_equal_chunks(const at::Tensor& x);
/// The inverse: all-gathers the chunks into a new [size * chunk.numel()] tensor.
at::Tensor gather_split_1d_tensor(const at::Tensor& chunk);

}  // namespace actmem
