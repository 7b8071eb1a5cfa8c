// batch_schedule.h — the global batch size of every optimizer step: one size for the whole run,
// or Megatron's --step-batch-size-schedule, which raises it as training consumes samples
// (StepBatchsizeNumMicroBatchesCalculator in megatron/core/num_microbatches_calculator.py;
// docs/train.md, "Global batch size schedule").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace actmem {

/// The global batch of a step is a function of the samples consumed before it. A step's batch
/// is decided once, when the step starts: a step that crosses a threshold finishes at its batch
/// size, the next one runs at the new size (Megatron's update_num_microbatches before each
/// train_step).
class GlobalBatchSchedule {
 public:
  struct Entry {
    int64_t from_sample = 0;  // the entry applies once this many samples are consumed
    int64_t batch_size = 0;
  };

  /// One batch size for the whole run.
  explicit GlobalBatchSchedule(int64_t batch_size);
  /// Megatron's schedule text "THRESHOLD:BS THRESHOLD:BS ..." (commas also separate entries):
  /// thresholds in tokens, converted to samples by `threshold // seq_length` as Megatron does
  /// (it always passes --seq-length); both numbers may carry K, M, B or T (10^3 ... 10^12,
  /// either case) and be decimals ("2.4B", "1e4"): int(float(number) x suffix). Entries are
  /// sorted by threshold. Throws, naming the entry, for Megatron's refusals (no entries, an
  /// entry without ':', a number that is not one, a first threshold other than 0, thresholds not
  /// strictly increasing in samples, a batch size below 1) and for two of its run-time assertions
  /// made here before the run: a negative threshold, and a batch size that decreases (Megatron's
  /// train loop asserts the number of micro-batches never does).
  static GlobalBatchSchedule parse(const std::string& text, int64_t seq_length);

  /// True for a parsed schedule (even of one entry), false for one batch size: Megatron's
  /// --train-samples rounds the iterations down with one size and up with a schedule.
  bool stepped() const { return stepped_; }
  const std::vector<Entry>& entries() const { return entries_; }
  /// The batch size of a step that starts with `consumed_samples` consumed.
  int64_t at(int64_t consumed_samples) const;
  /// The largest batch size of any entry.
  int64_t largest() const;
  /// Samples consumed after `steps` steps that start at `from_samples`.
  int64_t samples_after(int64_t steps, int64_t from_samples = 0) const;
  /// Megatron's update_train_iters for --train-samples from sample 0: with one size
  /// train_samples // size (the last partial batch is not run); with a schedule the steps until
  /// at least train_samples are consumed (the last step may pass it).
  int64_t iterations_for(int64_t train_samples) const;
  /// The batch sizes `steps` steps starting at `from_samples` run at, in order, each once.
  std::vector<int64_t> sizes_used(int64_t steps, int64_t from_samples) const;

 private:
  GlobalBatchSchedule() = default;
  // The index of the entry in effect at `consumed_samples`.
  size_t entry_at(int64_t consumed_samples) const;
  std::vector<Entry> entries_;
  bool stepped_ = false;
};

}  // namespace actmem
