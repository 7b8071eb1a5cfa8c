// compat.h — the one place where differences between libtorch versions live.
//
// actmem builds against Debian's libtorch 1.13 (CPU) and against the CUDA libtorch 2.x shipped
// inside a PyTorch installation. Every API whose signature moved between those versions is
// wrapped here, so the rest of the code never tests TORCH_VERSION itself.
#pragma once

#include <c10/core/Allocator.h>
#include <cstdint>
#include <torch/version.h>

#define ACTMEM_TORCH_VERSION_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||                 \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// c10::Allocator::allocate lost its `const` in libtorch 2.3 and gained a pure virtual
// copy_data(). Allocators declare `DataPtr allocate(size_t) ACTMEM_ALLOCATE_CONST override`
// and add ACTMEM_ALLOCATOR_COPY_DATA to their body.
#if ACTMEM_TORCH_VERSION_AT_LEAST(2, 3)
#define ACTMEM_ALLOCATE_CONST
#define ACTMEM_ALLOCATOR_COPY_DATA                                           \
  void copy_data(void* dest, const void* src, std::size_t count) const override { \
    default_copy_data(dest, src, count);                                 \
  }
#else
#define ACTMEM_ALLOCATE_CONST const
#define ACTMEM_ALLOCATOR_COPY_DATA
#endif

namespace actmem::compat {

/// Statistics of the CUDA caching allocator for one device, in bytes.
struct CudaMemoryStats {
  int64_t allocated_current = 0;
  int64_t allocated_peak = 0;
};

/// True when this build has the CUDA paths compiled in and a CUDA device is visible.
bool cuda_available();
/// Reads the caching allocator's allocated-bytes statistics. Throws without CUDA.
CudaMemoryStats cuda_memory_stats(int device);
/// Resets the caching allocator's peak statistics for `device`. Throws without CUDA.
void cuda_reset_peak(int device);
/// Waits for all work queued on `device`. No-op without CUDA.
void cuda_synchronize(int device);

}  // namespace actmem::compat
