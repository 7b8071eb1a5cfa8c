// train_options.h — the command-line flags shared by every subcommand that builds a model
// (Megatron's names), bound to TransformerConfig and TrainingConfig.
#pragma once

#include "actmem/config/config.h"
#include "actmem/train/trainer.h"

#include <string>
#include <utility>
#include <vector>

namespace CLI {
class App;
class Validator;
}  // namespace CLI

namespace actmem {

/// Values bound to the flags; parse into this, then call finalize().
struct TrainOptions {
  TransformerConfig model;
  TrainingConfig training;
  std::string preset;         // --preset NAME (expanded into its flags before parsing)
  std::string log_json;       // --log-json FILE ("" = none)
  std::string trace;          // --trace FILE ("" = none): Chrome trace of one iteration
  std::string pipeline_plot;  // --pipeline-plot FILE ("" = none): SVG of the last step's schedule
  /// Megatron's TensorBoard flags (--tensorboard-dir DIR, "" = none; docs/train.md).
  struct TensorBoard {
    std::string dir;
    int64_t log_interval = 1;
    int64_t queue_size = 1000;
    bool log_timers = false;
    bool log_validation_ppl = false;
    bool log_world_size = false;
    bool log_memory = false;  // --log-memory-to-tensorboard
    bool log_loss_scale = true;
  } tensorboard;
  std::string normalization_flag = "LayerNorm";
  bool swiglu = false;
  bool disable_bias_linear = false;
  bool untie = false;
  bool use_rope = false;
  bool no_position_embedding = false;   // --no-position-embedding (Megatron's deprecated switch)
  std::string position_embedding_type;  // --position-embedding-type ("" = not given)
  bool group_query_attention =
      false;  // --group-query-attention; the groups: model.num_query_groups
  bool recompute_activations = false;   // legacy: = --recompute-granularity selective
  bool checkpoint_activations = false;  // removed flag: refused with Megatron's message
  double device_memory_limit_gib = 0.0;
  bool vocab_size_given = false;  // --vocab-size on the command line (exclusive with a tokenizer)
  /// Set when a dynamic-loss-scaling flag (--initial-loss-scale, --min-loss-scale,
  /// --loss-scale-window, --hysteresis) was given: refused unless the run scales dynamically.
  std::string dynamic_scaling_flag;
  /// Set when an offload setting (--fine-grained-offloading-max-inflight-offloads,
  /// --min-offloaded-tensor-size, --offload-bandwidth-gbps) was given: refused unless the run
  /// offloads (--cpu-offloading-num-layers or --fine-grained-activation-offloading).
  std::string offload_setting_flag;
  /// The offload flags are chosen after finalize() (train --memory-budget): the settings above
  /// apply to the plan's offload, if it has one.
  bool offload_planned_later = false;
  /// Intra-op threads for libtorch; 0 means one per core.
  int threads = 0;
  /// Megatron flags actmem accepts without an effect or refuses, as given (megatron_compat.h),
  /// and after finalize() the notice for the accepted ones, a line per flag.
  std::vector<std::pair<std::string, std::string>> megatron_compat_given;
  std::vector<std::string> no_effect_notices;
  /// --train-iters was given (Megatron refuses it with --train-samples).
  bool train_iters_given = false;
  /// --distributed-timeout-minutes: how long a collective waits for a peer (Megatron's 10).
  double distributed_timeout_minutes = 10.0;
  /// Applies the derived fields (flags that map onto config fields) and validates everything.
  void finalize();
};

/// Groups of flags. Each command registers the groups it uses, so a flag it would ignore is an
/// unknown flag there rather than a silent no-op.
enum FlagGroup : unsigned {
  kShapeFlags = 1u << 0,         // --num-layers, --hidden-size, ..., dropout, --seed
  kParallelFlags = 1u << 1,      // --tensor-model-parallel-size, --sequence-parallel, ...
  kRecomputeFlags = 1u << 2,     // --recompute-*, --distribute-saved-activations
  kOffloadFlags = 1u << 3,       // --cpu-offloading-num-layers, --fine-grained-*, bandwidth
  kOptimizerFlags = 1u << 4,     // --lr, --adam-*, --clip-grad, --global-batch-size, ...
  kScheduleFlags = 1u << 5,      // --train-iters, --eval-*, --log-interval
  kDataFlags = 1u << 6,          // --data, --split
  kRuntimeFlags = 1u << 7,       // --device, --device-memory-limit, --threads
  kOutputFlags = 1u << 8,        // --log-json, --trace, --pipeline-plot
  kCheckpointFlags = 1u << 9,    // --save, --load, --save-interval, --exit-signal-handler, ...
  kMoEFlags = 1u << 10,          // --num-experts, --moe-*, --expert-model-parallel-size; MLA's
  kDistributedFlags = 1u << 11,  // --distributed-timeout-minutes (commands that form groups)
  kCompatFlags = 1u << 12,       // Megatron flags accepted without an effect or refused (train)
  kModelFlags = kShapeFlags | kParallelFlags | kMoEFlags | kRecomputeFlags | kOffloadFlags,
  kTrainingFlags = kOptimizerFlags | kScheduleFlags | kDataFlags | kRuntimeFlags | kOutputFlags |
                   kCheckpointFlags | kDistributedFlags | kCompatFlags,
};

/// Adds the flags of `groups` (a FlagGroup mask), bound to `options`.
void add_flags(CLI::App& app, TrainOptions& options, unsigned groups);
/// add_flags(app, options, kModelFlags).
void add_model_flags(CLI::App& app, TrainOptions& options);
/// add_flags(app, options, kTrainingFlags).
void add_training_flags(CLI::App& app, TrainOptions& options);

/// Adds --distributed-timeout-minutes, bound to `minutes` (train, inspect and dist-check).
void add_distributed_timeout_flag(CLI::App& app, double& minutes);

/// A CLI11 validator: "expected a positive number, got 'x'" (finite: inf and nan are refused).
const CLI::Validator& positive_number_validator();
/// A CLI11 validator: an integer in [lo, hi] written in full (no silent overflow or wrap-around:
/// "-1" and "99999999999999999999" are errors for a seed, not two spellings of 2^64 - 1).
CLI::Validator integer_in_range(int64_t lo, int64_t hi);

/// Sets libtorch's intra-op threads: `threads`, or one per core when 0. Throws when `threads`
/// exceeds the cores this process may run on (available_cores()) (more threads than cores only
/// slows the step). Returns the count.
int apply_thread_count(int threads);

}  // namespace actmem
