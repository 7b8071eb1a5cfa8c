// throughput.h — Megatron's model FLOPs of a training step (--log-throughput).
#pragma once

#include "actmem/config/config.h"

#include <cstdint>

namespace actmem {

/// Megatron's num_floating_point_operations(args, batch_size) for a transformer
/// (megatron/training/training.py, transformer_flops): the forward and backward GEMM FLOPs of
/// `global_batch` samples of seq_length tokens — each layer's parts' terms (LayerPart::
/// megatron_flops: the mixers' projections and causal cores, the MLPs, the MoE layers' top-k
/// and shared experts) and the logits over the padded vocabulary. Activation
/// recompute is not counted (the "model" FLOPs): the same number whatever the plan.
double megatron_model_flops(const TransformerConfig& c, int64_t global_batch);

/// Megatron's log line's throughput: model TFLOP/s per rank for `flops` per iteration at
/// `seconds_per_iteration`, over `world_size` ranks.
inline double tflops_per_rank(double flops, double seconds_per_iteration, int64_t world_size) {
  return flops / (seconds_per_iteration * 1e12 * static_cast<double>(world_size));
}

}  // namespace actmem
