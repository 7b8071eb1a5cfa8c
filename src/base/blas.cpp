// blas.cpp — the BLAS this process runs (blas.h).
#include "actmem/base/blas.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>

#include <dlfcn.h>
#include <climits>
#include <cstdlib>
#include <sstream>

namespace actmem {

namespace {
std::string library_of(void* symbol) {
  Dl_info info{};
  if (symbol == nullptr || dladdr(symbol, &info) == 0 || info.dli_fname == nullptr) return "";
  char resolved[PATH_MAX];
  return ::realpath(info.dli_fname, resolved) != nullptr ? std::string(resolved)
                                                         : std::string(info.dli_fname);
}
}  // namespace

namespace {
// MKL's conditional numerical reproducibility mode as it is in force (mkl_cbwr_get(MKL_CBWR_ALL),
// exported by the wheel's libtorch_cpu as mkl_serv_cbwr_get): its code branch, then ",STRICT"
// for the strict flag (0x10000); "" without MKL.
std::string mkl_reproducibility() {
  using Get = int (*)(int);
  void* get = dlsym(RTLD_DEFAULT, "mkl_serv_cbwr_get");
  if (get == nullptr) return "";
  const int mode = reinterpret_cast<Get>(get)(-1);
  const int branch = mode & 0xffff;
  std::string name = branch == 1   ? "OFF"
                     : branch == 2 ? "AUTO"
                     : branch == 3 ? "COMPATIBLE"
                                   : "branch " + std::to_string(branch);
  return (mode & 0x10000) != 0 ? name + ",STRICT" : name;
}
}  // namespace

void set_reproducible_blas() {
  setenv("MKL_CBWR", "AUTO,STRICT", /*overwrite=*/0);
  // Strict reproducibility holds for a fixed thread count; MKL's dynamic adjustment (its
  // default) may run a product on fewer threads when the machine is busy.
  setenv("MKL_DYNAMIC", "FALSE", /*overwrite=*/0);
}

BlasReport blas_report() {
  BlasReport r;
  r.mkl = at::hasMKL();
  r.threads = at::get_num_threads();
  const std::string gemm = library_of(dlsym(RTLD_DEFAULT, "sgemm_"));
  using Getter = const char* (*)();
  // A library's own version string speaks for it only when it comes from the file that answers
  // sgemm_ (OpenBLAS's helpers can be loaded through LAPACK while another BLAS answers the calls).
  void* openblas = dlsym(RTLD_DEFAULT, "openblas_get_config");
  if (r.mkl && !gemm.empty()) {
    r.library = "MKL, linked into " + gemm;
  } else if (openblas != nullptr && !gemm.empty() && library_of(openblas) == gemm) {
    r.library = reinterpret_cast<Getter>(openblas)();
  } else if (!gemm.empty()) {
    r.library = "the BLAS in " + gemm;
  } else {
    r.library = "no BLAS library (libtorch's own kernels)";
  }
  if (r.mkl) r.reproducibility = mkl_reproducibility();
  return r;
}

std::string BlasReport::summary() const {
  std::ostringstream os;
  os << "BLAS: " << library << ", " << threads << (threads == 1 ? " thread" : " threads");
  if (!reproducibility.empty()) os << ", reproducibility " << reproducibility;
  return os.str();
}

nlohmann::json BlasReport::to_json() const {
  return {{"library", library},
          {"mkl", mkl},
          {"threads", threads},
          {"reproducibility",
           reproducibility.empty() ? nlohmann::json(nullptr) : nlohmann::json(reproducibility)}};
}

}  // namespace actmem
