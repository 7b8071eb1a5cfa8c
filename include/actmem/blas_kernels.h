// blas_kernels.h — which kernel family the BLAS runs, what the CPU could run, and the choice of a
// better family when OpenBLAS's detection falls short (Note [BLAS kernel choice]).
//
// Note [BLAS kernel choice]
// OpenBLAS built with DYNAMIC_ARCH picks its kernels at load time from the CPU it detects. On
// virtual machines that mask the CPU model its detection can fall back to the generic Prescott
// kernels although the CPU has AVX-512: the 4-layer h512 step then takes 2.3x as long (measured,
// docs/benchmarks.md). OpenBLAS reads OPENBLAS_CORETYPE when it is loaded, before main runs, so
// prepare_process() (process.h) decides before anything else and re-executes the program once
// with the variable set, as it does for OMP_WAIT_POLICY:
//   - the CPU's capabilities come from cpuid and xgetbv (feature bits and the registers the OS
//     saves), never from the model name;
//   - a family is chosen only when the detected one is below the best the CPU supports, the BLAS
//     is OpenBLAS, and neither the user (OPENBLAS_CORETYPE) nor a switch
//     (ACTMEM_BLAS_KERNEL_CHOICE=off, --no-blas-kernel-choice) decided otherwise;
//   - the choice is proven on this machine first: a child process (a crash or a hang of it cannot
//     hurt the run) runs the BLAS routines libtorch's CPU path calls under the candidate, for
//     several shapes and transposes, odd sizes included, against a long-double reference within
//     the rounding bound of each (Note [BLAS probe bound] in blas_kernels.cpp); a candidate that
//     fails is not used and the report says why;
//   - the verdict is cached per (CPU features, BLAS build, candidate) under
//     $XDG_CACHE_HOME/actmem (or ~/.cache/actmem), so the probe runs once per machine.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <optional>
#include <string>
#include <vector>

namespace actmem {

/// The instruction sets the CPU has and the OS enables (cpuid and xgetbv).
struct CpuFeatures {
  bool sse3 = false, ssse3 = false, sse4_1 = false, sse4_2 = false;
  bool avx = false, avx2 = false, fma = false;
  bool avx512f = false, avx512dq = false, avx512cd = false, avx512bw = false, avx512vl = false;
  bool avx512_vnni = false, avx512_bf16 = false;
  /// "sse3 ssse3 ... avx512_bf16": the features present, in this order.
  std::string to_string() const;
};
CpuFeatures detect_cpu_features();

/// OpenBLAS's x86-64 kernel families, from least to most capable, with what each needs.
/// Others (AMD's Barcelona/Bulldozer, Atom, ...) are ranked where their instructions put them.
int openblas_core_rank(const std::string& core);  // -1 for a name not in the table
/// The most capable family `cpu` can run.
std::string best_openblas_core(const CpuFeatures& cpu);

/// The BLAS this process runs.
struct BlasLibrary {
  bool openblas = false;
  /// openblas_get_config() ("OpenBLAS 0.3.21 DYNAMIC_ARCH ... Cooperlake ..."), or what else
  /// provides sgemm_ ("BLIS 0.9.0 (/usr/lib/.../libblas.so.3)").
  std::string config;
  std::string core;    // openblas_get_corename(): the kernel family in use
};
/// Reads the live library: the one that provides sgemm_ (dladdr), and when that is OpenBLAS its
/// openblas_get_corename and openblas_get_config (BLIS: bli_info_get_version_str).
/// ACTMEM_BLAS_FAKE_CORE replaces the OpenBLAS core name it reports (testing: the seam through
/// which the tests fake what detection picked).
BlasLibrary detect_blas();

/// Who decided the kernel family in use.
enum class KernelSource { kDetection, kActmem, kUser, kNotOpenBlas };

/// What prepare_process() decides before the BLAS is used.
struct KernelDecision {
  std::optional<std::string> candidate;  // a family to prove and use; none: keep what runs
  std::string reason;                    // why (printed in the header and the JSON record)
};
/// The pure decision: `user_coretype` is OPENBLAS_CORETYPE (nullptr when unset), `enabled` false
/// when the choice is switched off.
KernelDecision decide_kernel(const CpuFeatures& cpu, const BlasLibrary& blas,
                             const char* user_coretype, bool enabled);

/// One check of the probe: a routine, its shape and the largest error against its bound.
struct ProbeCheck {
  std::string routine;  // "sgemm NT 67x129x53", ...
  double worst = 0.0;   // max over elements of |error| / bound (<= 1 passes)
};
/// The verdict of a probe run.
struct ProbeVerdict {
  bool ok = false;
  std::string reason;  // "" when ok; else the failing routine, or how the probe process died
  std::vector<ProbeCheck> checks;
};

/// Runs every check in this process, with whatever kernels the BLAS uses now (the child's side).
ProbeVerdict run_blas_checks();
/// Checks C (m x n, row-major) against the long-double reference of alpha * op(A) op(B) + beta*C0
/// within the rounding bound of a k-term sum in `unit_roundoff` (exposed for the tests: a wrong
/// result must be rejected).
ProbeCheck check_gemm_result(const std::string& routine, const std::vector<double>& c,
                             const std::vector<long double>& reference,
                             const std::vector<long double>& magnitude, int64_t k,
                             double unit_roundoff);

/// In a probe child (ACTMEM_BLAS_PROBE set): runs the checks, prints the verdict as one JSON line
/// and exits. Otherwise returns at once. prepare_process() calls it first; a program that runs
/// probes without prepare_process() (the test binary) calls it at the top of main.
void maybe_run_blas_probe();

/// Sets the BLAS library's own thread count (OpenBLAS's openblas_set_num_threads, BLIS's
/// bli_thread_set_num_threads; nothing for others). at::set_num_threads does not reach it: OpenBLAS
/// sizes its pool from OMP_NUM_THREADS / OPENBLAS_NUM_THREADS or the cores at load time, and how
/// many threads split a product can change its bits on some kernels (Haswell's), so two runs that
/// must agree bitwise need the same count. Returns whether a library took it.
bool set_blas_threads(int n);
/// Runs the probe in a child process (this program, re-executed with OPENBLAS_CORETYPE=core and
/// ACTMEM_BLAS_PROBE=1) and returns its verdict; a crash, a hang beyond `timeout_s` or garbage
/// output is a failed verdict, never an error of the caller.
ProbeVerdict probe_in_child(const std::string& core, double timeout_s = 60.0);
/// probe_in_child() through the cache (Note [BLAS kernel choice]).
ProbeVerdict probe_cached(const CpuFeatures& cpu, const BlasLibrary& blas, const std::string& core);

/// What the run uses, for the header and the JSON configuration record.
struct BlasReport {
  BlasLibrary library;
  CpuFeatures cpu;
  KernelSource source = KernelSource::kDetection;
  std::string detected_core;  // what OpenBLAS's detection picked (before any choice)
  std::string note;           // the decision's reason, or why a candidate was not used
  std::string summary() const;  // one line: "OpenBLAS 0.3.21, Haswell kernels (chosen by ...)"
  nlohmann::json to_json() const;
};
/// The report of this process (reads the environment prepare_process() left).
BlasReport blas_report();

}  // namespace actmem
