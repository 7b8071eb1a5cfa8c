// train_options.h — the command-line flags shared by every subcommand that builds a model
// (Megatron's names), bound to TransformerConfig and TrainingConfig.
#pragma once

#include "actmem/config.h"
#include "actmem/trainer.h"

#include <string>

namespace CLI {
class App;
class Validator;
}

namespace actmem {

/// Values bound to the flags; parse into this, then call finalize().
struct TrainOptions {
  TransformerConfig model;
  TrainingConfig training;
  std::string log_json;          // --log-json FILE ("" = none)
  std::string trace;             // --trace FILE ("" = none): Chrome trace of one iteration
  std::string normalization_flag = "LayerNorm";
  bool swiglu = false;
  bool disable_bias_linear = false;
  bool untie = false;
  bool use_rope = false;
  bool recompute_activations = false;   // legacy: = --recompute-granularity selective
  bool checkpoint_activations = false;  // removed flag: refused with Megatron's message
  double device_memory_limit_gib = 0.0;
  /// Intra-op threads for libtorch; 0 means one per core.
  int threads = 0;
  /// Applies the derived fields (flags that map onto config fields) and validates everything.
  void finalize();
};

/// Adds the model-shape flags (--num-layers, --hidden-size, ...).
void add_model_flags(CLI::App& app, TrainOptions& options);
/// Adds the optimisation and data flags (--train-iters, --lr, --data, ...).
void add_training_flags(CLI::App& app, TrainOptions& options);

/// A CLI11 validator: "expected a positive number, got 'x'".
const CLI::Validator& positive_number_validator();

/// Sets libtorch's intra-op threads: `threads`, or one per core when 0. Returns the count.
int apply_thread_count(int threads);

}  // namespace actmem
