// trainer.h — the training loop: AdamW, micro-batches with gradient accumulation, validation,
// and the per-iteration measurements every later mechanism is judged by.
//
// Memory is measured with the device tracker (memory_tracker.h). Gradients are allocated once at
// construction, so activation measurements never include first-touch gradient allocations.
#pragma once

#include "actmem/config.h"
#include "actmem/data.h"
#include "actmem/memory_tracker.h"
#include "actmem/model.h"
#include "actmem/rng.h"

#include <nlohmann/json_fwd.hpp>

#include <functional>
#include <map>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>

namespace torch::optim {
class AdamW;
}

namespace actmem {

class ActivationLedger;
class ActivationOffloader;
class OutputFile;
class TraceRecorder;

/// The emulated host link's range (GB/s per direction) when it is capped: below the minimum a
/// copy of a few MiB takes minutes; above the maximum the cap cannot be told from none.
constexpr double kMinOffloadBandwidthGbps = 0.01;
constexpr double kMaxOffloadBandwidthGbps = 1e5;

/// Optimisation and data settings (Megatron's names where it has them).
struct TrainingConfig {
  /// 0 means micro_batch_size (one micro-batch per step).
  int64_t global_batch_size = 0;
  int64_t train_iters = 200;
  double lr = 3e-3;
  double min_lr = 3e-4;
  int64_t lr_warmup_iters = 10;
  /// "constant", "linear" or "cosine" (from lr after warmup down to min_lr at train_iters).
  std::string lr_decay_style = "cosine";
  double weight_decay = 0.01;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.95;
  double adam_eps = 1e-8;
  /// Global gradient-norm clip; 0 disables.
  double clip_grad = 1.0;
  /// Validation every eval_interval iterations over eval_iters fixed micro-batches; 0 disables.
  int64_t eval_interval = 50;
  int64_t eval_iters = 4;
  int64_t log_interval = 20;
  /// Text file to train on; empty means the built-in corpus.
  std::string data_path;
  std::string split = "95,5";
  /// "cpu" or "cuda[:i]".
  std::string device = "cpu";
  /// Device-memory limit in bytes (CPU tracker only); 0 means the machine's physical memory.
  int64_t device_memory_limit = 0;
  /// Emulated host-link bandwidth for offload copies, GB/s per direction; 0 = uncapped,
  /// otherwise in [kMinOffloadBandwidthGbps, kMaxOffloadBandwidthGbps].
  double offload_bandwidth_gbps = 0.0;

  int64_t num_microbatches(int64_t micro_batch_size) const {
    return (global_batch_size > 0 ? global_batch_size : micro_batch_size) / micro_batch_size;
  }
  /// Throws a clear error for inconsistent values (given the model's micro-batch size).
  void validate(const TransformerConfig& model) const;
};

/// Everything measured in one optimizer step.
struct IterationStats {
  int64_t iteration = 0;
  double loss = 0.0;           // mean over micro-batches
  double grad_norm = 0.0;      // global L2 norm before clipping
  std::string grad_digest;     // bytes of every parameter gradient, before the optimizer step
  double lr = 0.0;
  double step_time_s = 0.0;    // forward, backward and optimizer step of all micro-batches
  double tokens_per_s = 0.0;
  int64_t peak_device_bytes = 0;      // tracker peak during the step
  int64_t activation_bytes = 0;       // held at end of forward minus held before it (max over micro-batches)
  int64_t activation_peak_bytes = 0;  // peak during forward+backward minus held before forward (max)
  int64_t predicted_activation_bytes = 0;  // the exact predictor for this config (memory_model.h)
  int64_t offloaded_bytes = 0;   // device bytes copied to host this step (offload)
  int64_t host_peak_bytes = 0;   // peak host-buffer bytes in use this step
  double offload_wait_s = 0.0;   // time the compute waited for reloads this step
  double offload_copy_s = 0.0;   // copy-engine busy time this step, both directions
  // With tensor parallelism (t > 1), every rank's values, gathered to all ranks (rank order):
  std::vector<std::string> grad_digest_per_rank;       // when digests are computed
  std::vector<int64_t> activation_bytes_per_rank;
  std::vector<int64_t> activation_peak_bytes_per_rank;
  std::vector<int64_t> peak_device_bytes_per_rank;
  std::optional<double> val_loss;     // when validation ran after this step
};

/// One JSON object with the fields above; doubles round-trip exactly.
nlohmann::json to_json(const IterationStats& stats);
/// Every field of the training config under its flag's name (data_path as "data").
nlohmann::json to_json(const TrainingConfig& config);

/// An upper bound of the device bytes a training step of this configuration holds at its peak:
/// parameters, gradients, AdamW state, one micro-batch's activations in fp32 and the transient
/// buffers of its backward. The Trainer refuses a configuration above its device-memory limit
/// before allocating anything, so a run that starts does not fail later for memory.
double estimate_required_bytes(const TransformerConfig& model, int64_t dtype_bytes = 4);

class Trainer {
 public:
  /// Validates both configs, checks the model fits the device memory limit, loads the corpus and
  /// builds the model. Its dropout stream starts from model.seed (see rng_state()).
  Trainer(const TransformerConfig& model, const TrainingConfig& training);
  ~Trainer();

  /// One optimizer step (all micro-batches). compute_digest=false skips the gradient digest;
  /// under tensor parallelism every rank must pass the same value (it gathers the digests).
  /// Throws, before the optimizer step changes anything, when the loss or the gradient norm is
  /// not finite (training diverged; Megatron checks the gradient norm for NaN the same way).
  IterationStats train_step(bool compute_digest = true);
  /// Mean validation loss over eval_iters fixed micro-batches, in eval mode without grad.
  double evaluate();
  /// Where run() reports; every member is optional.
  struct RunOutput {
    std::ostream* progress = nullptr;  // progress lines, validation, the offload summary
    std::ostream* warnings = nullptr;  // "warning: ..." lines (e.g. an offload that moves nothing)
    /// The second step (the first after offload's warmup; the first if there is only one) is
    /// written here as a Chrome trace; opened by the caller before the run.
    OutputFile* trace = nullptr;
  };
  /// train_iters steps with `on_step` per step and validation every eval_interval. Stops with a
  /// c10::Error naming the iteration when the loss or the gradient norm is not finite (see
  /// train_step()).
  void run(const RunOutput& out, const std::function<void(const IterationStats&)>& on_step,
           bool compute_digest = true);

  GPTModel& model() { return *model_; }
  const Corpus& corpus() const { return corpus_; }
  int64_t iteration() const { return iteration_; }
  DeviceMemory& memory() { return memory_; }
  const at::Device& device() const { return device_; }
  /// Records the saved tensors of the first micro-batch's forward of each following step into
  /// `ledger` (cleared per step; parameters, buffers and the batch excluded). nullptr stops.
  void set_ledger(ActivationLedger* ledger) { ledger_ = ledger; }
  /// Records the next train_step() as a Chrome trace into `recorder` (compute spans per layer
  /// forward and backward, and the copy streams' spans); nullptr stops.
  void set_trace(TraceRecorder* recorder) { trace_ = recorder; }
  /// This trainer's dropout stream: the default generators' states between its steps.
  const std::vector<at::Tensor>& rng_state() const { return rng_state_; }
  /// The layer-level offloader (null without cpu_offloading_num_layers).
  ActivationOffloader* offloader() { return offloader_.get(); }
  /// The timeline of the last step's first micro-batch when record_timeline(true) was set.
  void record_timeline(bool on) { record_timeline_ = on; }
  const MemoryTimeline& last_timeline() const { return *timeline_; }

 private:
  double lr_at(int64_t iteration) const;
  TransformerConfig model_config_;
  TrainingConfig config_;
  at::Device device_;
  DeviceMemory& memory_;
  Corpus corpus_;
  std::shared_ptr<GPTModel> model_;
  std::vector<at::Tensor> params_;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  std::unique_ptr<BatchSampler> train_sampler_;
  std::unique_ptr<BatchSampler> valid_sampler_;
  std::unique_ptr<MemoryTimeline> timeline_;
  std::unique_ptr<ActivationOffloader> offloader_;
  bool record_timeline_ = false;
  int64_t predicted_activation_bytes_ = 0;
  ActivationLedger* ledger_ = nullptr;
  TraceRecorder* trace_ = nullptr;
  // Note [Trainer RNG stream]: see trainer.cpp.
  std::vector<at::Generator> generators_;  // CPU default, plus the device's default on CUDA
  std::vector<at::Tensor> rng_state_;
  RngStatesTracker tracker_;  // this trainer's named streams (swapped in per step)
  std::vector<bool> tensor_parallel_flags_;           // per params_ entry
  std::vector<at::Tensor> sequence_parallel_params_;
  int64_t iteration_ = 0;
};

struct OffloadSummaryRow;
/// Megatron's "Activation Offload Summary (MB)" table.
void print_offload_summary(std::ostream& os, const std::vector<OffloadSummaryRow>& rows);

/// Median of a non-empty sample (the mean of the middle two for an even count).
double median(std::vector<double> values);

/// Human-readable byte count ("12.3 MiB").
std::string format_bytes(double bytes);

}  // namespace actmem
