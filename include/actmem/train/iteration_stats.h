// iteration_stats.h — what a training step measured, gathered over the ranks for the log and the
// JSON record (IterationStats and its to_json in trainer.h): the Trainer's collaborator for the
// step's statistics, as RunLoop (run_loop.h) is for the loop.
#pragma once

#include "actmem/base/pipeline_event.h"
#include "actmem/config/config.h"
#include "actmem/model/moe/moe.h"
#include "actmem/train/trainer.h"

#include <c10/core/Device.h>

#include <cstdint>
#include <vector>

namespace actmem {

class MemoryTimeline;
class TraceRecorder;
struct TensorParallelGroup;

class StepStatistics {
 public:
  StepStatistics(const TransformerConfig& model, const at::Device& device);
  /// The step's loss (`loss_sum`, the micro-batches' mean) and the MoE layers' statistics `moe`
  /// over the ranks, for the log: summed over the tensor ranks (each routed its own tokens under
  /// sequence parallelism), every stage's layers on every stage, the loss and auxiliary losses
  /// averaged over the data-parallel ranks and their token counts summed (collective).
  void finish_forward_backward(IterationStats& st, double loss_sum, MoEStats moe) const;
  /// With tensor parallelism, every rank's gradient digest (when computed) and activation bytes
  /// (collective).
  void gather_rank_stats(IterationStats& st, bool compute_digest) const;
  /// The step's time (`busy_s`) and peak, every rank's peak with tensor parallelism, and under a
  /// pipeline every stage's memory and its `schedule` of events (collective).
  void finish(IterationStats& st, double busy_s, int64_t peak,
              const std::vector<PipelineEvent>& schedule) const;

 private:
  // Every stage's schedule into st.pipeline_schedule_per_stage (on every stage).
  void gather_schedule(IterationStats& st, const TensorParallelGroup& pp,
                       const std::vector<PipelineEvent>& schedule) const;
  TransformerConfig model_config_;
  at::Device device_;
};

/// The compute spans between consecutive marks of `timeline` (the first micro-batch's) as
/// `trace`'s "compute" track.
void trace_timeline(const MemoryTimeline& timeline, TraceRecorder& trace);

}  // namespace actmem
