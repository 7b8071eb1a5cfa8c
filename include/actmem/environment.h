// environment.h — what a run executes on: the program and library versions, the cores this
// process may use and the threads it uses. Reported in each command's header and written as the
// first record of a JSON log, so a log says what produced it.
#pragma once

#include <nlohmann/json_fwd.hpp>

namespace actmem {

/// The cores this process may run on (its CPU affinity mask), at least 1.
int available_cores();

/// {"actmem": version, "libtorch": version, "cuda": bool, "cores": n, "threads": n,
///  "blas": the BLAS and its threads (blas.h)}.
nlohmann::json runtime_info();

}  // namespace actmem
