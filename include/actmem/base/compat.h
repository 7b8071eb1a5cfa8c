// compat.h — the one place where differences between libtorch versions live.
//
// actmem builds against the libtorch inside a PyTorch 2.11 to 2.15 installation (the PyPI wheel,
// CUDA build; scripts/setup.sh). Every API whose signature moved within that range is wrapped
// here, so the rest of the code never tests TORCH_VERSION itself.
#pragma once

#include <string>

#include <c10/core/Allocator.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/version.h>

#include <cstdint>
#include <memory>
#include <optional>

namespace torch::autograd {
struct Node;
}  // namespace torch::autograd

#define ACTMEM_TORCH_VERSION_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||                 \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace actmem::compat {

// Autograd nodes (grad_fn(), grad accumulators) are held by std::shared_ptr up to libtorch 2.12
// and by c10::intrusive_ptr from 2.13 on.
#if ACTMEM_TORCH_VERSION_AT_LEAST(2, 13)
using NodePtr = c10::intrusive_ptr<torch::autograd::Node>;
#else
using NodePtr = std::shared_ptr<torch::autograd::Node>;
#endif

/// A weak reference to an autograd node, empty until assigned (c10::weak_intrusive_ptr has no
/// empty state of its own). A template so that the node type need be complete only where it is
/// used (torch/csrc/autograd/function.h), not where this header is included.
template <typename Node = torch::autograd::Node>
class BasicWeakNodePtr {
 public:
  BasicWeakNodePtr() = default;
  BasicWeakNodePtr& operator=(const NodePtr& node) {
    weak_.reset();
    if (node) weak_.emplace(node);
    return *this;
  }
  /// The node while it lives, else null.
  NodePtr lock() const { return weak_ ? weak_->lock() : NodePtr(); }

 private:
#if ACTMEM_TORCH_VERSION_AT_LEAST(2, 13)
  std::optional<c10::weak_intrusive_ptr<Node>> weak_;
#else
  std::optional<std::weak_ptr<Node>> weak_;
#endif
};
using WeakNodePtr = BasicWeakNodePtr<>;

/// Statistics of the CUDA caching allocator for one device, in bytes.
struct CudaMemoryStats {
  int64_t allocated_current = 0;
  int64_t allocated_peak = 0;
  int64_t reserved_current = 0;     // the caching allocator's segments
  int64_t allocations_current = 0;  // live allocations
};

/// True when this build has the CUDA paths compiled in and a CUDA device is visible.
bool cuda_available();
/// The CUDA devices visible to this process (0 without the CUDA paths or without a GPU).
int cuda_device_count();
/// The CUDA runtime version the CUDA paths were compiled against ("13.0"); empty without them.
std::string cuda_compiled_version();
/// Reads the caching allocator's allocated-bytes statistics. Throws without CUDA.
CudaMemoryStats cuda_memory_stats(int device);
/// Resets the caching allocator's peak statistics for `device`. Throws without CUDA.
void cuda_reset_peak(int device);
/// Waits for all work queued on `device`. No-op without CUDA.
void cuda_synchronize(int device);

}  // namespace actmem::compat
