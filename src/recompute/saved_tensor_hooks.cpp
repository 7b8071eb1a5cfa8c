// saved_tensor_hooks.cpp — the engine subclass that feeds autograd our saved-tensor hooks.
#include "actmem/recompute/saved_tensor_hooks.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>
#include <torch/csrc/autograd/variable.h>

#include <mutex>
#include <vector>

namespace actmem {

namespace {

thread_local std::vector<SavedTensorHook*> t_stack;

// What autograd stores in a SavedVariable while hooks are active: either a detached alias of the
// tensor (every hook only observed it) or the innermost hook's PackedTensor.
// Note [Hooked saved variables]
// - A detached alias, not the tensor: a tensor saved by the node that produced it would point
//   back at that node (a reference cycle that leaks the graph if backward never runs);
//   SavedVariable re-attaches the gradient edge on unpack.
// - libtorch skips its in-place version check when hooks are set, so the check is done here,
//   with the same message, against the version counter captured at pack time.
class StackHooks final : public torch::autograd::SavedVariableHooks {
 public:
  explicit StackHooks(std::vector<SavedTensorHook*> stack) : stack_(std::move(stack)) {}
  void call_pack_hook(const at::Tensor& tensor) override {
    for (SavedTensorHook* hook : stack_) {
      if (auto p = hook->pack(tensor)) packed_ = std::move(p);  // innermost wins
    }
    if (!packed_) tensor_ = tensor.detach();
    version_ = torch::autograd::impl::version_counter(tensor);
    saved_version_ = version_.current_version();
    stack_.clear();
  }
  at::Tensor call_unpack_hook() override {
    TORCH_CHECK(version_.current_version() == saved_version_,
                "one of the variables needed for gradient computation has been modified by an "
                "inplace operation: it is at version ",
                version_.current_version(), "; expected version ", saved_version_, " instead.");
    return packed_ ? packed_->unpack() : tensor_;
  }

 private:
  std::vector<SavedTensorHook*> stack_;
  std::shared_ptr<PackedTensor> packed_;
  at::Tensor tensor_;
  c10::VariableVersion version_{0};
  uint32_t saved_version_ = 0;
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

size_t saved_tensor_hooks_depth() {
  return t_stack.size();
}

}  // namespace actmem
