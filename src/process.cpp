// process.cpp — ensure_passive_openmp_wait.
#include "actmem/process.h"

#include <cstdlib>
#include <unistd.h>

namespace actmem {

void ensure_passive_openmp_wait(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  if (setenv("OMP_WAIT_POLICY", "PASSIVE", 1) != 0) return;
  execv("/proc/self/exe", argv);
  // exec failed (no /proc): carry on with the active policy; only speed is affected.
}

}  // namespace actmem
