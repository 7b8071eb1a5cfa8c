// schedules.h — Megatron-LM's forward-backward functions
// (megatron/core/pipeline_parallel/schedules.py: forward_backward_no_pipelining,
// forward_backward_pipelining_without_interleaving and _with_interleaving) as free functions:
// which forward and backward runs when, the loss divided by the micro-batch count and scaled for
// backward, the gradient reduction enabled for each model chunk's last micro-batch, and the
// partial activation checkpoints. What a step measures, offloads and records around each
// computation is a ScheduleObserver's (the Trainer's StepObserver in trainer.cpp).
#pragma once

#include "actmem/parallel/pipeline.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

namespace actmem {

class GPTModel;
class GradReducer;

/// One forward or backward of a schedule.
struct Computation {
  int64_t microbatch = 0;
  int64_t chunk = 0;
  /// The computation that follows it in this stage's order (pipeline_compute_order); null for
  /// the last and without a pipeline.
  const PipelineStep* next = nullptr;
};

/// Called around every computation, in the schedule's order. The default does nothing.
class ScheduleObserver {
 public:
  virtual ~ScheduleObserver() = default;
  /// Before a forward; `received`: its input came from the previous pipeline stage.
  virtual void before_forward(const Computation& c, const at::Tensor& tokens,
                              const at::Tensor& labels, bool received) {}
  /// After a forward (the last stage's loss divided and read), before anything else runs;
  /// `every_layer`: it checkpointed every layer (Note [Partial activation checkpoints]).
  virtual void after_forward(const Computation& c, bool every_layer) {}
  virtual void before_backward(const Computation& c) {}
  virtual void after_backward(const Computation& c) {}
};

/// What the schedules run on.
struct ScheduleSpec {
  GPTModel* model = nullptr;
  int64_t num_microbatches = 1;
  /// Backward from a micro-batch's loss (the optimizer's loss scale applied: Megatron's
  /// grad_scale_func).
  std::function<void(const at::Tensor& loss)> backward_from_loss;
  GradReducer* grad_reducer = nullptr;  // --overlap-grad-reduce, else null
  /// --num-microbatches-with-partial-activation-checkpoints (pipeline schedules only).
  std::optional<int64_t> partial_checkpoints;
  int64_t microbatch_group_size = 1;  // the interleaved schedule's
  /// --calculate-per-token-loss: the model's losses are token sums, backward from them as they
  /// are (Megatron's forward_step_calc_loss divides by neither the tokens nor the micro-batches).
  bool per_token_loss = false;
};

using MicroBatch = std::pair<at::Tensor, at::Tensor>;  // tokens, labels on the device

/// Each micro-batch's forward then its backward; `next_batch()` draws the next micro-batch when
/// its forward is about to run. Returns the sum of the losses / num_microbatches (their mean;
/// with per_token_loss the sum of the token sums).
double forward_backward_no_pipelining(const ScheduleSpec& spec,
                                      const std::function<MicroBatch()>& next_batch,
                                      ScheduleObserver& observer);

/// This stage's share of the 1F1B schedule (one model chunk) or of the interleaved one (several),
/// over the step's `batches` (Note [Pipeline step] in schedules.cpp). Returns this stage's sum
/// of the losses / num_microbatches (0 except on the last stage).
double forward_backward_pipelining(const ScheduleSpec& spec, const PipelineP2P& p2p,
                                   const std::vector<MicroBatch>& batches,
                                   ScheduleObserver& observer);

}  // namespace actmem
