// moe_dispatch.cpp — the all-to-all token dispatcher (Note [All-to-all dispatch]).
#include "actmem/parallel/moe_dispatch.h"

#include "actmem/parallel/tensor_parallel.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <numeric>

namespace actmem {

namespace {
int64_t sum(const std::vector<int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t{0});
}

// One all-to-all of x's rows, in x's own type (Note [16-bit collectives] in tensor_parallel.cpp).
at::Tensor exchange(const at::Tensor& x_in, std::vector<int64_t> output_splits,
                    std::vector<int64_t> input_splits, CollectiveGroup& pg) {
  RECORD_FUNCTION("actmem::all_to_all", std::vector<c10::IValue>());
  TORCH_CHECK(static_cast<int>(output_splits.size()) == pg.getSize() &&
                  static_cast<int>(input_splits.size()) == pg.getSize(),
              "actmem::all_to_all: one split per rank of the group (", pg.getSize(),
              ") expected, got ", output_splits.size(), " and ", input_splits.size());
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(0) == sum(input_splits), "actmem::all_to_all: x has ",
              x_in.dim() >= 1 ? x_in.size(0) : 0, " rows but the input splits add up to ",
              sum(input_splits));
  const at::Tensor x = x_in.contiguous();
  std::vector<int64_t> shape = x.sizes().vec();
  shape[0] = sum(output_splits);
  at::Tensor out = at::empty(shape, x.options());
  at::Tensor in = x;
  wait_and_release(pg.alltoall_base(out, in, output_splits, input_splits));
  return out;
}

// A TensorParallelGroup through an autograd context (its process group as a capsule).
void save_group(torch::autograd::AutogradContext* ctx, const TensorParallelGroup& g) {
  ctx->saved_data["group"] = c10::IValue::make_capsule(g.pg);
  ctx->saved_data["rank"] = static_cast<int64_t>(g.rank);
  ctx->saved_data["size"] = static_cast<int64_t>(g.size);
}
TensorParallelGroup saved_group(torch::autograd::AutogradContext* ctx) {
  TensorParallelGroup g;
  g.pg =
      c10::static_intrusive_pointer_cast<CollectiveGroup>(ctx->saved_data.at("group").toCapsule());
  g.rank = static_cast<int>(ctx->saved_data.at("rank").toInt());
  g.size = static_cast<int>(ctx->saved_data.at("size").toInt());
  return g;
}

// All-gathers (gather) or reduce-scatters the rows of x over a group: evenly when `sizes` is
// empty, else with rank r holding sizes[r] rows (Note [Uneven all-gather on Gloo]).
at::Tensor exchange_rows(const at::Tensor& x, const TensorParallelGroup& g, bool gather,
                         const std::vector<int64_t>& sizes) {
  if (gather) {
    RECORD_FUNCTION("actmem::all_gather_tokens", std::vector<c10::IValue>());
    return sizes.empty() ? group_all_gather_dim0(g, x) : group_all_gather_v(g, x, sizes);
  }
  RECORD_FUNCTION("actmem::reduce_scatter_tokens", std::vector<c10::IValue>());
  return sizes.empty() ? group_reduce_scatter_dim0(g, x) : group_reduce_scatter_v(g, x, sizes);
}

// exchange_rows as an autograd function: the backward of an all-gather is the reduce-scatter of
// the gradients (every rank's consumers contributed to every row) and the other way round —
// Megatron's gather_from_sequence_parallel_region / reduce_scatter_to_sequence_parallel_region
// on a given group, with or without split sizes.
struct RowExchange : torch::autograd::Function<RowExchange> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const c10::intrusive_ptr<CollectiveGroup>& pg, int64_t rank,
                            int64_t size, bool gather, std::vector<int64_t> sizes) {
    const TensorParallelGroup g{pg, static_cast<int>(rank), static_cast<int>(size)};
    save_group(ctx, g);
    ctx->saved_data["gather"] = gather;
    ctx->saved_data["sizes"] = sizes;
    return exchange_rows(x, g, gather, sizes);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {exchange_rows(grads[0], saved_group(ctx), !ctx->saved_data.at("gather").toBool(),
                          ctx->saved_data.at("sizes").toIntVector()),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor()};
  }
};

at::Tensor exchange_tokens(const at::Tensor& x, const TensorParallelGroup& g, bool gather,
                           const std::vector<int64_t>& sizes) {
  if (g.size == 1) return x;
  if (!x.requires_grad()) return exchange_rows(x, g, gather, sizes);
  return RowExchange::apply(x, g.pg, g.rank, g.size, gather, sizes);
}

c10::intrusive_ptr<CollectiveGroup> saved_pg(torch::autograd::AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<CollectiveGroup>(
      ctx->saved_data.at("group").toCapsule());
}

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
    auto group = saved_pg(ctx);
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

at::Tensor all_gather_tokens(const at::Tensor& x, const TensorParallelGroup& group) {
  return exchange_tokens(x, group, true, {});
}

at::Tensor reduce_scatter_tokens(const at::Tensor& x, const TensorParallelGroup& group) {
  return exchange_tokens(x, group, false, {});
}

at::Tensor all_gather_tokens_v(const at::Tensor& x, const TensorParallelGroup& group,
                               const std::vector<int64_t>& sizes) {
  return exchange_tokens(x, group, true, sizes);
}

at::Tensor reduce_scatter_tokens_v(const at::Tensor& x, const TensorParallelGroup& group,
                                   const std::vector<int64_t>& sizes) {
  return exchange_tokens(x, group, false, sizes);
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

AlltoAllTokenDispatcher::AlltoAllTokenDispatcher(const TensorParallelGroup& ep,
                                                 const TensorParallelGroup& tp,
                                                 const TensorParallelGroup& tp_ep,
                                                 int64_t num_experts)
    : ep_(ep), tp_(tp), tp_ep_(tp_ep), experts_(num_experts) {
  TORCH_CHECK(ep.size >= 1 && ep.rank >= 0 && ep.rank < ep.size && tp.size >= 1 && tp.rank >= 0 &&
                  tp.rank < tp.size && tp_ep.size == tp.size * ep.size &&
                  tp_ep.rank == ep.rank * tp.size + tp.rank,
              "actmem::AlltoAllTokenDispatcher: expected the tensor-and-expert-parallel group to "
              "hold the t x e ranks (tensor rank fastest); got t ",
              tp.size, ", e ", ep.size, ", t x e group of ", tp_ep.size, " with this rank ",
              tp_ep.rank);
  TORCH_CHECK(num_experts % ep.size == 0,
              "actmem::AlltoAllTokenDispatcher: Number of experts "
              "should be a multiple of expert model parallel_size.");
  local_ = num_experts / ep.size;
}

AlltoAllTokenDispatcher::Dispatched AlltoAllTokenDispatcher::dispatch(
    const at::Tensor& permuted, const at::Tensor& probs,
    const std::vector<int64_t>& rows_per_expert) {
  TORCH_CHECK(static_cast<int64_t>(rows_per_expert.size()) == experts_,
              "actmem::AlltoAllTokenDispatcher::dispatch: ", rows_per_expert.size(),
              " expert counts for ", experts_, " experts");
  const int t = tp_.size, e = ep_.size;
  // 1. Every rank's rows per expert (Megatron's num_global_tokens_per_expert [tp, ep, E]; the
  //    t x e group's rank is ep_rank * t + tp_rank).
  const at::Tensor all =
      group_all_gather_dim0(tp_ep_, at::tensor(rows_per_expert, at::kLong)).cpu();
  const int64_t* c = all.data_ptr<int64_t>();
  auto count = [&](int tp_rank, int ep_rank, int64_t expert) {
    return c[(static_cast<int64_t>(ep_rank) * t + tp_rank) * experts_ + expert];
  };
  input_splits_.assign(static_cast<size_t>(e), 0);
  output_splits_.assign(static_cast<size_t>(e), 0);
  tp_splits_.assign(static_cast<size_t>(t), 0);
  received_chunks_.clear();
  for (int q = 0; q < e; ++q) {
    for (int64_t j = 0; j < local_; ++j) {
      input_splits_[static_cast<size_t>(q)] += rows_per_expert[static_cast<size_t>(q * local_ + j)];
    }
  }
  Dispatched d;
  d.tokens_per_local_expert.assign(static_cast<size_t>(local_), 0);
  // What arrives, in the order it lands: per tensor rank (after the uneven all-gather over the
  // expert tensor-parallel group), per source expert rank (the all-to-all), per local expert.
  for (int tq = 0; tq < t; ++tq) {
    for (int src = 0; src < e; ++src) {
      for (int64_t j = 0; j < local_; ++j) {
        const int64_t n = count(tq, src, ep_.rank * local_ + j);
        if (tq == tp_.rank) output_splits_[static_cast<size_t>(src)] += n;
        tp_splits_[static_cast<size_t>(tq)] += n;
        received_chunks_.push_back(n);
        d.tokens_per_local_expert[static_cast<size_t>(j)] += n;
      }
    }
  }
  // 2. The rows and their probabilities to the expert ranks owning their experts ...
  at::Tensor tokens = permuted, p = probs.unsqueeze(1);
  if (e > 1) {
    tokens = all_to_all(tokens, output_splits_, input_splits_, ep_.pg);
    p = all_to_all(p, output_splits_, input_splits_, ep_.pg);
  }
  // ... and to every expert tensor-parallel peer, which holds another slice of the same experts.
  if (t > 1) {
    tokens = all_gather_tokens_v(tokens, tp_, tp_splits_);
    p = all_gather_tokens_v(p, tp_, tp_splits_);
  }
  // 3. (tensor rank, source rank, expert) chunks to expert-major.
  std::vector<int64_t> order;
  const int sources = t * e;
  for (int64_t j = 0; j < local_; ++j) {
    for (int src = 0; src < sources; ++src) order.push_back(src * local_ + j);
  }
  d.tokens = sort_chunks_by_idxs(tokens, received_chunks_, order);
  d.probs = sort_chunks_by_idxs(p.squeeze(1), received_chunks_, order);
  return d;
}

at::Tensor AlltoAllTokenDispatcher::combine(const at::Tensor& expert_output) {
  TORCH_CHECK(!received_chunks_.empty(),
              "actmem::AlltoAllTokenDispatcher::combine: no dispatch "
              "to combine");
  const int sources = tp_.size * ep_.size;
  // The expert-major chunk sizes, and the order that restores source-major.
  std::vector<int64_t> sizes, order;
  for (int64_t j = 0; j < local_; ++j) {
    for (int src = 0; src < sources; ++src)
      sizes.push_back(received_chunks_[static_cast<size_t>(src * local_ + j)]);
  }
  for (int src = 0; src < sources; ++src) {
    for (int64_t j = 0; j < local_; ++j) order.push_back(j * sources + src);
  }
  at::Tensor y = sort_chunks_by_idxs(expert_output, sizes, order);
  // The expert tensor-parallel partial sums, each tensor rank's rows to it; then back home.
  if (tp_.size > 1) y = reduce_scatter_tokens_v(y, tp_, tp_splits_);
  if (ep_.size > 1) y = all_to_all(y, input_splits_, output_splits_, ep_.pg);
  return y;
}

}  // namespace actmem
