// process.cpp — prepare_process: the OpenMP wait policy, set before the library that reads it is
// used (Note [OpenMP wait policy] in process.h).
#include "actmem/process.h"

#include <cstdlib>
#include <unistd.h>

namespace actmem {

void prepare_process(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") == nullptr && setenv("OMP_WAIT_POLICY", "PASSIVE", 1) == 0) {
    execv("/proc/self/exe", argv);
  }
  // exec failed (no /proc): carry on with the libraries as loaded; only speed is affected.
}

}  // namespace actmem
