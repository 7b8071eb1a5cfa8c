// grad_norm.cpp — the global gradient norm (grad_norm.h).
#include "actmem/parallel/grad_norm.h"

#include "actmem/parallel/tensor_parallel.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>

namespace actmem {

std::vector<GradNormRole> grad_norm_roles(const std::vector<GradNormParameter>& params, int tp_rank,
                                          int expert_parallel_size) {
  std::vector<GradNormRole> roles;
  roles.reserve(params.size());
  for (const auto& p : params) {
    if (p.shared_copy || (!p.tensor_parallel && tp_rank != 0)) {
      roles.push_back(GradNormRole::kSkip);
    } else {
      roles.push_back(p.expert && expert_parallel_size > 1 ? GradNormRole::kExpert
                                                           : GradNormRole::kDense);
    }
  }
  return roles;
}

namespace {
// Sum of squares of the gradients with this role, as a double tensor of one element on their
// device.
at::Tensor sum_of_squares(const std::vector<at::Tensor>& grads,
                          const std::vector<GradNormRole>& roles, GradNormRole role,
                          const at::TensorOptions& options) {
  std::vector<at::Tensor> norms;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (roles[i] != role) continue;
    norms.push_back(at::linalg_vector_norm(grads[i], 2, c10::nullopt, false, at::kFloat));
  }
  if (norms.empty()) return at::zeros({1}, options);
  return at::stack(norms).to(at::kDouble).square().sum().reshape({1});
}
}  // namespace

double global_grad_norm(const std::vector<at::Tensor>& grads,
                        const std::vector<GradNormRole>& roles) {
  TORCH_CHECK(grads.size() == roles.size(), "actmem::global_grad_norm: ", grads.size(),
              " gradients but ", roles.size(), " roles");
  TORCH_CHECK(!grads.empty(), "actmem::global_grad_norm: no gradients");
  at::NoGradGuard no_grad;
  const auto options = at::TensorOptions().dtype(at::kDouble).device(grads.front().device());
  // Megatron reduces each optimizer's squares over its own group; summing a stage's total over
  // the tensor (or tensor-and-expert) ranks first and then over the stages is the same sum.
  at::Tensor total = all_reduce_sum(sum_of_squares(grads, roles, GradNormRole::kDense, options));
  if (expert_parallel_group().size > 1) {
    total =
        total + group_all_reduce_sum(tensor_and_expert_parallel_group(),
                                     sum_of_squares(grads, roles, GradNormRole::kExpert, options));
  }
  total = group_all_reduce_sum(pipeline_parallel_group(), total);
  return std::sqrt(total.item<double>());
}

}  // namespace actmem
