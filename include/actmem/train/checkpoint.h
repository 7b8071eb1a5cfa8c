// checkpoint.h — checkpoints in Megatron-LM's layout (megatron/training/checkpointing.py):
//
//   DIR/latest_checkpointed_iteration.txt            "100" (no newline), written last
//   DIR/iter_0000100/mp_rank_00/model_optim_rng.pt   one file per tensor-parallel rank
//
// Each file is a torch pickle (libtorch's torch::pickle_save: the zip archive torch.save
// writes), so Python's torch.load reads it as a dict with Megatron's keys: args,
// checkpoint_version (3.0), iteration, model (Megatron's parameter names -> tensors), optimizer,
// opt_param_scheduler and rng_state. What Trainer::save_checkpoint writes, and how a crash
// during a save is survived, is Note [Checkpoint protocol] in checkpoint.cpp; docs/checkpoints.md
// is the user's guide.
#pragma once

#include <ATen/core/ivalue.h>
#include <nlohmann/json_fwd.hpp>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace actmem {

/// The file naming the newest complete checkpoint of a directory.
inline constexpr const char* kLatestCheckpointFile = "latest_checkpointed_iteration.txt";
/// Megatron's checkpoint_version of the files written here.
inline constexpr double kCheckpointVersion = 3.0;

/// DIR/iter_0000100 (seven digits, as Megatron's get_checkpoint_name).
std::string checkpoint_iteration_dir(const std::string& dir, int64_t iteration);
/// DIR/iter_0000100/mp_rank_03/model_optim_rng.pt: tensor-parallel rank 3's file; with expert
/// parallelism (ep_rank >= 0) DIR/iter_0000100/mp_rank_03_001/model_optim_rng.pt for expert-
/// parallel rank 1; with pipeline parallelism (pp_rank >= 0) mp_rank_03_002 for stage 2, and
/// mp_rank_03_002_001 with both (Megatron's get_checkpoint_name).
std::string checkpoint_file(const std::string& dir, int64_t iteration, int64_t tp_rank,
                            int64_t ep_rank = -1, int64_t pp_rank = -1);

/// The iteration DIR/latest_checkpointed_iteration.txt names; nullopt when the file does not
/// exist. Throws for a file that is not a non-negative iteration number ("release" checkpoints
/// of converted models are not supported).
std::optional<int64_t> read_latest_checkpointed_iteration(const std::string& dir);

/// Reads a checkpoint file as a dict; throws naming the path when it is missing, truncated or
/// not a torch pickle of a dict.
c10::impl::GenericDict read_checkpoint_file(const std::string& path);

/// JSON values as pickled Python values (null -> None, objects -> dicts with string keys,
/// arrays -> lists) and back; what the args entry of a checkpoint holds.
c10::IValue json_to_ivalue(const nlohmann::json& value);
nlohmann::json ivalue_to_json(const c10::IValue& value);

class GPTModel;
struct TransformerConfig;

/// Copies a checkpoint's "model" entry into `model`, strictly: every parameter present with its
/// shape and type, no parameter the model lacks. Throws naming the parameter and `path`.
void load_model_state(GPTModel& model, const c10::impl::GenericDict& checkpoint,
                      const std::string& path);

/// A model rebuilt from a checkpoint for inference (`actmem generate`): the config its args
/// record (shape, vocabulary, positions, precision; no recompute or offload), the model with its
/// weights in eval mode, and the args themselves (tokenizer, iteration).
struct LoadedModel {
  std::shared_ptr<GPTModel> model;
  std::string args_json;  // the checkpoint's args, as JSON text
  int64_t iteration = 0;
  std::string path;
};
/// Loads DIR's latest checkpoint (tensor-parallel size 1). Throws when DIR has none.
LoadedModel load_model_for_inference(const std::string& dir);
/// The config fields of a checkpoint's args (the inverse of to_json(TransformerConfig) for the
/// fields that decide the model); memory settings are left at their defaults.
TransformerConfig config_from_args(const nlohmann::json& args);

/// What Trainer::load_checkpoint restores (Megatron's --no-load-optim, --no-load-rng,
/// --finetune, --override-opt_param-scheduler).
struct CheckpointLoadOptions {
  /// The optimizer state (moments, fp32 main parameters, loss scaler) and the learning-rate
  /// schedule. Without it the schedule starts again from its first step, as in Megatron.
  bool optimizer = true;
  /// Every random state (the default generators and the tracker's named streams).
  bool rng = true;
  /// Model weights only: iteration, data position, optimizer and random states start afresh.
  bool finetune = false;
  /// Use this run's learning-rate settings where the checkpoint's differ (otherwise refused).
  bool override_scheduler = false;
};

class BatchSource;
class Optimizer;
class OptimizerParamScheduler;
class RngStatesTracker;
struct TrainingConfig;

/// What a checkpoint saves of a run and restores into it: Megatron's save_checkpoint(iteration,
/// model, optimizer, opt_param_scheduler) with the data position and the random streams. The
/// training run's parts, by reference (Trainer::train_state()).
struct TrainState {
  const TransformerConfig& model_config;
  const TrainingConfig& config;
  const at::Device& device;
  GPTModel& model;
  Optimizer& optimizer;
  OptimizerParamScheduler& scheduler;
  BatchSource& train_data;  // its position: the samples consumed
  int64_t& iteration;
  std::vector<at::Tensor>& rng_state;  // the default generators' (CPU, then the device's)
  RngStatesTracker& rng_tracker;       // the named streams
};

/// The FP8 scaling state of `model`'s GEMMs (fp8.h), by module name
/// ("decoder.layers.0.self_attention.linear_qkv" -> Fp8Gemm::state()): the checkpoint's
/// "fp8_scaling" entry, so a resumed delayed-scaling run continues with the same scales and
/// amax windows (Megatron keeps them in each TE module's _extra_state). Empty without FP8.
c10::impl::GenericDict fp8_scaling_state(const GPTModel& model);
/// Sets `model`'s FP8 scaling state from a checkpoint's "fp8_scaling" entry; every GEMM of the
/// model must have one.
void load_fp8_scaling_state(GPTModel& model, const c10::impl::GenericDict& state,
                            const std::string& path);

/// Writes the checkpoint of state.iteration into `dir` in Megatron's layout (Note [Checkpoint
/// protocol]); collective over every rank. Returns the iteration directory.
std::string save_checkpoint(const std::string& dir, const TrainState& state);
/// Loads `dir`'s latest checkpoint into `state` (collective). Returns the iteration it holds, or
/// nullopt when `dir` has no latest_checkpointed_iteration.txt (nothing is loaded, as in
/// Megatron). Refuses, naming the field, a checkpoint of another model shape, parallel layout or
/// precision.
std::optional<int64_t> load_checkpoint(const std::string& dir, const TrainState& state,
                                       const CheckpointLoadOptions& options = {});

/// Catches SIGTERM and SIGINT while it lives (Megatron's --exit-signal-handler): the first one
/// is recorded for the training loop to act on after its current step (save, then exit); the
/// handler is then reset, so a second signal ends the process at once. The previous handlers
/// are restored on destruction. One may exist at a time.
class ExitSignalHandler {
 public:
  ExitSignalHandler();
  ~ExitSignalHandler();
  ExitSignalHandler(const ExitSignalHandler&) = delete;
  ExitSignalHandler& operator=(const ExitSignalHandler&) = delete;
  /// The signal received (SIGTERM or SIGINT), or 0.
  int received() const;
};

}  // namespace actmem
