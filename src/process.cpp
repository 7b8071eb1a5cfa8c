// process.cpp — prepare_process: the OpenMP wait policy and the BLAS kernel family, set before
// the libraries that read them are used.
#include "actmem/process.h"

#include "actmem/blas_kernels.h"

#include <cstdlib>
#include <cstring>
#include <string>
#include <unistd.h>

namespace actmem {

namespace {
bool has_flag(char** argv, const char* flag) {
  for (char** a = argv + 1; *a != nullptr; ++a) {
    if (std::strcmp(*a, flag) == 0) return true;
  }
  return false;
}

// Decides the kernel family once per process tree (Note [BLAS kernel choice]); the decision
// travels to re-executed and launched processes in ACTMEM_BLAS_*. Returns true when
// OPENBLAS_CORETYPE was set and the program must re-execute for OpenBLAS to read it.
bool choose_blas_kernels(char** argv) {
  if (std::getenv("ACTMEM_BLAS_SOURCE") != nullptr) return false;  // decided up the tree
  const CpuFeatures cpu = detect_cpu_features();
  const BlasLibrary blas = detect_blas();
  unsetenv("ACTMEM_BLAS_FAKE_CORE");  // the seam fakes what detection picked, nothing later
  const char* user = std::getenv("OPENBLAS_CORETYPE");
  const char* switch_env = std::getenv("ACTMEM_BLAS_KERNEL_CHOICE");
  const bool enabled = !(switch_env != nullptr && std::strcmp(switch_env, "off") == 0) &&
                       !has_flag(argv, "--no-blas-kernel-choice");
  const KernelDecision d = decide_kernel(cpu, blas, user, enabled);
  std::string source = !blas.openblas ? "none" : (user != nullptr && *user ? "user" : "detection");
  std::string note = d.reason;
  bool reexec = false;
  if (d.candidate) {
    const ProbeVerdict v = probe_cached(cpu, blas, *d.candidate);
    if (v.ok) {
      setenv("OPENBLAS_CORETYPE", d.candidate->c_str(), 1);
      source = "actmem";
      note = "chosen by actmem after a probe on this machine: " + d.reason;
      reexec = true;
    } else {
      note = "kept " + blas.core + ": " + *d.candidate + " failed the probe: " + v.reason;
    }
  }
  setenv("ACTMEM_BLAS_SOURCE", source.c_str(), 1);
  setenv("ACTMEM_BLAS_DETECTED", blas.core.c_str(), 1);
  setenv("ACTMEM_BLAS_NOTE", note.c_str(), 1);
  return reexec;
}
}  // namespace

void prepare_process(char** argv) {
  maybe_run_blas_probe();  // a probe child never returns from here
  bool reexec = false;
  if (std::getenv("OMP_WAIT_POLICY") == nullptr && setenv("OMP_WAIT_POLICY", "PASSIVE", 1) == 0) {
    reexec = true;
  }
  reexec = choose_blas_kernels(argv) || reexec;
  if (reexec) execv("/proc/self/exe", argv);
  // exec failed (no /proc): carry on with the libraries as loaded; only speed is affected.
}

}  // namespace actmem
