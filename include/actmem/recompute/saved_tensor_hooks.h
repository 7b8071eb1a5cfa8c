// saved_tensor_hooks.h — the C++ counterpart of torch.autograd.graph.saved_tensors_hooks.
//
// libtorch's global saved-tensor hook stack (at::SavedTensorDefaultHooks) holds Python objects:
// it has no pure-C++ form, in 1.13 and in 2.x alike. The autograd engine, however, asks
// Engine::get_default_saved_variable_hooks() for hooks every time an op saves a tensor; actmem
// installs an Engine subclass (set_default_engine_stub) that returns hooks built from a per-thread
// stack of SavedTensorHook objects (docs/memory-model.md, "The ledger"). This header is the only
// place that knows; callers push hooks with SavedTensorHooksGuard.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>

namespace actmem {

/// A saved tensor replaced by something else until backward needs it (offload's handle).
class PackedTensor {
 public:
  virtual ~PackedTensor() = default;
  /// Returns the tensor autograd saved (same shape, dtype and values). Called once per use.
  virtual at::Tensor unpack() = 0;
};

/// One layer of the stack. Every layer on the stack sees every saved tensor (outermost first);
/// the innermost layer that returns a PackedTensor replaces the tensor, otherwise autograd keeps
/// the tensor itself, exactly as without hooks.
class SavedTensorHook {
 public:
  virtual ~SavedTensorHook() = default;
  /// Called when an autograd op saves `tensor` for backward (parameters included: filter them).
  virtual std::shared_ptr<PackedTensor> pack(const at::Tensor& tensor) = 0;
};

/// Pushes `hook` on this thread's stack for the guard's lifetime. The hook must outlive the
/// guard; tensors packed while it was active keep their PackedTensor alive on their own.
class SavedTensorHooksGuard {
 public:
  explicit SavedTensorHooksGuard(SavedTensorHook& hook);
  ~SavedTensorHooksGuard();
  SavedTensorHooksGuard(const SavedTensorHooksGuard&) = delete;
  SavedTensorHooksGuard& operator=(const SavedTensorHooksGuard&) = delete;
};

/// Number of hooks on this thread's stack.
size_t saved_tensor_hooks_depth();

}  // namespace actmem
