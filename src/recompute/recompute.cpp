// recompute.cpp — CheckpointFunction and CheckpointWithoutOutput on libtorch's C++ autograd.
#include "actmem/recompute/recompute.h"

#include "actmem/base/compat.h"
#include "actmem/parallel/tensor_parallel.h"
#include "actmem/recompute/rng.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/custom_class_detail.h>

#include <memory>

namespace actmem {

namespace {

std::atomic<int> g_checkpointing_depth{0};

std::atomic<int> g_recomputing_depth{0};

struct CheckpointingScope {
  CheckpointingScope() { g_checkpointing_depth.fetch_add(1); }
  ~CheckpointingScope() { g_checkpointing_depth.fetch_sub(1); }
};

struct RecomputingScope {
  RecomputingScope() { g_recomputing_depth.fetch_add(1); }
  ~RecomputingScope() { g_recomputing_depth.fetch_sub(1); }
};

void check_backward_not_grad(const char* api) {
  TORCH_CHECK(torch::autograd::Engine::get_default_engine().is_checkpoint_valid(), api,
              ": checkpointing is not compatible with torch::autograd::grad(); use backward() "
              "(as Megatron: \"Checkpointing is not compatible with .grad()\")");
}

// Note [One replay]
// Both checkpoint kinds recompute the same way: the forward ran without a graph under a random
// state it snapshotted; the replay runs fn on detached aliases of the inputs (the leaves of a
// fresh graph, requiring grad as the inputs did in forward), with grad on, under that snapshot
// inside ForkRng (the ambient state is restored afterwards), then backpropagates the output
// gradients through the fresh graph and hands the leaves' gradients back as the inputs'. The
// helpers below are that sequence, shared by CheckpointFunction and CheckpointWithoutOutput
// (MLX builds its checkpoint on one such primitive).

// Throws unless some input requires grad: otherwise parameters inside fn would get no gradient.
void check_some_input_requires_grad(const TensorList& inputs, const char* api) {
  for (const auto& t : inputs) {
    if (t.defined() && t.requires_grad()) return;
  }
  TORCH_CHECK(false, api,
              ": no input requires grad, so parameters used inside the checkpoint "
              "would receive no gradient (the checkpoint needs at least one input that requires "
              "grad)");
}

// Detached aliases of `inputs`, requiring grad where needs_grad says: the replay's leaves.
TensorList detached_leaves(const TensorList& inputs, const std::vector<bool>& needs_grad) {
  TensorList out;
  out.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) {
      out.emplace_back();
      continue;
    }
    at::Tensor d = inputs[i].detach();
    d.set_requires_grad(needs_grad[i]);
    out.push_back(std::move(d));
  }
  return out;
}

std::vector<bool> requires_grad_of(const TensorList& inputs) {
  std::vector<bool> needs;
  needs.reserve(inputs.size());
  for (const auto& t : inputs) needs.push_back(t.defined() && t.requires_grad());
  return needs;
}

// Runs fn on `leaves` with grad on, under `rng`, leaving the ambient random state untouched.
TensorList replay(const CheckpointFn& fn, const RngSnapshot& rng, const TensorList& leaves) {
  RecomputingScope recomputing;
  ForkRng keep_ambient;  // restores the pre-recompute state on exit
  set_all_rng_states(rng);
  at::AutoGradMode enable(true);
  return fn(leaves);
}

// The backward's return: nothing for the state argument, then the inputs' gradients.
TensorList with_state_slot(TensorList input_grads) {
  TensorList result;
  result.reserve(1 + input_grads.size());
  result.emplace_back();
  for (auto& g : input_grads) result.push_back(std::move(g));
  return result;
}

// Note [Checkpoint input gradients keep their layout]
// A leaf's .grad obeys autograd's layout contract: AccumulateGrad copies an incoming gradient
// whose strides differ from the leaf's into the leaf's strides (clone_obey_contract). Without a
// checkpoint the same gradient flows on with the strides the op that produced it gave it, and a
// later reduction over it (MLA's shared RoPE key part summed over heads, the expand's backward)
// adds in another order when the layout differs: the checkpointed run would round differently.
// So the leaves' gradients are taken by a hook as they arrive, before AccumulateGrad, exactly as
// the plain graph would pass them on.
// Backpropagates `grads` through those `outputs` that require grad; returns the inputs' grads.
TensorList backward_through(const TensorList& outputs, const TensorList& grads,
                            const TensorList& leaves, const char* api) {
  TensorList roots, root_grads;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (outputs[i].defined() && outputs[i].requires_grad() && i < grads.size() &&
        grads[i].defined()) {
      roots.push_back(outputs[i]);
      root_grads.push_back(grads[i]);
    }
  }
  TORCH_CHECK(!roots.empty() || outputs.empty(), api,
              ": none of the recomputed outputs requires grad; this checkpoint is not necessary");
  // Shared with the hooks, which live as long as the leaves.
  auto input_grads = std::make_shared<TensorList>(leaves.size());
  for (size_t i = 0; i < leaves.size(); ++i) {
    at::Tensor leaf = leaves[i];  // a handle: register_hook is not const
    if (!leaf.defined() || !leaf.requires_grad()) continue;
    leaf.register_hook([input_grads, i](const at::Tensor& g) {
      (*input_grads)[i] = g;
      return at::Tensor();  // unchanged
    });
  }
  if (!roots.empty()) torch::autograd::backward(roots, root_grads);
  return *input_grads;
}

// ---- CheckpointFunction -----------------------------------------------------------------------

struct CheckpointState : torch::CustomClassHolder {
  CheckpointFn fn;
  RngSnapshot rng;
  // Note [distribute_saved_activations]: with t > 1 tensor-parallel ranks the first input is
  // kept as this rank's 1/t chunk (flattened, a new buffer: the caller's full tensor is freed
  // when the caller drops it) and all-gathered back to its shape before the replay.
  bool distribute = false;
  std::vector<int64_t> input0_shape;
  bool input0_requires_grad = false;
};

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static TensorList forward(torch::autograd::AutogradContext* ctx,
                            const c10::intrusive_ptr<CheckpointState>& state,
                            at::TensorList inputs) {
    CheckpointingScope scope;
    state->rng = get_all_rng_states();
    TensorList in(inputs.begin(), inputs.end());
    TensorList outputs = state->fn(in);  // grad mode is off inside Function::forward
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    if (state->distribute && !in.empty() && in[0].defined()) {
      state->input0_shape = in[0].sizes().vec();
      state->input0_requires_grad = in[0].requires_grad();
      TensorList kept = in;
      kept[0] = split_tensor_into_1d_equal_chunks(in[0]);
      ctx->save_for_backward(kept);
    } else {
      state->distribute = false;
      ctx->save_for_backward(in);
    }
    recompute_counters().checkpoints.fetch_add(1);
    return outputs;
  }

  static TensorList backward(torch::autograd::AutogradContext* ctx, TensorList grads) {
    check_backward_not_grad("actmem::checkpoint");
    CheckpointingScope scope;
    auto state = c10::static_intrusive_pointer_cast<CheckpointState>(
        ctx->saved_data.at("state").toCapsule());
    TensorList saved = ctx->get_saved_variables();
    if (state->distribute) saved[0] = gather_split_1d_tensor(saved[0]).view(state->input0_shape);
    std::vector<bool> needs_grad = requires_grad_of(saved);
    if (state->distribute) needs_grad[0] = state->input0_requires_grad;
    const TensorList leaves = detached_leaves(saved, needs_grad);
    const TensorList outputs = replay(state->fn, state->rng, leaves);
    recompute_counters().recomputes.fetch_add(1);
    return with_state_slot(backward_through(outputs, grads, leaves, "actmem::checkpoint"));
  }
};

}  // namespace

bool is_checkpointing() {
  return g_checkpointing_depth.load() > 0;
}

bool is_recomputing() {
  return g_recomputing_depth.load() > 0;
}

void RecomputeCounters::reset() {
  checkpoints = 0;
  recomputes = 0;
  discarded_outputs = 0;
  output_recomputes = 0;
}

RecomputeCounters& recompute_counters() {
  static RecomputeCounters counters;
  return counters;
}

TensorList checkpoint(const CheckpointFn& fn, bool distribute_saved_activations,
                      const TensorList& inputs) {
  if (!at::GradMode::is_enabled()) return fn(inputs);
  check_some_input_requires_grad(inputs, "actmem::checkpoint");
  RECORD_FUNCTION("actmem::checkpoint", std::vector<c10::IValue>());
  auto state = c10::make_intrusive<CheckpointState>();
  state->fn = fn;
  // Note [distribute_saved_activations]; with t = 1 the chunk would be the whole tensor.
  state->distribute = distribute_saved_activations && tensor_parallel_group().size > 1;
  return CheckpointFunction::apply(state, at::TensorList(inputs));
}

// ---- CheckpointWithoutOutput ------------------------------------------------------------------

struct CheckpointWithoutOutput::State : torch::CustomClassHolder {
  CheckpointFn fn;
  RngSnapshot rng;
  // The checkpoint's autograd node: its saved variables are the inputs. Reading them through
  // autograd (not through aliases kept here) checks their versions and lets saved-tensor hooks
  // (offload) bring them back to the device before the replay: a recompute's inputs must be on
  // the device before it runs (docs/offload.md, the paragraph on selective recompute).
  compat::WeakNodePtr node;
  std::vector<bool> needs_grad;  // which inputs required grad in forward
  // The outputs' storages, not the output tensors: a tensor would point back at the autograd
  // node that owns this state (a reference cycle that nothing in C++ would collect).
  std::vector<c10::intrusive_ptr<c10::StorageImpl>> storages;
  std::vector<size_t> nbytes;
  bool active = false;  // checkpoint() ran with grad: there is something to recompute
  bool discarded = false;
  bool recomputed = false;
  bool consumed = false;  // the checkpoint's backward ran
  TensorList recomputed_outputs;
  TensorList leaves;

  void recompute(const TensorList& inputs);
  TensorList saved_inputs();
};

namespace {

// Note [Zero-copy re-attach]
// The original output's StorageImpl is pointed at the recomputed bytes: its new DataPtr holds a
// reference to the recomputed Storage, so the bytes live while either storage does and are
// counted once. Tensors and saved views keep their StorageImpl, sizes, strides and version
// counter, so autograd's saved-variable version check passes and every view sees the data.
void share_storage(c10::StorageImpl* dst, const c10::Storage& src) {
  auto* holder = new c10::Storage(src);
  dst->set_data_ptr_noswap(c10::DataPtr(
      src.unsafeGetStorageImpl()->data_ptr().get(), holder,
      [](void* ctx) { delete static_cast<c10::Storage*>(ctx); }, src.device()));
  dst->set_nbytes(src.nbytes());
}

struct OutputDiscardFunction : torch::autograd::Function<OutputDiscardFunction> {
  static TensorList forward(torch::autograd::AutogradContext* ctx,
                            const c10::intrusive_ptr<CheckpointWithoutOutput::State>& state,
                            at::TensorList inputs) {
    CheckpointingScope scope;
    TensorList in(inputs.begin(), inputs.end());
    state->rng = get_all_rng_states();
    TensorList outputs = state->fn(in);
    state->needs_grad = requires_grad_of(in);
    for (const auto& out : outputs) {
      TORCH_CHECK(out.defined(),
                  "actmem::CheckpointWithoutOutput: fn returned an undefined tensor");
      c10::StorageImpl* impl = out.storage().unsafeGetStorageImpl();
      // Discarding frees the whole storage: it must belong to the outputs alone.
      for (const auto& t : in) {
        TORCH_CHECK(!t.defined() || !t.has_storage() || t.storage().unsafeGetStorageImpl() != impl,
                    "actmem::CheckpointWithoutOutput: fn returned a view or alias of an input; "
                    "discarding it would free the input (return a new tensor)");
      }
      int64_t sharing = 0;
      for (const auto& o : outputs) sharing += o.storage().unsafeGetStorageImpl() == impl;
      TORCH_CHECK(static_cast<int64_t>(out.storage().use_count()) == sharing,
                  "actmem::CheckpointWithoutOutput: an output's storage is also held elsewhere "
                  "(a view of a parameter or cache?); discarding it would free that memory");
      state->storages.push_back(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(impl));
      state->nbytes.push_back(out.storage().nbytes());
    }
    state->active = true;
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    // Saved through autograd as Megatron does, so saved-tensor hooks (the activation ledger)
    // see what this checkpoint keeps; the state's aliases share the same storages.
    ctx->save_for_backward(in);
    return outputs;
  }

  static TensorList backward(torch::autograd::AutogradContext* ctx, TensorList grads) {
    auto state = c10::static_intrusive_pointer_cast<CheckpointWithoutOutput::State>(
        ctx->saved_data.at("state").toCapsule());
    TORCH_CHECK(!state->consumed,
                "actmem::CheckpointWithoutOutput: backward ran through this "
                "checkpoint a second time (retain_graph); output-discarding checkpoints support "
                "one backward");
    state->consumed = true;
    if (!state->recomputed) {
      // discard_output_and_register_recompute() was not called (or its hook never fired):
      // recompute now. The outputs' storages still hold their data or get it re-attached.
      check_backward_not_grad("actmem::CheckpointWithoutOutput");
      state->recompute(ctx->get_saved_variables());
    }
    TensorList input_grads = backward_through(state->recomputed_outputs, grads, state->leaves,
                                              "actmem::CheckpointWithoutOutput");
    state->recomputed_outputs.clear();
    state->leaves.clear();
    return with_state_slot(std::move(input_grads));
  }
};

}  // namespace

TensorList CheckpointWithoutOutput::State::saved_inputs() {
  const compat::NodePtr locked = node.lock();  // keeps the node alive while its inputs are read
  auto* n = dynamic_cast<torch::autograd::CppNode<OutputDiscardFunction>*>(locked.get());
  TORCH_CHECK(n != nullptr,
              "actmem::CheckpointWithoutOutput: the checkpoint's autograd node is "
              "gone (its graph was freed) before the recompute");
  return n->ctx_.get_saved_variables();
}

void CheckpointWithoutOutput::State::recompute(const TensorList& inputs) {
  if (recomputed) return;
  CheckpointingScope scope;
  leaves = detached_leaves(inputs, needs_grad);
  recomputed_outputs = replay(fn, rng, leaves);
  TORCH_CHECK(recomputed_outputs.size() == storages.size(),
              "actmem::CheckpointWithoutOutput: the recompute returned ", recomputed_outputs.size(),
              " outputs, the forward ", storages.size());
  for (size_t i = 0; i < storages.size(); ++i) {
    const at::Tensor& out = recomputed_outputs[i];
    TORCH_CHECK(out.storage().nbytes() == nbytes[i],
                "actmem::CheckpointWithoutOutput: recomputed output ", i, " has ",
                out.storage().nbytes(), " bytes, the forward's had ", nbytes[i]);
    if (discarded) share_storage(storages[i].get(), out.storage());
  }
  storages.clear();
  fn = nullptr;
  rng = RngSnapshot{};
  recomputed = true;
  recompute_counters().output_recomputes.fetch_add(1);
}

CheckpointWithoutOutput::CheckpointWithoutOutput() : state_(c10::make_intrusive<State>()) {}

CheckpointWithoutOutput::~CheckpointWithoutOutput() = default;

TensorList CheckpointWithoutOutput::checkpoint(const CheckpointFn& fn, const TensorList& inputs) {
  TORCH_CHECK(!state_->active,
              "actmem::CheckpointWithoutOutput::checkpoint: this object already "
              "holds a checkpoint; use one object per checkpointed call");
  if (!at::GradMode::is_enabled()) return fn(inputs);
  check_some_input_requires_grad(inputs, "actmem::CheckpointWithoutOutput::checkpoint");
  RECORD_FUNCTION("actmem::checkpoint_without_output", std::vector<c10::IValue>());
  state_->fn = fn;
  TensorList outputs = OutputDiscardFunction::apply(state_, at::TensorList(inputs));
  TORCH_INTERNAL_ASSERT(!outputs.empty() && outputs[0].grad_fn() != nullptr);
  state_->node = outputs[0].grad_fn();
  return outputs;
}

void CheckpointWithoutOutput::discard_output_and_register_recompute(const at::Tensor& hook_tensor) {
  State& st = *state_;
  if (!st.active || st.recomputed) return;
  TORCH_CHECK(!st.discarded,
              "actmem::CheckpointWithoutOutput::discard_output_and_register_recompute: "
              "called twice for one checkpoint");
  if (!hook_tensor.requires_grad()) return;
  for (size_t i = 0; i < st.storages.size(); ++i) {
    c10::StorageImpl* impl = st.storages[i].get();
    impl->set_data_ptr_noswap(c10::DataPtr(nullptr, impl->device()));
    impl->set_nbytes(0);
  }
  st.discarded = true;
  recompute_counters().discarded_outputs.fetch_add(static_cast<int64_t>(st.storages.size()));
  c10::intrusive_ptr<State> keep = state_;
  hook_tensor.register_hook([keep](const at::Tensor&) {
    if (keep->recomputed) return;
    check_backward_not_grad("actmem::CheckpointWithoutOutput");
    keep->recompute(keep->saved_inputs());
  });
}

}  // namespace actmem
