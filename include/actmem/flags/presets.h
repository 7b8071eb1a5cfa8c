// presets.h — one description of a model for the commands that estimate or plan it rather than
// run it: named presets as Megatron command lines, and the paper's view derived from the flags
// train shares (Note [One model description] in memory_model.cpp).
#pragma once

#include "actmem/flags/train_options.h"
#include "actmem/memory/memory_model.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace CLI {
class App;
class Option;
}  // namespace CLI

namespace actmem {

/// The named models: "7b" (a 7B worked example: s 4096, b 2, h 4096, a 32, L 32, ffn 14336
/// (SwiGLU), untied, TP 2 with SP, PP 2; docs/memory-model.md), Korthikanti et al. 2022's
/// Table 3 ("22b", "175b", "530b", "1t"), and open models at their published shapes on one
/// rank ("llama3-8b", "llama3-70b", "mixtral-8x7b", "deepseek-v3"; sources in presets.cpp).
std::vector<std::string> model_preset_names();
/// A preset as the flags that describe it (Megatron's names). Throws for an unknown name,
/// listing the known ones.
std::vector<std::string> model_preset_arguments(const std::string& name);

/// Note [Presets are command lines]
/// `--preset NAME` stands for the preset's flags, placed ahead of the command's own so that a
/// flag given replaces the preset's (Note [Last value wins] in src/cli/main.cpp), its negation
/// (--no-swiglu, --tie-embeddings-and-output-weights, --no-sequence-parallel) included, and the
/// interleaving given in either spelling (layers per virtual stage or chunks per rank) replaces
/// the preset's. For
/// `estimate`, which has a default model, a command line naming no preset and no size stands for
/// `--preset 7b`. `args` is a command line without the program name, the subcommand first;
/// commands other than estimate, plan and train, and unknown names (refused by the --preset option
/// itself), are returned unchanged.
std::vector<std::string> expand_model_preset(std::vector<std::string> args);

/// The --preset option with its check (an unknown name lists the known ones).
CLI::Option* add_preset_option(CLI::App& app, std::string& preset, const std::string& help);

/// The flags a preset's description adds to the model's (the layout train takes from the launch,
/// and the expert tensor size train does not implement).
struct DescribedLayout {
  int64_t data_parallel_size = 1;
  /// --num-microbatches: micro-batches per step (exclusive with --global-batch-size).
  std::optional<int64_t> num_microbatches;
  /// --expert-tensor-parallel-size: each expert split this many ways (unset: t).
  std::optional<int64_t> expert_tensor_parallel_size;
};
/// Registers --data-parallel-size, --num-microbatches and --expert-tensor-parallel-size, and
/// --global-batch-size and --use-distributed-optimizer unless `optimizer_flags_registered`.
void add_described_layout_flags(CLI::App& app, TrainOptions& options, DescribedLayout& layout,
                                bool optimizer_flags_registered);

/// The model the flags describe, as the paper sees it: options.finalize() (every rule train
/// applies), the paper's limits (even pipeline stages, groups of p micro-batches), then
/// paper_shape() with the layout's d, micro-batches (Megatron's batch rules,
/// check_batch_layout), distributed optimizer and expert tensor size. `api` names the command
/// in errors.
PaperShape describe_model(TrainOptions& options, const DescribedLayout& layout, const char* api);

/// A preset's options alone, finalized.
TrainOptions preset_options(const std::string& name);
/// paper_shape() of a preset (its d = 1).
PaperShape paper_preset(const std::string& name);

}  // namespace actmem
