// saved_tensor_hooks.cpp — the engine subclass that feeds autograd our saved-tensor hooks.
#include "actmem/saved_tensor_hooks.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>

#include <mutex>
#include <vector>

namespace actmem {

namespace {

thread_local std::vector<SavedTensorHook*> t_stack;

// What autograd stores in a SavedVariable while hooks are active: either the tensor itself
// (every hook only observed it) or the innermost hook's PackedTensor.
class StackHooks final : public torch::autograd::SavedVariableHooks {
 public:
  explicit StackHooks(std::vector<SavedTensorHook*> stack) : stack_(std::move(stack)) {}
  void call_pack_hook(const at::Tensor& tensor) override {
    for (SavedTensorHook* hook : stack_) {
      if (auto p = hook->pack(tensor)) packed_ = std::move(p);  // innermost wins
    }
    if (!packed_) tensor_ = tensor;
    stack_.clear();
  }
  at::Tensor call_unpack_hook() override { return packed_ ? packed_->unpack() : tensor_; }

 private:
  std::vector<SavedTensorHook*> stack_;
  std::shared_ptr<PackedTensor> packed_;
  at::Tensor tensor_;
};

// Note [Saved-tensor hook engine]
// Engine's constructor is protected; a subclass with no other behaviour is the default engine
// once installed, so every backward in the process runs on it. Without hooks on the current
// thread it returns the base class's answer (none), so SavedVariable behaves as upstream.
class HookedEngine final : public torch::autograd::Engine {
 public:
  std::unique_ptr<torch::autograd::SavedVariableHooks> get_default_saved_variable_hooks() override {
    if (t_stack.empty()) return Engine::get_default_saved_variable_hooks();
    return std::make_unique<StackHooks>(t_stack);
  }
};

torch::autograd::Engine& hooked_engine() {
  static HookedEngine engine;
  return engine;
}

void install_engine() {
  static std::once_flag once;
  std::call_once(once, [] { torch::autograd::set_default_engine_stub(&hooked_engine); });
}

}  // namespace

SavedTensorHooksGuard::SavedTensorHooksGuard(SavedTensorHook& hook) {
  install_engine();
  t_stack.push_back(&hook);
}

SavedTensorHooksGuard::~SavedTensorHooksGuard() {
  TORCH_INTERNAL_ASSERT(!t_stack.empty(), "SavedTensorHooksGuard: stack underflow");
  t_stack.pop_back();
}

size_t saved_tensor_hooks_depth() { return t_stack.size(); }

}  // namespace actmem
