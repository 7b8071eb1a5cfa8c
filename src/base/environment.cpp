// environment.cpp — available_cores and runtime_info.
#include "actmem/base/environment.h"

#include "actmem/base/blas.h"
#include "actmem/base/compat.h"

#include <ATen/Parallel.h>
#include <torch/version.h>
#include <nlohmann/json.hpp>

#include <sched.h>
#include <algorithm>
#include <string>
#include <thread>

#ifndef ACTMEM_VERSION
#define ACTMEM_VERSION "unknown"
#endif

namespace actmem {

int available_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

namespace {
std::string torch_version() {
  return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
         std::to_string(TORCH_VERSION_PATCH);
}
}  // namespace

nlohmann::json runtime_info() {
  const std::string cuda = compat::cuda_compiled_version();
  return {
      {"actmem", ACTMEM_VERSION},
      {"libtorch", torch_version()},
      {"cuda", !cuda.empty()},
      {"cuda_version", cuda.empty() ? nlohmann::json() : nlohmann::json(cuda)},
      {"gpus", compat::cuda_device_count()},
      {"cores", available_cores()},
      {"threads", at::get_num_threads()},
      {"blas", blas_report().to_json()},
  };
}

std::string runtime_summary() {
  const std::string cuda = compat::cuda_compiled_version();
  const int gpus = compat::cuda_device_count();
  std::string s =
      "actmem " + std::string(ACTMEM_VERSION) + " | libtorch " + torch_version() + " | ";
  if (cuda.empty()) return s + "CPU-only build";
  s += "CUDA " + cuda + " compiled in, ";
  if (gpus == 0) return s + "no GPU visible";
  return s + std::to_string(gpus) + (gpus == 1 ? " GPU visible" : " GPUs visible");
}

}  // namespace actmem
