// compat.cpp — version-dependent calls behind include/actmem/base/compat.h.
#include "actmem/base/compat.h"

#include <c10/util/Exception.h>

#ifdef ACTMEM_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#endif

namespace actmem::compat {

#ifdef ACTMEM_WITH_CUDA
bool cuda_available() {
  return c10::cuda::device_count() > 0;
}

int cuda_device_count() {
  return c10::cuda::device_count();
}

std::string cuda_compiled_version() {
  return std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10);
}

CudaMemoryStats cuda_memory_stats(int device) {
  namespace cca = c10::cuda::CUDACachingAllocator;
  const auto stats = cca::getDeviceStats(static_cast<c10::DeviceIndex>(device));
  // Index 0 is the aggregate pool in every version (StatType::AGGREGATE moved from
  // CUDACachingAllocator to c10::CachingAllocator in libtorch 2.6).
  const auto& allocated = stats.allocated_bytes[0];
  return {allocated.current, allocated.peak, stats.reserved_bytes[0].current,
          stats.allocation[0].current};
}

void cuda_reset_peak(int device) {
  c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device));
}

void cuda_synchronize(int device) {
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));
  c10::cuda::device_synchronize();
}
#else
bool cuda_available() {
  return false;
}

int cuda_device_count() {
  return 0;
}

std::string cuda_compiled_version() {
  return {};
}

CudaMemoryStats cuda_memory_stats(int) {
  TORCH_CHECK(false,
              "actmem::compat::cuda_memory_stats: this build has no CUDA support "
              "(configure with a CUDA libtorch and -DACTMEM_CUDA=ON)");
}

void cuda_reset_peak(int) {
  TORCH_CHECK(false, "actmem::compat::cuda_reset_peak: this build has no CUDA support");
}

void cuda_synchronize(int) {}
#endif

}  // namespace actmem::compat
