// run_loop.h — the training loop of Trainer::run (Megatron's train() in
// megatron/training/training.py): the steps from the one after a loaded checkpoint to train_iters,
// the progress log, validation, saves (every save_interval, when the global batch changes, and at
// the end), the Chrome trace of one step, and the exits (a signal, --exit-duration-in-mins,
// --exit-interval). It drives a Trainer through its public interface.
#pragma once

#include "actmem/base/trace.h"
#include "actmem/train/trainer.h"

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <ostream>

namespace actmem {

/// The log's window: steps since the last progress line.
struct LogWindow {
  double time_s = 0.0;
  int64_t steps = 0;
  int64_t skipped = 0;  // Megatron's "number of skipped iterations" per log line
};

/// What the progress line shows besides the step's statistics.
struct ProgressContext {
  int64_t total = 0;                 // the run's last iteration
  std::optional<double> loss_scale;  // with loss scaling
  bool capacity_factor = false;      // MoE with a capacity: the dropped share
  // --log-throughput's model FLOPs of one iteration / world size (else unset).
  std::optional<double> flops_per_rank_step;
  bool per_sequence_balancing = false;  // seq_aux_loss's name for the balancing loss
  bool batch_schedule = false;          // --step-batch-size-schedule: the step's global batch
  // For the ETA: the samples consumed when the run started and after its last step.
  int64_t first_samples = 0, last_samples = 0;
};

class RunLoop {
 public:
  RunLoop(Trainer& trainer, const Trainer::RunOutput& out);
  /// Trainer::run's contract: returns the signal that stopped the run early, or 0.
  int run(const std::function<void(const IterationStats&)>& on_step, bool compute_digest);

 private:
  // The run's bounds, the log's context and the batch schedule's check, before the first step.
  void start();
  // A checkpoint with --save before the first step at a new global batch size.
  void follow_batch_schedule();
  // One train_step, traced when it is the traced iteration.
  IterationStats step(int64_t it, bool compute_digest);
  // The offload summary and warning after the first step.
  void report_first_step(const IterationStats& st);
  // The progress line and the validation line of iteration `it`.
  void log(int64_t it, const IterationStats& st);
  // Megatron's checkpoint_and_decide_exit: the exit code, or nullopt to go on.
  std::optional<int> exit_after(int64_t it);
  // The signal every rank agrees on (0: none).
  int exit_signal() const;
  void save();
  void save_unless_saved();

  Trainer& t_;
  const Trainer::RunOutput& out_;
  std::ostream* progress_;
  int64_t saved_at_;  // a loaded checkpoint need not be saved again
  int64_t first_ = 0, total_ = 0, traced_ = 0, world_ = 1, batch_ = 0;
  std::chrono::steady_clock::time_point run_start_;
  TraceRecorder recorder_;
  LogWindow window_;
  ProgressContext ctx_;
};

}  // namespace actmem
