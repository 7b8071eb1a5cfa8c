// gradients.cpp — ParameterGroups, finalize_model_grads and the clip (gradients.h).
#include "actmem/train/gradients.h"

#include "actmem/model/model.h"
#include "actmem/parallel/grad_reducer.h"
#include "actmem/parallel/tensor_parallel.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <functional>

namespace actmem {

ParameterGroups::ParameterGroups(const GPTModel& model)
    : params_(model.ordered_parameters()), attributes_(model.parameter_attributes()) {
  // With expert parallelism the routed experts' gradients already hold the tokens of their
  // expert-parallel peers (the dispatcher brought them): they are summed over the ranks holding
  // the same experts. Without it the experts are data-parallel like the rest.
  const bool apart = expert_parallel_group().size > 1;
  DataParallelGroup dense{&data_parallel_group(), {}};
  DataParallelGroup experts{&expert_data_parallel_group(), {}};
  std::vector<GradNormParameter> norm(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const ParameterAttributes& a = attributes_[i];
    (apart && a.expert_parallel ? experts : dense).params.push_back(i);
    if (a.sequence_parallel) sequence_parallel_.push_back(i);
    norm[i] = {a.tensor_parallel, a.expert_parallel, false};
  }
  groups_.push_back(std::move(dense));
  if (!experts.params.empty()) groups_.push_back(std::move(experts));
  if (const at::Tensor shared = model.shared_embedding_or_output_weight();
      shared.defined() && embedding_group().size > 1) {
    const auto it = std::find_if(params_.begin(), params_.end(),
                                 [&shared](const at::Tensor& p) { return p.is_same(shared); });
    TORCH_INTERNAL_ASSERT(it != params_.end());
    tied_embedding_ = it - params_.begin();
    // The last stage's copy is left out of the gradient norm: it equals the first stage's after
    // the embedding all-reduce (Megatron's param_is_not_shared).
    norm[static_cast<size_t>(tied_embedding_)].shared_copy = !model.pre_process();
  }
  grad_norm_roles_ =
      actmem::grad_norm_roles(norm, tensor_parallel_group().rank, expert_parallel_group().size);
}

namespace {
// One collective for many gradients: `tensors` flattened into one buffer, `reduce` applied to
// it, the result copied back into each.
void reduce_as_one(const std::vector<at::Tensor>& tensors,
                   const std::function<at::Tensor(at::Tensor)>& reduce) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> flat;
  flat.reserve(tensors.size());
  for (const auto& g : tensors) flat.push_back(g.reshape({-1}));
  const at::Tensor reduced = reduce(at::cat(flat));
  int64_t offset = 0;
  for (auto g : tensors) {
    const int64_t n = g.numel();
    g.copy_(reduced.narrow(0, offset, n).view_as(g));
    offset += n;
  }
}

std::vector<at::Tensor> select(const std::vector<at::Tensor>& grads,
                               const std::vector<size_t>& indices) {
  std::vector<at::Tensor> out;
  out.reserve(indices.size());
  for (const size_t i : indices) out.push_back(grads[i]);
  return out;
}

// Megatron's finish_grad_sync: every data-parallel rank's gradients, each scaled by 1/d, summed
// over its group (one flat all-reduce per group after backward, or the overlapped buckets).
void reduce_data_parallel(const ParameterGroups& groups, const std::vector<at::Tensor>& grads,
                          GradReducer* reducer, bool per_token) {
  const TensorParallelGroup& dp = data_parallel_group();
  if (dp.size == 1) return;
  if (reducer != nullptr) {
    reducer->finish();  // the buckets started during backward, and the rest
    return;
  }
  // Megatron's DistributedDataParallel scales by 1/d before the sum (gradient_scaling_factor);
  // at 16 bits these are the fp32 main grads (accumulate_allreduce_grads_in_fp32). The routed
  // experts, summed over the expert-data-parallel group (world / (t e)), take the same 1/d
  // (Megatron's expert_gradient_scaling_factor), so every weight ends with the mean over the
  // global batch.
  const double scale = data_parallel_gradient_scale(per_token);
  for (const auto& g : groups.data_parallel_groups()) {
    const TensorParallelGroup& group = *g.group;
    reduce_as_one(select(grads, g.params), [scale, &group](at::Tensor flat) {
      return group_all_reduce_sum(group, flat.mul_(scale));
    });
  }
}
}  // namespace

double data_parallel_gradient_scale(bool per_token_loss) {
  return per_token_loss ? 1.0 : 1.0 / static_cast<double>(data_parallel_group().size);
}

void finalize_model_grads(const ParameterGroups& groups, const std::vector<at::Tensor>& grads,
                          GradReducer* reducer, std::optional<double> per_token_loss_tokens) {
  reduce_data_parallel(groups, grads, reducer, per_token_loss_tokens.has_value());
  if (!groups.sequence_parallel().empty()) {
    // Sequence parallelism: norms and row-parallel biases saw this rank's tokens only; their
    // gradients are summed over the ranks (one flat all-reduce), then equal everywhere. At 16
    // bits on the main-grad buffers, as Megatron's _allreduce_layernorm_grads reduces
    // param.main_grad.
    reduce_as_one(select(grads, groups.sequence_parallel()),
                  [](at::Tensor flat) { return all_reduce_sum(flat); });
  }
  if (groups.tied_embedding() >= 0) {
    // Megatron's _allreduce_word_embedding_grads: the first stage's word embedding and the last
    // stage's output layer are one tied weight; each saw half of the uses, so both take the sum.
    at::NoGradGuard no_grad;
    at::Tensor g = grads[static_cast<size_t>(groups.tied_embedding())];
    g.copy_(group_all_reduce_sum(embedding_group(), g));
  }
  if (per_token_loss_tokens) {
    // Megatron's finalize_model_grads with num_tokens: every gradient times 1 / max(tokens, 1).
    at::NoGradGuard no_grad;
    const double scaling = 1.0 / std::max(*per_token_loss_tokens, 1.0);
    for (auto g : grads) g.mul_(scaling);
  }
}

void clip_gradients(const std::vector<at::Tensor>& grads, double max_norm, double norm) {
  if (max_norm <= 0.0) return;
  const double coeff = max_norm / (norm + 1e-6);
  if (coeff >= 1.0) return;
  at::NoGradGuard no_grad;
  for (auto g : grads) g.mul_(coeff);
}

}  // namespace actmem
