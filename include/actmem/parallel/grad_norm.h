// grad_norm.h — the global gradient norm of one training step, for every parallel layout, in
// Megatron-LM's form (megatron/core/optimizer/clip_grads.py: get_grad_norm_fp32, over the
// gradients that count_zeros/get_main_grads_for_grad_norm select; the dense optimizer reduces
// over the model-parallel group, the expert optimizer over the expert-tensor-model-pipeline
// group, and ChainedOptimizer adds the squares).
//
// One function for every layout: actmem once had three hand-written branches (one process;
// tensor and pipeline; expert parallel), and the expert branch never summed over the pipeline
// stages, so under expert x pipeline parallelism the norm counted one stage only (1.668
// instead of 2.151 on a 4-layer MoE model, docs/parallelism.md) and clipping scaled the update
// wrongly.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace actmem {

/// What a parameter's gradient contributes to the global norm.
enum class GradNormRole : uint8_t {
  kSkip,    // counted on another rank: a tensor-parallel duplicate off tensor rank 0
            // (Megatron's param_is_not_tensor_parallel_duplicate), or the last stage's copy of
            // the tied embedding (param_is_not_shared)
  kDense,   // summed over the tensor- and pipeline-parallel ranks (the model-parallel group)
  kExpert,  // a routed expert under expert parallelism: summed over the tensor-and-expert
            // ranks and the pipeline stages
};

/// Per-parameter attributes the roles are made from (the trainer records them once).
struct GradNormParameter {
  bool tensor_parallel = false;  // split over the tensor-parallel ranks
  bool expert = false;           // a routed expert's weight
  bool shared_copy = false;      // this stage's copy of a weight another stage also counts
};

/// The roles for this rank: tp_rank is the rank in the tensor-parallel group; experts count
/// apart only when expert parallelism splits them (expert_parallel_size > 1; otherwise they are
/// held and split like the dense weights).
std::vector<GradNormRole> grad_norm_roles(const std::vector<GradNormParameter>& params, int tp_rank,
                                          int expert_parallel_size);

/// sqrt(sum over dense gradients, reduced over the tensor then the pipeline group, plus the
/// sum over expert gradients, reduced over the tensor-and-expert then the pipeline group).
/// Each gradient's norm is taken in fp32 (no double copy of a gradient), the squares added in
/// double. Every rank of the layout returns the same value. A collective on those groups: every
/// rank must call it.
double global_grad_norm(const std::vector<at::Tensor>& grads,
                        const std::vector<GradNormRole>& roles);

}  // namespace actmem
