// moe_dispatch.cpp — the all-to-all token dispatcher (Note [All-to-all dispatch]).
#include "actmem/moe_dispatch.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#if ACTMEM_TORCH_VERSION_AT_LEAST(2, 0)
#include <torch/csrc/distributed/c10d/Backend.hpp>
#endif

#include <numeric>

namespace actmem {

namespace {
int64_t sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }

// One all-to-all of x's rows. Gloo has no bfloat16: the rows travel as float16 bits (a copy
// moves bits only, Note [bfloat16 on Gloo] in tensor_parallel.cpp).
at::Tensor exchange(const at::Tensor& x_in, std::vector<int64_t> output_splits,
                    std::vector<int64_t> input_splits, CollectiveGroup& pg) {
  RECORD_FUNCTION("actmem::all_to_all", std::vector<c10::IValue>());
  TORCH_CHECK(static_cast<int>(output_splits.size()) == pg.getSize() &&
                  static_cast<int>(input_splits.size()) == pg.getSize(),
              "actmem::all_to_all: one split per rank of the group (", pg.getSize(), ") expected, got ",
              output_splits.size(), " and ", input_splits.size());
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(0) == sum(input_splits), "actmem::all_to_all: x has ",
              x_in.dim() >= 1 ? x_in.size(0) : 0, " rows but the input splits add up to ",
              sum(input_splits));
  const at::Tensor x = x_in.contiguous();
  std::vector<int64_t> shape = x.sizes().vec();
  shape[0] = sum(output_splits);
  at::Tensor out = at::empty(shape, x.options());
  const bool as_half = x.is_cpu() && x.scalar_type() == at::kBFloat16;
  at::Tensor out_wire = as_half ? out.view(at::kHalf) : out;
  at::Tensor in_wire = as_half ? x.view(at::kHalf) : x;
  pg.alltoall_base(out_wire, in_wire, output_splits, input_splits)->wait();
  return out;
}

// The group's x concatenated along dim 0 (every rank's x has the same shape).
at::Tensor gather_rows(const at::Tensor& x_in, CollectiveGroup& pg) {
  RECORD_FUNCTION("actmem::all_gather_tokens", std::vector<c10::IValue>());
  const at::Tensor x = x_in.contiguous();
  const int n = pg.getSize();
  std::vector<int64_t> shape = x.sizes().vec();
  const int64_t rows = shape[0];
  shape[0] *= n;
  at::Tensor out = at::empty(shape, x.options());
  const bool as_half = x.is_cpu() && x.scalar_type() == at::kBFloat16;
  const at::Tensor wire = as_half ? out.view(at::kHalf) : out;
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < n; ++r) outputs[0].push_back(wire.narrow(0, r * rows, rows));
  std::vector<at::Tensor> inputs = {as_half ? x.view(at::kHalf) : x};
  pg.allgather(outputs, inputs)->wait();
  return out;
}

// This rank's dim-0 slice of the group's sum of x.
at::Tensor reduce_scatter_rows(const at::Tensor& x, CollectiveGroup& pg) {
  RECORD_FUNCTION("actmem::reduce_scatter_tokens", std::vector<c10::IValue>());
  const int n = pg.getSize();
  TORCH_CHECK(x.dim() >= 1 && x.size(0) % n == 0, "actmem::reduce_scatter_tokens: expected dim 0 "
              "divisible by the group size ", n, ", got shape ", x.sizes());
  const bool bf16 = x.is_cpu() && x.scalar_type() == at::kBFloat16;
  std::vector<at::Tensor> buf = {bf16 ? x.contiguous().to(at::kFloat) : x.contiguous().clone()};
  pg.allreduce(buf)->wait();
  const int64_t part = x.size(0) / n;
  at::Tensor mine = buf[0].narrow(0, pg.getRank() * part, part).clone();
  return bf16 ? mine.to(at::kBFloat16) : mine;
}

c10::intrusive_ptr<CollectiveGroup> saved_group(torch::autograd::AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<CollectiveGroup>(ctx->saved_data.at("group").toCapsule());
}

struct GatherTokens : torch::autograd::Function<GatherTokens> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const c10::intrusive_ptr<CollectiveGroup>& group) {
    ctx->saved_data["group"] = c10::IValue::make_capsule(group);
    return gather_rows(x, *group);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {reduce_scatter_rows(grads[0], *saved_group(ctx)), at::Tensor()};
  }
};

struct ReduceScatterTokens : torch::autograd::Function<ReduceScatterTokens> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const c10::intrusive_ptr<CollectiveGroup>& group) {
    ctx->saved_data["group"] = c10::IValue::make_capsule(group);
    return reduce_scatter_rows(x, *group);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {gather_rows(grads[0], *saved_group(ctx)), at::Tensor()};
  }
};

struct AllToAllFunction : torch::autograd::Function<AllToAllFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            std::vector<int64_t> output_splits, std::vector<int64_t> input_splits,
                            const c10::intrusive_ptr<CollectiveGroup>& group) {
    ctx->saved_data["output_splits"] = output_splits;
    ctx->saved_data["input_splits"] = input_splits;
    ctx->saved_data["group"] = c10::IValue::make_capsule(group);
    return exchange(x, output_splits, input_splits, *group);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto group = saved_group(ctx);
    // The gradient rows go back where their tokens came from: the splits swap.
    const at::Tensor g = exchange(grads[0], ctx->saved_data.at("input_splits").toIntVector(),
                                  ctx->saved_data.at("output_splits").toIntVector(), *group);
    return {g, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
}  // namespace

at::Tensor all_to_all(const at::Tensor& x, const std::vector<int64_t>& output_splits,
                      const std::vector<int64_t>& input_splits,
                      const c10::intrusive_ptr<CollectiveGroup>& group) {
  TORCH_CHECK(group, "actmem::all_to_all: no process group");
  return AllToAllFunction::apply(x, output_splits, input_splits, group);
}

at::Tensor all_gather_tokens(const at::Tensor& x, const c10::intrusive_ptr<CollectiveGroup>& group) {
  TORCH_CHECK(group, "actmem::all_gather_tokens: no process group");
  if (!x.requires_grad()) return gather_rows(x, *group);
  return GatherTokens::apply(x, group);
}

at::Tensor reduce_scatter_tokens(const at::Tensor& x,
                                 const c10::intrusive_ptr<CollectiveGroup>& group) {
  TORCH_CHECK(group, "actmem::reduce_scatter_tokens: no process group");
  if (!x.requires_grad()) return reduce_scatter_rows(x, *group);
  return ReduceScatterTokens::apply(x, group);
}

at::Tensor sort_chunks_by_idxs(const at::Tensor& x, const std::vector<int64_t>& split_sizes,
                               const std::vector<int64_t>& order) {
  TORCH_CHECK(x.size(0) == sum(split_sizes), "actmem::sort_chunks_by_idxs: x has ", x.size(0),
              " rows, the chunks ", sum(split_sizes));
  TORCH_CHECK(order.size() == split_sizes.size(), "actmem::sort_chunks_by_idxs: ", order.size(),
              " indices for ", split_sizes.size(), " chunks");
  const auto chunks = x.split_with_sizes(split_sizes, 0);
  std::vector<at::Tensor> sorted;
  sorted.reserve(order.size());
  for (const int64_t i : order) {
    TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(chunks.size()),
                "actmem::sort_chunks_by_idxs: index ", i, " out of range");
    sorted.push_back(chunks[static_cast<size_t>(i)]);
  }
  return at::cat(sorted, 0);
}

AlltoAllTokenDispatcher::AlltoAllTokenDispatcher(c10::intrusive_ptr<CollectiveGroup> group,
                                                 int ep_rank, int ep_size, int64_t num_experts)
    : group_(std::move(group)), ep_rank_(ep_rank), ep_size_(ep_size), experts_(num_experts) {
  TORCH_CHECK(group_ && group_->getSize() == ep_size && ep_rank >= 0 && ep_rank < ep_size,
              "actmem::AlltoAllTokenDispatcher: a group of ", ep_size, " ranks with this one in it "
              "expected");
  TORCH_CHECK(num_experts % ep_size == 0, "actmem::AlltoAllTokenDispatcher: Number of experts "
              "should be a multiple of expert model parallel_size.");
  local_ = num_experts / ep_size;
}

AlltoAllTokenDispatcher::Dispatched AlltoAllTokenDispatcher::dispatch(
    const at::Tensor& permuted, const at::Tensor& probs, const std::vector<int64_t>& rows_per_expert) {
  TORCH_CHECK(static_cast<int64_t>(rows_per_expert.size()) == experts_,
              "actmem::AlltoAllTokenDispatcher::dispatch: ", rows_per_expert.size(),
              " expert counts for ", experts_, " experts");
  // 1. Every rank's rows per expert (Megatron's num_global_tokens_per_expert, [ep, E]).
  std::vector<at::Tensor> mine = {at::tensor(rows_per_expert, at::kLong)};
  std::vector<std::vector<at::Tensor>> all(1);
  for (int r = 0; r < ep_size_; ++r) all[0].push_back(at::empty({experts_}, at::kLong));
  group_->allgather(all, mine)->wait();
  input_splits_.assign(static_cast<size_t>(ep_size_), 0);
  output_splits_.assign(static_cast<size_t>(ep_size_), 0);
  received_chunks_.clear();
  for (int q = 0; q < ep_size_; ++q) {
    for (int64_t j = 0; j < local_; ++j) {
      input_splits_[static_cast<size_t>(q)] += rows_per_expert[static_cast<size_t>(q * local_ + j)];
    }
  }
  Dispatched d;
  d.tokens_per_local_expert.assign(static_cast<size_t>(local_), 0);
  for (int src = 0; src < ep_size_; ++src) {
    const int64_t* counts = all[0][static_cast<size_t>(src)].data_ptr<int64_t>();
    for (int64_t j = 0; j < local_; ++j) {
      const int64_t n = counts[ep_rank_ * local_ + j];
      output_splits_[static_cast<size_t>(src)] += n;
      received_chunks_.push_back(n);  // source-rank-major
      d.tokens_per_local_expert[static_cast<size_t>(j)] += n;
    }
  }
  // 2. The rows and their probabilities to the ranks owning their experts.
  const at::Tensor tokens = all_to_all(permuted, output_splits_, input_splits_, group_);
  const at::Tensor p = all_to_all(probs.unsqueeze(1), output_splits_, input_splits_, group_).squeeze(1);
  // 3. Source-rank-major chunks to expert-major: chunk (src, j) is at src * local + j.
  std::vector<int64_t> order;
  for (int64_t j = 0; j < local_; ++j) {
    for (int src = 0; src < ep_size_; ++src) order.push_back(src * local_ + j);
  }
  d.tokens = sort_chunks_by_idxs(tokens, received_chunks_, order);
  d.probs = sort_chunks_by_idxs(p, received_chunks_, order);
  return d;
}

at::Tensor AlltoAllTokenDispatcher::combine(const at::Tensor& expert_output) {
  TORCH_CHECK(!received_chunks_.empty(), "actmem::AlltoAllTokenDispatcher::combine: no dispatch "
              "to combine");
  // The expert-major chunk sizes, and the order that restores source-rank-major.
  std::vector<int64_t> sizes, order;
  for (int64_t j = 0; j < local_; ++j) {
    for (int src = 0; src < ep_size_; ++src) sizes.push_back(received_chunks_[static_cast<size_t>(src * local_ + j)]);
  }
  for (int src = 0; src < ep_size_; ++src) {
    for (int64_t j = 0; j < local_; ++j) order.push_back(j * ep_size_ + src);
  }
  const at::Tensor by_source = sort_chunks_by_idxs(expert_output, sizes, order);
  return all_to_all(by_source, input_splits_, output_splits_, group_);
}

}  // namespace actmem
