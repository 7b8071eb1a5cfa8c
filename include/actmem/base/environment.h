// environment.h — what a run executes on: the program and library versions, the cores this
// process may use and the threads it uses. Reported in each command's header and written as the
// first record of a JSON log, so a log says what produced it.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <string>

namespace actmem {

/// The cores this process may run on (its CPU affinity mask), at least 1.
int available_cores();

/// {"actmem": version, "libtorch": version, "cuda": whether the CUDA paths are compiled in,
///  "cuda_version": the CUDA runtime they were compiled against (null without), "gpus": the CUDA
///  devices visible, "cores": n, "threads": n, "blas": the BLAS and its threads (blas.h)}.
nlohmann::json runtime_info();

/// One line for a command's header: "actmem 0.1.0 | libtorch 2.15.0 | CUDA 13.0 compiled in, no
/// GPU visible".
std::string runtime_summary();

}  // namespace actmem
