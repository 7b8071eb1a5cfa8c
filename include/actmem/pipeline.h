// pipeline.h — pipeline parallelism's communication and schedules on c10d: point-to-point sends
// and receives of activations and their gradients between neighbouring stages (Megatron's
// megatron/core/pipeline_parallel/p2p_communication.py) and the 1F1B schedule
// (forward_backward_pipelining_without_interleaving in megatron/core/pipeline_parallel/
// schedules.py). The schedule knows nothing of models: it calls back for each micro-batch's
// forward and backward and moves what they return (docs/parallelism.md, "Pipeline parallelism").
#pragma once

#include "actmem/tensor_parallel.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace actmem {

/// Sends and receives between neighbouring stages of a pipeline group. Every tensor crossing a
/// stage boundary has the same shape and type (Megatron's tensor_shape: [s/t or s, b, h] in the
/// parameters' type), known up front, so receives need no size exchange.
class PipelineP2P {
 public:
  /// `pipeline` must outlive this object (the process-wide groups do).
  PipelineP2P(const TensorParallelGroup& pipeline, std::vector<int64_t> shape,
              at::TensorOptions options);
  int stage() const { return group_->rank; }
  int stages() const { return group_->size; }
  bool is_first() const { return group_->rank == 0; }
  bool is_last() const { return group_->rank == group_->size - 1; }
  /// Bytes of one tensor crossing a stage boundary.
  int64_t bytes() const;
  /// Megatron's _communicate: posts every requested send and receive at once, then waits for all
  /// of them (so two neighbours exchanging in both directions cannot deadlock). Sends to the
  /// next stage carry activations, sends to the previous one gradients. Returns (from previous,
  /// from next); undefined where nothing was asked or the neighbour does not exist.
  std::pair<at::Tensor, at::Tensor> communicate(const at::Tensor& send_next,
                                                const at::Tensor& send_prev, bool recv_prev,
                                                bool recv_next) const;
  at::Tensor recv_forward() const { return communicate({}, {}, true, false).first; }
  at::Tensor recv_backward() const { return communicate({}, {}, false, true).second; }
  void send_forward(const at::Tensor& x) const { communicate(x, {}, false, false); }
  void send_backward(const at::Tensor& g) const { communicate({}, g, false, false); }
  at::Tensor send_forward_recv_backward(const at::Tensor& x) const {
    return communicate(x, {}, false, true).second;
  }
  at::Tensor send_backward_recv_forward(const at::Tensor& g) const {
    return communicate({}, g, true, false).first;
  }

 private:
  const TensorParallelGroup* group_;  // the process-wide group (pipeline_parallel_group())
  std::vector<int64_t> shape_;
  at::TensorOptions options_;
};

/// One micro-batch's forward on this stage: its input from the previous stage (undefined on the
/// first) -> what goes to the next stage (ignored on the last).
using PipelineForward = std::function<at::Tensor(int64_t microbatch, const at::Tensor& input)>;
/// One micro-batch's backward: the gradient of its output from the next stage (undefined on the
/// last) -> the gradient of its input for the previous stage (ignored on the first).
using PipelineBackward =
    std::function<at::Tensor(int64_t microbatch, const at::Tensor& output_grad)>;

/// The micro-batches in flight on `stage` of `stages` at the 1F1B peak: min(stages - stage,
/// micro-batches) (Megatron's num_warmup_microbatches + 1, Korthikanti et al. 2022 sec. 4.2.3).
int64_t one_f_one_b_in_flight(int64_t stage, int64_t stages, int64_t num_microbatches);

/// Megatron's 1F1B: warmup forwards (stages - stage - 1 of them), then one forward and one
/// backward alternating, then the remaining backwards; backwards run in micro-batch order.
/// With forward_only, every micro-batch's forward in order and no backward (validation).
void run_one_f_one_b(const PipelineP2P& p2p, int64_t num_microbatches,
                     const PipelineForward& forward, const PipelineBackward& backward,
                     bool forward_only = false);

}  // namespace actmem
