// parallel_workers.h — what the multi-process tests share: run the worker ranks
// (actmem_tp_worker, tp_worker.cpp) under launch and read back what each wrote.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace actmem::testing {

/// Runs `nproc` worker ranks of scenario args[0] (with args[1...]); returns each rank's JSON
/// (rank order). Fails the test on error.
std::vector<nlohmann::json> run_workers(int nproc, std::vector<std::string> args);

}  // namespace actmem::testing
