// flag_groups.h — the flag groups train_options.cpp puts together whose bindings live in
// model_flags.cpp, and the validators both share. Private to the flags layer.
#pragma once

#include "actmem/flags/train_options.h"

#include <CLI/CLI.hpp>

#include <cstdint>
#include <limits>

namespace actmem::flags_detail {

constexpr int64_t kMaxInt = std::numeric_limits<int64_t>::max();

/// A finite number at least zero (CLI11's own check accepts "inf").
const CLI::Validator& non_negative_number_validator();

void add_shape_flags(CLI::App& app, TrainOptions& o);
/// FP8/FP4 training's flags (docs/fp8.md); part of the shape flags.
void add_quantization_flags(CLI::App& app, TrainOptions& o);
void add_parallel_flags(CLI::App& app, TrainOptions& o);
void add_gated_delta_net_flags(CLI::App& app, TrainOptions& o);
void add_multi_latent_attention_flags(CLI::App& app, TrainOptions& o);
void add_moe_flags(CLI::App& app, TrainOptions& o);
void add_recompute_flags(CLI::App& app, TrainOptions& o);
void add_offload_flags(CLI::App& app, TrainOptions& o);

}  // namespace actmem::flags_detail
