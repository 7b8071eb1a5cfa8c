// blas.h — which BLAS the process runs and with how many threads, for the header of each command
// and the JSON configuration record.
//
// The PyTorch wheel actmem builds on links MKL statically into libtorch_cpu.so, and MKL picks its
// kernels from the CPU itself and follows libtorch's intra-op thread count (at::set_num_threads
// sets MKL's too). Earlier builds used Debian's libtorch over OpenBLAS, whose kernel detection
// could fall back to generic kernels on virtual machines; the machinery that chose and probed
// OpenBLAS kernels was removed with that build (docs/benchmarks.md, "BLAS").
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <string>

namespace actmem {

struct BlasReport {
  /// "MKL, linked into /.../libtorch_cpu.so", "OpenBLAS 0.3.21 ...", "the BLAS in /...", or
  /// "no BLAS library (libtorch's own kernels)".
  std::string library;
  bool mkl = false;  // at::hasMKL()
  int threads = 1;   // the threads a product may use (MKL: libtorch's intra-op threads)
  /// MKL's conditional numerical reproducibility in force ("AUTO,STRICT" after
  /// set_reproducible_blas(), "OFF" by default); empty without MKL.
  std::string reproducibility;
  std::string summary() const;  // "BLAS: MKL, linked into ..., 2 threads"
  nlohmann::json to_json() const;
};

/// Reads the live library: whichever provides the sgemm_ libtorch calls (dladdr), named by its
/// own version string where it has one.
BlasReport blas_report();

/// Note [Reproducible products]
/// A recomputed forward must round as the original did, and the tensors it multiplies are new
/// allocations: MKL's default kernels may take a different path for a buffer of another
/// alignment, so two equal products can differ in the last bits. MKL's conditional numerical
/// reproducibility in strict mode (MKL_CBWR=AUTO,STRICT: the fastest code path for the CPU,
/// independent of alignment, for a fixed thread count) makes them agree. Sets it unless the
/// environment already names a mode, and must run before the first product (the start of
/// main). Observed without it: about 1 run in 60 of a bitwise comparison under a loaded
/// `ctest -j2` (the losses equal, a step's gradients a few ulps apart); none in 80 with it. The
/// thread count is fixed too (MKL_DYNAMIC=FALSE, unless the environment says otherwise): one
/// comparison under a loaded `ctest -j2` still differed with dynamic threads (Planner.TimedRounds-
/// GoOnUntilTheRatiosAreSure, not reproduced in nine reruns).
void set_reproducible_blas();

}  // namespace actmem
