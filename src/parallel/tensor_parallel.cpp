// tensor_parallel.cpp — the tensor-parallel group, collectives, autograd mappings and parallel
// linear layers on c10d (Gloo on CPU).
//
// Note [Reduce-scatter on Gloo]
// Reduce-scatter is an all-reduce of the whole tensor followed by taking this rank's slice: the
// same sums (each element is reduced once, in the same order on every rank), twice the traffic
// of a true reduce-scatter. The full-size buffer exists anyway (it is the matmul output being
// reduced), so the memory an activation keeps is the same as with NCCL's reduce-scatter.
// libtorch 1.13's Gloo had no reduce-scatter; 2.x's has one, but under two names across the
// supported range (_reduce_scatter_base in 2.11, reduce_scatter_single in 2.15, where the old
// name is deprecated), and on CPU the traffic is a memory copy, so the all-reduce stays.
#include "actmem/parallel/tensor_parallel.h"

#include "actmem/parallel/distributed.h"
#include "actmem/parallel/parallel_layout.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <thread>
#include <utility>
#include <vector>

namespace actmem {

namespace {
TensorParallelGroup& group_storage() {
  static TensorParallelGroup group;
  return group;
}
TensorParallelGroup& dp_storage() {
  static TensorParallelGroup group;
  return group;
}
TensorParallelGroup& ep_storage() {
  static TensorParallelGroup group;
  return group;
}
TensorParallelGroup& edp_storage() {
  static TensorParallelGroup group;
  return group;
}
TensorParallelGroup& tp_ep_storage() {
  static TensorParallelGroup group;
  return group;
}
TensorParallelGroup& pp_storage() {
  static TensorParallelGroup group;
  return group;
}
TensorParallelGroup& embedding_storage() {
  static TensorParallelGroup group;
  return group;
}
void check_group(const TensorParallelGroup& group, const char* api) {
  TORCH_CHECK(group.size >= 1 && group.rank >= 0 && group.rank < group.size, api, ": rank ",
              group.rank, " of size ", group.size);
  TORCH_CHECK(group.size == 1 || group.pg, api, ": a group of ", group.size,
              " ranks needs a process group");
}

bool single() {
  return tensor_parallel_group().size == 1;
}

void check_dim0(const at::Tensor& x, const char* api) {
  const int t = tensor_parallel_group().size;
  TORCH_CHECK(x.dim() >= 1 && x.size(0) % t == 0, api, ": expected dim 0 divisible by the ",
              "tensor-parallel size ", t, ", got shape ", x.sizes());
}
}  // namespace

// Note [Collective buffers]: Gloo's worker thread holds a reference to a finished work object,
// and through it to the tensors the collective used, until just after wait() returns. Waiting
// for that reference to go makes a collective's temporary buffers free when the call returns,
// so the tracker never sees them linger into the next measurement. Bounded: never a hang.
void wait_and_release(c10::intrusive_ptr<c10d::Work> work) {
  work->wait();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
  while (work.use_count() > 1 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::yield();
  }
}

const TensorParallelGroup& tensor_parallel_group() {
  return group_storage();
}

void set_tensor_parallel_group(TensorParallelGroup group) {
  check_group(group, "actmem::set_tensor_parallel_group");
  group_storage() = std::move(group);
}

void reset_tensor_parallel_group() {
  group_storage() = TensorParallelGroup{};
  dp_storage() = TensorParallelGroup{};
  ep_storage() = TensorParallelGroup{};
  edp_storage() = TensorParallelGroup{};
  tp_ep_storage() = TensorParallelGroup{};
  pp_storage() = TensorParallelGroup{};
  embedding_storage() = TensorParallelGroup{};
}

const TensorParallelGroup& data_parallel_group() {
  return dp_storage();
}

void set_data_parallel_group(TensorParallelGroup group) {
  check_group(group, "actmem::set_data_parallel_group");
  dp_storage() = std::move(group);
}

const TensorParallelGroup& expert_parallel_group() {
  return ep_storage();
}
const TensorParallelGroup& expert_data_parallel_group() {
  return edp_storage();
}
const TensorParallelGroup& tensor_and_expert_parallel_group() {
  return tp_ep_storage();
}

void set_expert_parallel_groups(TensorParallelGroup ep, TensorParallelGroup edp,
                                TensorParallelGroup tp_ep) {
  check_group(ep, "actmem::set_expert_parallel_groups");
  check_group(edp, "actmem::set_expert_parallel_groups");
  check_group(tp_ep, "actmem::set_expert_parallel_groups");
  ep_storage() = std::move(ep);
  edp_storage() = std::move(edp);
  tp_ep_storage() = std::move(tp_ep);
}

const TensorParallelGroup& pipeline_parallel_group() {
  return pp_storage();
}
const TensorParallelGroup& embedding_group() {
  return embedding_storage();
}

void set_pipeline_parallel_groups(TensorParallelGroup pp, TensorParallelGroup embedding) {
  check_group(pp, "actmem::set_pipeline_parallel_groups");
  check_group(embedding, "actmem::set_pipeline_parallel_groups");
  pp_storage() = std::move(pp);
  embedding_storage() = std::move(embedding);
}

TensorParallelSession::TensorParallelSession(const DistEnv& env, const c10::Device& device,
                                             int tensor_parallel_size, int expert_parallel_size,
                                             int pipeline_parallel_size,
                                             std::chrono::milliseconds timeout) {
  init_tensor_parallel_from_environment(env, device, tensor_parallel_size, expert_parallel_size,
                                        pipeline_parallel_size, timeout);
}

TensorParallelSession::~TensorParallelSession() {
  reset_tensor_parallel_group();
}

std::string device_for_rank(const std::string& device, const DistEnv& env) {
  if (env.world_size > 1 && device == "cuda") return "cuda:" + std::to_string(env.local_rank);
  return device;
}

const TensorParallelGroup& init_tensor_parallel_from_environment(
    const DistEnv& env, const c10::Device& device, int tensor_parallel_size,
    int expert_parallel_size, int pipeline_parallel_size, std::chrono::milliseconds timeout) {
  if (env.world_size == 1) return tensor_parallel_group();
  const int t = tensor_parallel_size > 0 ? tensor_parallel_size : env.world_size;
  const ParallelLayout layout =
      ParallelLayout::make(env.world_size, t, pipeline_parallel_size, expert_parallel_size);
  const WorldGroup world = init_world_group(env, timeout, device);
  // Every member builds its groups in the same order: tensor-parallel, data-parallel,
  // expert-parallel, expert-data-parallel, tensor-and-expert-parallel.
  auto subgroup = [&](const std::vector<std::vector<int>>& groups, const char* name) {
    TensorParallelGroup g;
    const std::vector<int>& members = ParallelLayout::group_of(groups, env.rank);
    g.size = static_cast<int>(members.size());
    g.rank = ParallelLayout::index_in(groups, env.rank);
    if (g.size == env.world_size) {
      g.pg = world.pg;
    } else if (g.size > 1) {
      g.pg = new_subgroup(
          world, members,
          std::string(name) + "/" + std::to_string(ParallelLayout::group_index(groups, env.rank)));
    }
    return g;
  };
  set_tensor_parallel_group(subgroup(layout.tp_groups, "tp"));
  set_data_parallel_group(subgroup(layout.dp_groups, "dp"));
  TensorParallelGroup ep = subgroup(layout.ep_groups, "ep");
  TensorParallelGroup edp = subgroup(layout.edp_groups, "edp");
  set_expert_parallel_groups(std::move(ep), std::move(edp), subgroup(layout.tp_ep_groups, "tpep"));
  // Pipeline, then embedding group: the middle stages are in no embedding group (size 1).
  TensorParallelGroup pp = subgroup(layout.pp_groups, "pp");
  const std::vector<int>& pipeline = ParallelLayout::group_of(layout.pp_groups, env.rank);
  const bool in_embedding =
      pipeline.size() > 1 && (env.rank == pipeline.front() || env.rank == pipeline.back());
  set_pipeline_parallel_groups(std::move(pp), in_embedding
                                                  ? subgroup(layout.embedding_groups, "emb")
                                                  : TensorParallelGroup{});
  return tensor_parallel_group();
}

at::Tensor data_parallel_all_reduce_sum(const at::Tensor& x) {
  return group_all_reduce_sum(data_parallel_group(), x);
}

// ---- collectives ------------------------------------------------------------------------------

// Note [16-bit collectives]
// Collectives carry a tensor in its own type, as Megatron's do on NCCL: a bf16 or fp16 all-reduce
// sums in 16 bits (each addition rounded), every rank getting the same bits. (libtorch 1.13's
// Gloo refused bfloat16, so actmem once moved bf16 as float16 bits and summed it in fp32; the
// Gloo of PyTorch 2.11 to 2.15 reduces, gathers and exchanges bfloat16 itself.) Gradients are
// reduced in the fp32 main grads regardless (mixed_precision.h).
namespace {
int64_t total(const std::vector<int64_t>& v) {
  int64_t n = 0;
  for (const int64_t x : v) n += x;
  return n;
}
}  // namespace

namespace {
at::Tensor all_reduce_on(const TensorParallelGroup& g, const at::Tensor& x) {
  // In x's own type (Note [16-bit collectives]).
  std::vector<at::Tensor> buf = {x.contiguous().clone()};
  wait_and_release(g.pg->allreduce(buf));
  return buf[0];
}
}  // namespace

PendingAllReduce::PendingAllReduce() = default;
PendingAllReduce::~PendingAllReduce() = default;
PendingAllReduce::PendingAllReduce(PendingAllReduce&&) noexcept = default;
PendingAllReduce& PendingAllReduce::operator=(PendingAllReduce&&) noexcept = default;

PendingAllReduce start_group_all_reduce_sum(const TensorParallelGroup& g, const at::Tensor& x) {
  PendingAllReduce r;
  if (g.size == 1) {
    r.buffer_ = x;
    return r;
  }
  RECORD_FUNCTION("actmem::start_group_all_reduce", std::vector<c10::IValue>());
  r.buffer_ = x.contiguous().clone();  // in x's own type, as all_reduce_on
  std::vector<at::Tensor> buf = {r.buffer_};
  r.work_ = g.pg->allreduce(buf);
  return r;
}

at::Tensor PendingAllReduce::wait() {
  if (work_) {
    wait_and_release(std::move(work_));
    work_.reset();
  }
  at::Tensor out = std::move(buffer_);
  buffer_ = at::Tensor();
  return out;
}

at::Tensor group_all_reduce_sum(const TensorParallelGroup& g, const at::Tensor& x) {
  if (g.size == 1) return x;
  RECORD_FUNCTION("actmem::group_all_reduce", std::vector<c10::IValue>());
  return all_reduce_on(g, x);
}

at::Tensor group_all_gather_dim0(const TensorParallelGroup& g, const at::Tensor& x) {
  if (g.size == 1) return x;
  std::vector<int64_t> shape = x.sizes().vec();
  const int64_t n0 = shape[0];
  shape[0] *= g.size;
  at::Tensor out = at::empty(shape, x.options());
  // Each rank's part is written straight into its dim-0 slice (contiguous views).
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < g.size; ++r) outputs[0].push_back(out.narrow(0, r * n0, n0));
  std::vector<at::Tensor> inputs = {x.contiguous()};
  wait_and_release(g.pg->allgather(outputs, inputs));
  return out;
}

at::Tensor group_split_dim0(const TensorParallelGroup& g, const at::Tensor& x) {
  if (g.size == 1) return x;
  TORCH_CHECK(x.dim() >= 1 && x.size(0) % g.size == 0,
              "actmem::split_dim0: expected dim 0 "
              "divisible by the group size ",
              g.size, ", got shape ", x.sizes());
  const int64_t part = x.size(0) / g.size;
  return x.narrow(0, g.rank * part, part).clone();
}

at::Tensor group_reduce_scatter_dim0(const TensorParallelGroup& g, const at::Tensor& x) {
  if (g.size == 1) return x;
  // Note [Reduce-scatter on Gloo]: this rank's slice of the all-reduced tensor.
  TORCH_CHECK(x.dim() >= 1 && x.size(0) % g.size == 0,
              "actmem::reduce_scatter_dim0: expected "
              "dim 0 divisible by the group size ",
              g.size, ", got shape ", x.sizes());
  return group_split_dim0(g, all_reduce_on(g, x));
}

// Note [Uneven all-gather on Gloo]
// Megatron's gather_from_sequence_parallel_region with output_split_sizes (the all-to-all token
// dispatcher under expert tensor parallelism) gathers rows whose count differs per rank. Gloo's
// all-gather wants equal parts, so the uneven one is an all-to-all (alltoall_base takes uneven
// splits) in which each rank sends its whole x to every rank: t copies of x on the wire and one
// t-fold staging buffer, as an all-gather moves anyway. Its reverse, the uneven reduce-scatter,
// is an all-to-all of each rank's partial rows to their owner followed by the sum of the t
// parts in rank order (the same order on every rank).
at::Tensor group_all_gather_v(const TensorParallelGroup& g, const at::Tensor& x,
                              const std::vector<int64_t>& sizes) {
  TORCH_CHECK(static_cast<int>(sizes.size()) == g.size,
              "actmem::all_gather_v: one size per rank "
              "of the group (",
              g.size, ") expected, got ", sizes.size());
  TORCH_CHECK(x.dim() >= 1 && x.size(0) == sizes[static_cast<size_t>(g.rank)],
              "actmem::all_gather_v: "
              "x has ",
              x.dim() >= 1 ? x.size(0) : 0, " rows, this rank's size is ",
              sizes[static_cast<size_t>(g.rank)]);
  if (g.size == 1) return x;
  std::vector<int64_t> shape = x.sizes().vec();
  shape[0] = total(sizes);
  at::Tensor out = at::empty(shape, x.options());
  // The send buffer: x once per destination rank.
  at::Tensor send =
      at::cat(std::vector<at::Tensor>(static_cast<size_t>(g.size), x.contiguous()), 0);
  at::Tensor recv = out;
  std::vector<int64_t> out_splits = sizes;
  std::vector<int64_t> in_splits(static_cast<size_t>(g.size), x.size(0));
  wait_and_release(g.pg->alltoall_base(recv, send, out_splits, in_splits));
  return out;
}

at::Tensor group_reduce_scatter_v(const TensorParallelGroup& g, const at::Tensor& x,
                                  const std::vector<int64_t>& sizes) {
  TORCH_CHECK(static_cast<int>(sizes.size()) == g.size,
              "actmem::reduce_scatter_v: one size per "
              "rank of the group (",
              g.size, ") expected, got ", sizes.size());
  TORCH_CHECK(x.dim() >= 1 && x.size(0) == total(sizes), "actmem::reduce_scatter_v: x has ",
              x.dim() >= 1 ? x.size(0) : 0, " rows, the sizes add up to ", total(sizes));
  if (g.size == 1) return x;
  const int64_t mine = sizes[static_cast<size_t>(g.rank)];
  // The partials travel and add in x's own type (Note [16-bit collectives]).
  at::Tensor send = x.contiguous();
  std::vector<int64_t> shape = x.sizes().vec();
  shape[0] = mine * g.size;
  at::Tensor parts = at::empty(shape, send.options());
  std::vector<int64_t> out_splits(static_cast<size_t>(g.size), mine);
  std::vector<int64_t> in_splits = sizes;
  wait_and_release(g.pg->alltoall_base(parts, send, out_splits, in_splits));
  at::Tensor sum = parts.narrow(0, 0, mine).clone();
  for (int r = 1; r < g.size; ++r) sum.add_(parts.narrow(0, r * mine, mine));
  return sum;
}

at::Tensor all_reduce_sum(const at::Tensor& x) {
  if (single()) return x;
  RECORD_FUNCTION("actmem::all_reduce", std::vector<c10::IValue>());
  return all_reduce_on(tensor_parallel_group(), x);
}

at::Tensor all_gather_dim0(const at::Tensor& x) {
  if (single()) return x;
  RECORD_FUNCTION("actmem::all_gather", std::vector<c10::IValue>());
  return group_all_gather_dim0(tensor_parallel_group(), x);
}

at::Tensor reduce_scatter_dim0(const at::Tensor& x) {
  if (single()) return x;
  check_dim0(x, "actmem::reduce_scatter_dim0");
  RECORD_FUNCTION("actmem::reduce_scatter", std::vector<c10::IValue>());
  return split_dim0(all_reduce_sum(x));
}

at::Tensor split_dim0(const at::Tensor& x) {
  if (single()) return x;
  check_dim0(x, "actmem::split_dim0");
  return group_split_dim0(tensor_parallel_group(), x);
}

// ---- autograd mappings ------------------------------------------------------------------------

namespace {
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct CopyToRegion : torch::autograd::Function<CopyToRegion> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x) { return x.view_as(x); }
  static variable_list backward(AutogradContext*, variable_list g) {
    return {all_reduce_sum(g[0])};
  }
};

struct ReduceFromRegion : torch::autograd::Function<ReduceFromRegion> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x) { return all_reduce_sum(x); }
  static variable_list backward(AutogradContext*, variable_list g) { return {g[0]}; }
};

struct ScatterToSequence : torch::autograd::Function<ScatterToSequence> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x) { return split_dim0(x); }
  static variable_list backward(AutogradContext*, variable_list g) {
    return {all_gather_dim0(g[0])};
  }
};

struct GatherFromSequence : torch::autograd::Function<GatherFromSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, bool tp_output_grad) {
    ctx->saved_data["tp_output_grad"] = tp_output_grad;
    return all_gather_dim0(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const bool tp_output_grad = ctx->saved_data["tp_output_grad"].toBool();
    return {tp_output_grad ? reduce_scatter_dim0(g[0]) : split_dim0(g[0]), at::Tensor()};
  }
};

struct ReduceScatterToSequence : torch::autograd::Function<ReduceScatterToSequence> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x) {
    return reduce_scatter_dim0(x);
  }
  static variable_list backward(AutogradContext*, variable_list g) {
    return {all_gather_dim0(g[0])};
  }
};

// y = all_gather(x) W^T (+ b), saving the shard x rather than the gathered input; backward
// gathers x again for the weight gradient and reduce-scatters the input gradient. Two Functions
// (with and without bias): an undefined tensor cannot be a custom Function's input.
struct SequenceParallelLinearImpl {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias) {
    ctx->save_for_backward({x, weight});
    const at::Tensor full = all_gather_dim0(x);
    return bias.defined() ? at::linear(full, weight, bias) : at::linear(full, weight);
  }
  // Returns the gradients of x, weight and (if with_bias) bias.
  static variable_list backward(AutogradContext* ctx, const at::Tensor& grad, bool with_bias) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor g = grad.contiguous();      // [s, b, out/t]
    const at::Tensor full = all_gather_dim0(x);  // [s, b, in]
    const int64_t in = weight.size(1), out = weight.size(0);
    const at::Tensor g2 = g.view({-1, out});
    variable_list result = {reduce_scatter_dim0(at::matmul(g, weight)),
                            g2.t().mm(full.reshape({-1, in}))};
    if (with_bias) result.push_back(g2.sum(0));
    return result;
  }
};

struct SequenceParallelColumnLinear : torch::autograd::Function<SequenceParallelColumnLinear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight) {
    return SequenceParallelLinearImpl::forward(ctx, x, weight, at::Tensor());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return SequenceParallelLinearImpl::backward(ctx, grads[0], false);
  }
};

struct SequenceParallelColumnLinearBias
    : torch::autograd::Function<SequenceParallelColumnLinearBias> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias) {
    return SequenceParallelLinearImpl::forward(ctx, x, weight, bias);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return SequenceParallelLinearImpl::backward(ctx, grads[0], true);
  }
};
}  // namespace

at::Tensor copy_to_tensor_parallel_region(const at::Tensor& x) {
  return single() ? x : CopyToRegion::apply(x);
}

at::Tensor reduce_from_tensor_parallel_region(const at::Tensor& x) {
  return single() ? x : ReduceFromRegion::apply(x);
}

at::Tensor scatter_to_sequence_parallel_region(const at::Tensor& x) {
  return single() ? x : ScatterToSequence::apply(x);
}

at::Tensor gather_from_sequence_parallel_region(const at::Tensor& x,
                                                bool tensor_parallel_output_grad) {
  return single() ? x : GatherFromSequence::apply(x, tensor_parallel_output_grad);
}

at::Tensor reduce_scatter_to_sequence_parallel_region(const at::Tensor& x) {
  return single() ? x : ReduceScatterToSequence::apply(x);
}

at::Tensor column_parallel_linear(const at::Tensor& x, const at::Tensor& weight,
                                  const at::Tensor& bias, bool sequence_parallel) {
  if (sequence_parallel && !single()) {
    return bias.defined() ? SequenceParallelColumnLinearBias::apply(x, weight, bias)
                          : SequenceParallelColumnLinear::apply(x, weight);
  }
  const at::Tensor in = copy_to_tensor_parallel_region(x);
  return bias.defined() ? at::linear(in, weight, bias) : at::linear(in, weight);
}

at::Tensor row_parallel_linear(const at::Tensor& x, const at::Tensor& weight,
                               bool sequence_parallel) {
  const at::Tensor partial = at::linear(x, weight);
  return sequence_parallel ? reduce_scatter_to_sequence_parallel_region(partial)
                           : reduce_from_tensor_parallel_region(partial);
}

// ---- distribute_saved_activations -------------------------------------------------------------

at::Tensor split_tensor_into_1d_equal_chunks(const at::Tensor& x) {
  const auto& g = tensor_parallel_group();
  TORCH_CHECK(x.numel() % g.size == 0, "actmem::split_tensor_into_1d_equal_chunks: ",
              "distribute_saved_activations needs the checkpoint input's element count (",
              x.numel(), ", shape ", x.sizes(), ") divisible by the tensor-parallel size ", g.size);
  const int64_t part = x.numel() / g.size;
  return x.reshape({-1}).narrow(0, g.rank * part, part).clone();
}

at::Tensor gather_split_1d_tensor(const at::Tensor& chunk) {
  TORCH_CHECK(chunk.dim() == 1, "actmem::gather_split_1d_tensor: expected a 1-D chunk, got shape ",
              chunk.sizes());
  return all_gather_dim0(chunk);
}

}  // namespace actmem
