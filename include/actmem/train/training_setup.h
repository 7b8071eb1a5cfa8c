// training_setup.h — what the Trainer settles before its first step, each in one function: the
// batch-size rules, the training data, the device-memory pre-check, and the activation bytes each
// micro-batch is predicted to keep.
#pragma once

#include "actmem/config/activation_plan.h"
#include "actmem/config/config.h"
#include "actmem/data/data.h"

#include <cstdint>
#include <memory>
#include <vector>

namespace actmem {

class GPTModel;

/// Megatron's validate_args on the batch: each data-parallel rank runs whole micro-batches, and
/// the interleaved schedule's rules on their number. Throws with Megatron's message.
void check_batch_layout(const TransformerConfig& model, const TrainingConfig& training);
/// The same for `global_batch` samples per step on `data_parallel_size` ranks (one size of
/// --step-batch-size-schedule).
void check_batch_layout(const TransformerConfig& model, int64_t global_batch,
                        int64_t data_parallel_size);
/// The same for `data_parallel_size` ranks (a layout described, not launched: flags/presets.h).
void check_batch_layout(const TransformerConfig& model, const TrainingConfig& training,
                        int64_t data_parallel_size);

/// The corpus summary and the training and validation batches: the byte-level corpus of
/// --data-path FILE, or Megatron's GPTDataset and BlendedDataset over memory-mapped indexed
/// datasets, sized as Megatron sizes them (train_valid_test_num_samples).
struct TrainingData {
  Corpus corpus;
  std::unique_ptr<BatchSource> train, valid;  // valid may be null (no validation samples)
};
TrainingData load_training_data(const TransformerConfig& model, const TrainingConfig& training);

/// On CPU (where the device is this machine's memory, shared by the ranks of one launch): checks
/// that parameters, gradients, optimizer state and the activations this pipeline stage keeps in
/// flight at their peak fit the limit (--device-memory-limit, else physical memory less the
/// corpus, split between the ranks), and returns it. Throws naming the sizes and what to reduce.
int64_t checked_device_memory_limit(const TransformerConfig& model, const TrainingConfig& training,
                                    const Corpus& corpus);

/// The bytes one micro-batch keeps on this stage (the exact predictor, activation_bytes.h), per
/// model chunk: predicted once at construction, or per step from the router's counts when they
/// depend on the routing (MoE with a capacity factor and no padding).
struct ActivationPrediction {
  /// `partial`: --num-microbatches-with-partial-activation-checkpoints is set.
  ActivationPrediction(const TransformerConfig& config, const GPTModel& model, bool cpu,
                       bool partial);
  /// Model chunk 0's bytes (0 when routing-dependent).
  int64_t micro_batch_bytes() const { return chunk_bytes.empty() ? 0 : chunk_bytes.front(); }
  /// A micro-batch's bytes in model chunk `chunk` right after its forward (Note [Pipeline step]
  /// in schedules.cpp): with routing-dependent MoE layers from the chunk's latest routing;
  /// `every_layer`: one that checkpoints every layer (Note [Partial activation checkpoints]).
  int64_t chunk(const GPTModel& model, int64_t chunk, int64_t boundary_bytes,
                bool every_layer) const;

  TransformerConfig config;
  bool cpu = true;
  bool routing_dependent = false;
  std::vector<int64_t> chunk_bytes;  // per model chunk, unless routing-dependent
  // With --num-microbatches-with-partial-activation-checkpoints: the plan of a micro-batch that
  // checkpoints every layer, and its bytes per model chunk (unless routing-dependent).
  std::unique_ptr<ActivationPlan> every_layer_plan;
  std::vector<int64_t> every_layer_chunk_bytes;
};

}  // namespace actmem
