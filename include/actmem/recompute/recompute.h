// recompute.h — activation recompute: Megatron's CheckpointFunction and CheckpointWithoutOutput.
//
// One mechanism: a forward that runs without building a graph and remembers its inputs and the
// random state, and a backward (or a gradient hook) that replays it under that random state with
// grad enabled. Full and selective recompute are thin uses of it in the model (src/model/).
// Nothing here knows about transformers: a checkpoint takes a function of tensors.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <vector>

namespace actmem {

using TensorList = std::vector<at::Tensor>;
using CheckpointFn = std::function<TensorList(const TensorList&)>;

/// Megatron's CheckpointFunction. With grad enabled: runs fn(inputs) without a graph, saves only
/// the inputs and a deep snapshot of every random state, and returns fn's outputs. Its backward
/// restores the snapshot inside ForkRng (the ambient random state is left untouched), reruns fn
/// with grad on detached inputs, backpropagates the output gradients through that graph (which
/// also accumulates parameter gradients) and returns the input gradients.
/// - With grad disabled it simply returns fn(inputs).
/// - At least one input must require grad (else parameters inside would get no gradient).
/// - Backward through torch::autograd::grad() is refused, as in Megatron ("Checkpointing is not
///   compatible with .grad()"): use backward().
/// - distribute_saved_activations keeps the first input as this rank's 1/t chunk of the
///   tensor-parallel group (tensor_parallel.h) and all-gathers it before the replay; with a
///   single rank the chunk would be the whole tensor, so nothing changes.
/// fn must be deterministic given its inputs and the random state, and must not keep references
/// to its inputs beyond the call.
TensorList checkpoint(const CheckpointFn& fn, bool distribute_saved_activations,
                      const TensorList& inputs);

/// True while a checkpoint's forward or its recompute runs (Megatron's is_checkpointing());
/// exception-safe, and nesting-aware.
bool is_checkpointing();

/// True only while a checkpoint is being replayed in backward (a subset of is_checkpointing()).
bool is_recomputing();

/// Counts of recompute events since the last reset, for tests and reports.
struct RecomputeCounters {
  std::atomic<int64_t> checkpoints{0};        // CheckpointFunction forwards
  std::atomic<int64_t> recomputes{0};         // CheckpointFunction backward replays
  std::atomic<int64_t> discarded_outputs{0};  // storages freed by CheckpointWithoutOutput
  std::atomic<int64_t> output_recomputes{0};  // CheckpointWithoutOutput replays
  void reset();
};
RecomputeCounters& recompute_counters();

/// Megatron's CheckpointWithoutOutput (megatron/core/tensor_parallel/random.py): a checkpoint
/// whose *outputs* are also freed.
///   auto y = ckpt.checkpoint(norm_fn, {x})[0];   // no graph inside; x and the RNG kept
///   auto z = consumer(y);                        // consumers save y
///   ckpt.discard_output_and_register_recompute(z);
/// discard frees y's storage (0 bytes; every view keeps its metadata). When z's gradient is
/// computed in backward, fn is replayed under the saved random state and y's storage is pointed
/// at the recomputed bytes without a copy, so every saved view of y sees the data and y's
/// version counter is unchanged; the checkpoint's own backward then reuses that recomputed graph.
/// If backward reaches the checkpoint before the hook ran (discard was not called), it
/// recomputes then. Copyable handle; copies share one state.
class CheckpointWithoutOutput {
 public:
  CheckpointWithoutOutput();
  ~CheckpointWithoutOutput();
  TensorList checkpoint(const CheckpointFn& fn, const TensorList& inputs);
  /// Frees the outputs' storage and recomputes them from hook_tensor's gradient hook.
  /// Precondition: nothing reads the outputs in forward any more. No-op when checkpoint() ran
  /// without grad (nothing to recompute) or when hook_tensor does not require grad.
  void discard_output_and_register_recompute(const at::Tensor& hook_tensor);

  struct State;

 private:
  c10::intrusive_ptr<State> state_;
};

}  // namespace actmem
