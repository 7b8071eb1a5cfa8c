// environment.cpp — available_cores and runtime_info.
#include "actmem/environment.h"

#include "actmem/blas.h"

#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>
#include <torch/version.h>

#include <algorithm>
#include <sched.h>
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

nlohmann::json runtime_info() {
  return {
      {"actmem", ACTMEM_VERSION},
      {"libtorch", std::to_string(TORCH_VERSION_MAJOR) + "." +
                       std::to_string(TORCH_VERSION_MINOR) + "." +
                       std::to_string(TORCH_VERSION_PATCH)},
#ifdef ACTMEM_WITH_CUDA
      {"cuda", true},
#else
      {"cuda", false},
#endif
      {"cores", available_cores()},
      {"threads", at::get_num_threads()},
      {"blas", blas_report().to_json()},
  };
}

}  // namespace actmem
