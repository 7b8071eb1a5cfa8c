// gradients.h — the model's parameters as the reductions see them, and the steps between the
// backward and the optimizer step: Megatron-LM's finalize_model_grads
// (megatron/core/distributed/finalize_model_grads.py) and the clip of clip_grad_norm_fp32
// (megatron/core/optimizer/clip_grads.py). The global norm itself is global_grad_norm
// (grad_norm.h), one function for every layout.
#pragma once

#include "actmem/model/layers.h"
#include "actmem/parallel/grad_norm.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace actmem {

class GPTModel;
class GradReducer;
struct TensorParallelGroup;

/// The model's parameters with their attributes (Note [Parameter attributes] in model.cpp), and
/// every grouping the step needs made from them once: which data-parallel group sums each
/// gradient, which gradients the sequence-parallel all-reduce sums, the tied embedding, and each
/// gradient's role in the global norm.
class ParameterGroups {
 public:
  /// A data-parallel group and the parameters (indices, in the model's order) it reduces.
  struct DataParallelGroup {
    const TensorParallelGroup* group;  // process-wide, outlives this object
    std::vector<size_t> params;
  };

  explicit ParameterGroups(const GPTModel& model);
  const std::vector<at::Tensor>& params() const { return params_; }
  const std::vector<ParameterAttributes>& attributes() const { return attributes_; }
  /// The dense parameters over the data-parallel group, then (when expert parallelism splits
  /// them, and there are any) the routed experts over the expert-data-parallel group (Megatron's
  /// expert_data_parallel_group): the order the reductions and the distributed optimizer's
  /// buckets use.
  const std::vector<DataParallelGroup>& data_parallel_groups() const { return groups_; }
  /// The parameters whose gradients the sequence-parallel all-reduce sums.
  const std::vector<size_t>& sequence_parallel() const { return sequence_parallel_; }
  /// The word embedding tied across the first and last pipeline stage (Megatron's
  /// shared_embedding_or_output_weight under pipeline parallelism), or -1.
  int64_t tied_embedding() const { return tied_embedding_; }
  /// Per parameter, what its gradient contributes to the global norm on this rank.
  const std::vector<GradNormRole>& grad_norm_roles() const { return grad_norm_roles_; }

 private:
  std::vector<at::Tensor> params_;
  std::vector<ParameterAttributes> attributes_;
  std::vector<DataParallelGroup> groups_;
  std::vector<size_t> sequence_parallel_;
  int64_t tied_embedding_ = -1;
  std::vector<GradNormRole> grad_norm_roles_;
};

/// The factor each data-parallel rank's gradients take before the sum (Megatron's DDP
/// gradient_scaling_factor): 1/d, or 1 under the per-token loss (Note [Per-token loss] in
/// trainer.cpp). Both the flat reduction and the overlapped buckets (GradReducer) use it.
double data_parallel_gradient_scale(bool per_token_loss);

/// Megatron's finalize_model_grads on `grads` (one per parameter of `groups`): the data-parallel
/// sum (`reducer`'s overlapped buckets when set, else one flat all-reduce per group, each
/// gradient scaled by 1/d first), then the sequence-parallel sum over the tensor-parallel ranks,
/// then the tied embedding's sum over the embedding group. A collective.
/// With `per_token_loss_tokens` (--calculate-per-token-loss: the step's loss tokens over every
/// micro-batch and data-parallel rank) the data-parallel sum takes no 1/d, and every gradient is
/// divided by the token count at the end (Note [Per-token loss] in trainer.cpp).
void finalize_model_grads(const ParameterGroups& groups, const std::vector<at::Tensor>& grads,
                          GradReducer* reducer,
                          std::optional<double> per_token_loss_tokens = std::nullopt);

/// clip_grad_norm_fp32's scaling: every gradient times max_norm / (norm + 1e-6) when that is
/// below 1 (nothing when max_norm <= 0).
void clip_gradients(const std::vector<at::Tensor>& grads, double max_norm, double norm);

}  // namespace actmem
