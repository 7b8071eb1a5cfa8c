// pipeline_event.h — one forward or backward of one micro-batch on one pipeline stage, as the
// schedule ran it: what a step records of its schedule (IterationStats) and what the schedule
// plot draws (plot.h). Kept apart from pipeline.h so neither needs ATen or c10d.
#pragma once

#include <cstdint>

namespace actmem {

/// Times are seconds from the step's start: the moment the earliest stage began its schedule,
/// on the wall clock (one clock for the processes of a node; across nodes as aligned as the
/// nodes' clocks are).
struct PipelineEvent {
  bool forward = true;     // a forward (F) or a backward (B)
  int64_t microbatch = 0;  // which micro-batch of the step
  double start_s = 0.0;
  double end_s = 0.0;
  int64_t chunk = 0;  // the model chunk (virtual stage) under the interleaved schedule
};

}  // namespace actmem
