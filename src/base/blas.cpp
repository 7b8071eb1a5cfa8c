// blas.cpp — the BLAS this process runs (blas.h).
#include "actmem/base/blas.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>

#include <climits>
#include <cstdlib>
#include <dlfcn.h>
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

void set_reproducible_blas() {
  setenv("MKL_CBWR", "AUTO,STRICT", /*overwrite=*/0);
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
  return r;
}

std::string BlasReport::summary() const {
  std::ostringstream os;
  os << "BLAS: " << library << ", " << threads << (threads == 1 ? " thread" : " threads");
  return os.str();
}

nlohmann::json BlasReport::to_json() const {
  return {{"library", library}, {"mkl", mkl}, {"threads", threads}};
}

}  // namespace actmem
