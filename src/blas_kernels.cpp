// blas_kernels.cpp — CPU features, the BLAS in use, the kernel decision, the probe and its cache
// (Note [BLAS kernel choice] in blas_kernels.h).
#include "actmem/blas_kernels.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dlfcn.h>
#include <fcntl.h>
#include <fstream>
#include <limits>
#include <poll.h>
#include <sstream>
#include <sys/stat.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace actmem {

// ---- CPU features -------------------------------------------------------------------------------

std::string CpuFeatures::to_string() const {
  const std::array<std::pair<bool, const char*>, 14> all = {{
      {sse3, "sse3"}, {ssse3, "ssse3"}, {sse4_1, "sse4_1"}, {sse4_2, "sse4_2"}, {avx, "avx"},
      {avx2, "avx2"}, {fma, "fma"}, {avx512f, "avx512f"}, {avx512dq, "avx512dq"},
      {avx512cd, "avx512cd"}, {avx512bw, "avx512bw"}, {avx512vl, "avx512vl"},
      {avx512_vnni, "avx512_vnni"}, {avx512_bf16, "avx512_bf16"},
  }};
  std::string out;
  for (const auto& [on, name] : all) {
    if (!on) continue;
    if (!out.empty()) out += ' ';
    out += name;
  }
  return out.empty() ? "none" : out;
}

CpuFeatures detect_cpu_features() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(1, &a, &b, &c, &d) == 0) return f;
  f.sse3 = c & (1u << 0);
  f.ssse3 = c & (1u << 9);
  f.sse4_1 = c & (1u << 19);
  f.sse4_2 = c & (1u << 20);
  const bool osxsave = c & (1u << 27);
  // The OS must save the wider registers, or the instructions fault (XCR0: SSE|AVX = 0x6, plus
  // opmask and the upper ZMM halves = 0xE0 for AVX-512).
  uint64_t xcr0 = 0;
  if (osxsave) {
    uint32_t lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    xcr0 = (static_cast<uint64_t>(hi) << 32) | lo;
  }
  const bool ymm = (xcr0 & 0x6) == 0x6, zmm = (xcr0 & 0xE6) == 0xE6;
  f.avx = ymm && (c & (1u << 28));
  f.fma = ymm && (c & (1u << 12));
  if (__get_cpuid_max(0, nullptr) >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    f.avx2 = ymm && (b & (1u << 5));
    f.avx512f = zmm && (b & (1u << 16));
    f.avx512dq = zmm && (b & (1u << 17));
    f.avx512cd = zmm && (b & (1u << 28));
    f.avx512bw = zmm && (b & (1u << 30));
    f.avx512vl = zmm && (b & (1u << 31));
    f.avx512_vnni = zmm && (c & (1u << 11));
    __cpuid_count(7, 1, a, b, c, d);
    f.avx512_bf16 = zmm && (a & (1u << 5));
  }
#endif
  return f;
}

// ---- OpenBLAS kernel families -------------------------------------------------------------------

namespace {
// OpenBLAS's x86-64 DYNAMIC_ARCH families (driver/others/dynamic.c), ranked by the instructions
// their kernels use: SSE3 < SSSE3 < SSE4.1 < SSE4.2 < AVX < AVX2+FMA < AVX-512 < AVX-512 BF16.
const std::array<std::pair<const char*, int>, 19> kCoreRanks = {{
    {"Prescott", 0}, {"Atom", 0},       {"Bobcat", 1},      {"Core2", 1},
    {"Penryn", 2},   {"Dunnington", 2}, {"Barcelona", 2},   {"Nehalem", 3},
    {"Sandybridge", 4}, {"Bulldozer", 4}, {"Piledriver", 4}, {"Steamroller", 4},
    {"Haswell", 5},  {"Excavator", 5},  {"Zen", 5},         {"SkylakeX", 6},
    {"Cooperlake", 7}, {"SapphireRapids", 8}, {"Katmai", -1},
}};

bool same_name(const std::string& a, const char* b) {
  return a.size() == std::strlen(b) && strncasecmp(a.c_str(), b, a.size()) == 0;
}
}  // namespace

int openblas_core_rank(const std::string& core) {
  for (const auto& [name, rank] : kCoreRanks) {
    if (same_name(core, name)) return rank;
  }
  return -1;
}

std::string best_openblas_core(const CpuFeatures& f) {
  const bool avx512 = f.avx512f && f.avx512dq && f.avx512cd && f.avx512bw && f.avx512vl;
  if (avx512 && f.avx512_bf16) return "Cooperlake";
  if (avx512) return "SkylakeX";
  if (f.avx2 && f.fma) return "Haswell";
  if (f.avx) return "Sandybridge";
  if (f.sse4_2) return "Nehalem";
  if (f.ssse3) return "Core2";
  return "Prescott";
}

BlasLibrary detect_blas() {
  // The BLAS is whichever library provides the sgemm_ libtorch calls: OpenBLAS's helpers can be
  // loaded (through LAPACK, say) while another BLAS answers the calls, so they only speak for
  // the kernels when they come from the same library as sgemm_.
  // Debian's layout puts a thin libblas.so.3 beside the library it forwards to
  // (openblas-pthread/libblas.so.3 -> libopenblas.so.0, blis-pthread/libblas.so.3 ->
  // libblis.so.4), so "the same library" is "a file in the same directory", links resolved.
  BlasLibrary blas;
  auto library_of = [](void* symbol) -> std::string {
    Dl_info info{};
    if (symbol == nullptr || dladdr(symbol, &info) == 0 || info.dli_fname == nullptr) return "";
    char resolved[PATH_MAX];
    return ::realpath(info.dli_fname, resolved) != nullptr ? std::string(resolved)
                                                           : std::string(info.dli_fname);
  };
  auto dir_of = [](const std::string& path) { return path.substr(0, path.rfind('/')); };
  const std::string gemm = library_of(dlsym(RTLD_DEFAULT, "sgemm_"));
  using Getter = char* (*)();
  void* corename = dlsym(RTLD_DEFAULT, "openblas_get_corename");
  void* config = dlsym(RTLD_DEFAULT, "openblas_get_config");
  using Version = const char* (*)();
  void* blis_version = dlsym(RTLD_DEFAULT, "bli_info_get_version_str");
  if (corename != nullptr && !gemm.empty() && dir_of(library_of(corename)) == dir_of(gemm)) {
    blas.openblas = true;
    blas.core = reinterpret_cast<Getter>(corename)();
    blas.config = config != nullptr ? reinterpret_cast<Getter>(config)() : "OpenBLAS";
  } else if (blis_version != nullptr && !gemm.empty() &&
             dir_of(library_of(blis_version)) == dir_of(gemm)) {
    blas.config = std::string("BLIS ") + reinterpret_cast<Version>(blis_version)() + " (" + gemm + ")";
  } else if (!gemm.empty() && at::hasMKL()) {
    // The PyPI wheel links MKL statically into libtorch_cpu.so.
    blas.config = "MKL, linked into " + gemm;
  } else if (!gemm.empty()) {
    blas.config = "the BLAS in " + gemm;
  } else {
    blas.config = "no BLAS library (libtorch's own kernels)";
  }
  if (const char* fake = std::getenv("ACTMEM_BLAS_FAKE_CORE"); fake != nullptr && blas.openblas) {
    blas.core = fake;  // testing seam: what detection picked
  }
  return blas;
}

KernelDecision decide_kernel(const CpuFeatures& cpu, const BlasLibrary& blas,
                             const char* user_coretype, bool enabled) {
  KernelDecision d;
  if (!blas.openblas) {
    d.reason = "the BLAS is not OpenBLAS: its kernels are its own choice";
  } else if (user_coretype != nullptr && *user_coretype != '\0') {
    d.reason = std::string("OPENBLAS_CORETYPE=") + user_coretype + " was set by the user: kept";
  } else if (!enabled) {
    d.reason = "kernel choice switched off (ACTMEM_BLAS_KERNEL_CHOICE=off or "
               "--no-blas-kernel-choice): detection's " + blas.core + " kept";
  } else if (openblas_core_rank(blas.core) < 0) {
    d.reason = "detection picked " + blas.core + ", a family this build does not rank: kept";
  } else {
    const std::string best = best_openblas_core(cpu);
    if (openblas_core_rank(blas.core) >= openblas_core_rank(best)) {
      d.reason = "detection picked " + blas.core + ", the best this CPU supports";
    } else {
      d.candidate = best;
      d.reason = "detection picked " + blas.core + ", below what this CPU supports (" + best +
                 ": " + cpu.to_string() + ")";
    }
  }
  return d;
}

// ---- the probe ----------------------------------------------------------------------------------

// Note [BLAS probe bound]
// A product of k terms summed in any order, with or without fused multiply-adds, differs from
// the exact value by at most gamma_k = k u / (1 - k u) times the sum of the terms' magnitudes
// (Higham, "Accuracy and Stability of Numerical Algorithms", 2002, section 3.1); scaling by alpha
// and adding beta C costs two more roundings. Every element must therefore lie within
// 2 (k + 2) u (|beta C0| + |alpha| sum |a||b|) of the exact value, which the probe computes in
// long double (64-bit mantissa, far below either bound). The factor 2 is margin for the gamma
// term's second order; a wrong kernel (a transposition mixed up, a tail block skipped, garbage
// from unsupported instructions) misses by orders of magnitude, since k u is ~1e-5 in float.

ProbeCheck check_gemm_result(const std::string& routine, const std::vector<double>& c,
                             const std::vector<long double>& reference,
                             const std::vector<long double>& magnitude, int64_t k,
                             double unit_roundoff) {
  ProbeCheck check{routine, 0.0};
  TORCH_CHECK(c.size() == reference.size() && c.size() == magnitude.size(),
              "actmem::check_gemm_result: sizes differ");
  for (size_t i = 0; i < c.size(); ++i) {
    if (!std::isfinite(c[i])) {
      check.worst = std::numeric_limits<double>::infinity();
      return check;
    }
    const long double error = std::fabs(static_cast<long double>(c[i]) - reference[i]);
    const long double bound =
        2.0L * static_cast<long double>(k + 2) * unit_roundoff * magnitude[i];
    const double ratio = bound > 0 ? static_cast<double>(error / bound)
                                   : (error > 0 ? std::numeric_limits<double>::infinity() : 0.0);
    check.worst = std::max(check.worst, ratio);
  }
  return check;
}

namespace {

std::vector<long double> to_long_double(const at::Tensor& t) {
  const at::Tensor d = t.to(at::kDouble).contiguous();
  const double* p = d.data_ptr<double>();
  return std::vector<long double>(p, p + d.numel());
}

// alpha * op(A) op(B) + beta * C0 through libtorch (which calls the BLAS with transpose flags for
// transposed views), checked against the long-double reference.
ProbeCheck check_addmm(at::ScalarType type, int64_t m, int64_t n, int64_t k, bool ta, bool tb,
                       double alpha, double beta, at::Generator& gen, bool corrupt) {
  const auto opt = at::TensorOptions().dtype(type);
  // Stored so that op() is a transposed view when asked: the BLAS sees trans = 'T'.
  const at::Tensor a_store = ta ? at::randn({k, m}, gen, opt) : at::randn({m, k}, gen, opt);
  const at::Tensor b_store = tb ? at::randn({n, k}, gen, opt) : at::randn({k, n}, gen, opt);
  const at::Tensor a = ta ? a_store.t() : a_store, b = tb ? b_store.t() : b_store;
  const at::Tensor c0 = at::randn({m, n}, gen, opt);
  at::Tensor c = beta == 0.0 && alpha == 1.0 ? at::mm(a, b) : at::addmm(c0, a, b, beta, alpha);
  if (corrupt) c.view({-1})[c.numel() / 2] += 1.0;  // testing: a wrong kernel's result
  const auto av = to_long_double(a), bv = to_long_double(b), cv = to_long_double(c0);
  std::vector<long double> reference(static_cast<size_t>(m * n)), magnitude(reference.size());
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      long double sum = 0, mag = 0;
      for (int64_t l = 0; l < k; ++l) {
        const long double x = av[static_cast<size_t>(i * k + l)] * bv[static_cast<size_t>(l * n + j)];
        sum += x;
        mag += std::fabs(x);
      }
      const long double base = beta == 0.0 && alpha == 1.0 ? 0.0L : beta * cv[static_cast<size_t>(i * n + j)];
      reference[static_cast<size_t>(i * n + j)] = base + alpha * sum;
      magnitude[static_cast<size_t>(i * n + j)] = std::fabs(base) + std::fabs(alpha) * mag;
    }
  }
  const at::Tensor cd = c.to(at::kDouble).contiguous();
  std::vector<double> got(cd.data_ptr<double>(), cd.data_ptr<double>() + cd.numel());
  std::ostringstream name;
  name << (type == at::kFloat ? "sgemm " : "dgemm ") << (ta ? 'T' : 'N') << (tb ? 'T' : 'N') << ' '
       << m << "x" << n << "x" << k << (beta == 0.0 && alpha == 1.0 ? "" : " alpha/beta");
  return check_gemm_result(name.str(), got, reference, magnitude, k,
                           type == at::kFloat ? std::ldexp(1.0, -24) : std::ldexp(1.0, -53));
}

// y = op(A) x (gemv) and x . y (dot), through libtorch.
ProbeCheck check_gemv(at::ScalarType type, int64_t m, int64_t k, bool ta, at::Generator& gen) {
  const auto opt = at::TensorOptions().dtype(type);
  const at::Tensor a_store = ta ? at::randn({k, m}, gen, opt) : at::randn({m, k}, gen, opt);
  const at::Tensor a = ta ? a_store.t() : a_store;
  const at::Tensor x = at::randn({k}, gen, opt);
  const at::Tensor y = at::mv(a, x);
  const auto av = to_long_double(a), xv = to_long_double(x);
  std::vector<long double> reference(static_cast<size_t>(m)), magnitude(reference.size());
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t l = 0; l < k; ++l) {
      const long double p = av[static_cast<size_t>(i * k + l)] * xv[static_cast<size_t>(l)];
      reference[static_cast<size_t>(i)] += p;
      magnitude[static_cast<size_t>(i)] += std::fabs(p);
    }
  }
  const at::Tensor yd = y.to(at::kDouble).contiguous();
  std::vector<double> got(yd.data_ptr<double>(), yd.data_ptr<double>() + yd.numel());
  std::ostringstream name;
  name << (type == at::kFloat ? "sgemv " : "dgemv ") << (ta ? 'T' : 'N') << ' ' << m << "x" << k;
  return check_gemm_result(name.str(), got, reference, magnitude, k,
                           type == at::kFloat ? std::ldexp(1.0, -24) : std::ldexp(1.0, -53));
}

ProbeCheck check_dot(at::ScalarType type, int64_t n, at::Generator& gen) {
  const auto opt = at::TensorOptions().dtype(type);
  const at::Tensor x = at::randn({n}, gen, opt), y = at::randn({n}, gen, opt);
  const double got = at::dot(x, y).item<double>();
  const auto xv = to_long_double(x), yv = to_long_double(y);
  long double sum = 0, mag = 0;
  for (int64_t i = 0; i < n; ++i) {
    sum += xv[static_cast<size_t>(i)] * yv[static_cast<size_t>(i)];
    mag += std::fabs(xv[static_cast<size_t>(i)] * yv[static_cast<size_t>(i)]);
  }
  return check_gemm_result(std::string(type == at::kFloat ? "sdot " : "ddot ") + std::to_string(n),
                           {got}, {sum}, {mag}, n,
                           type == at::kFloat ? std::ldexp(1.0, -24) : std::ldexp(1.0, -53));
}

}  // namespace

ProbeVerdict run_blas_checks() {
  const char* fault = std::getenv("ACTMEM_BLAS_PROBE_FAULT");  // testing: crash, hang or wrong
  if (fault != nullptr && std::strcmp(fault, "crash") == 0) std::abort();
  if (fault != nullptr && std::strcmp(fault, "hang") == 0) {
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  const bool corrupt = fault != nullptr && std::strcmp(fault, "wrong") == 0;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(20261130);
  ProbeVerdict v;
  // Shapes from a single element to sizes past the kernels' blocking, odd in every dimension.
  const std::array<std::array<int64_t, 3>, 5> shapes = {
      {{1, 1, 1}, {7, 3, 5}, {67, 129, 53}, {33, 1, 65}, {131, 257, 129}}};
  for (const auto type : {at::kFloat, at::kDouble}) {
    for (const auto& [m, n, k] : shapes) {
      for (const bool ta : {false, true}) {
        for (const bool tb : {false, true}) {
          v.checks.push_back(check_addmm(type, m, n, k, ta, tb, 1.0, 0.0, gen,
                                         corrupt && type == at::kFloat && m == 67 && !ta && tb));
        }
      }
    }
    v.checks.push_back(check_addmm(type, 45, 77, 91, false, true, 1.5, 0.5, gen, false));
    v.checks.push_back(check_addmm(type, 45, 77, 91, true, false, -0.75, 1.0, gen, false));
    for (const bool ta : {false, true}) v.checks.push_back(check_gemv(type, 129, 67, ta, gen));
    v.checks.push_back(check_dot(type, 1031, gen));
  }
  v.ok = true;
  for (const auto& c : v.checks) {
    if (c.worst <= 1.0) continue;
    v.ok = false;
    std::ostringstream os;
    os << c.routine << " is off by " << c.worst << " times its rounding bound";
    v.reason = os.str();
    break;
  }
  return v;
}

namespace {
std::string verdict_line(const ProbeVerdict& v, const std::string& core) {
  nlohmann::json j = {{"ok", v.ok}, {"reason", v.reason}, {"core", core}};
  for (const auto& c : v.checks) j["checks"].push_back({c.routine, c.worst});
  return j.dump();
}

ProbeVerdict failed(std::string reason) {
  ProbeVerdict v;
  v.reason = std::move(reason);
  return v;
}
}  // namespace

void maybe_run_blas_probe() {
  if (std::getenv("ACTMEM_BLAS_PROBE") == nullptr) return;
  // The child's side of probe_in_child(): run the checks under the kernels OpenBLAS loaded
  // (OPENBLAS_CORETYPE was set before this process started) and print one JSON line.
  std::string core;
  ProbeVerdict v;
  try {
    core = detect_blas().core;
    v = run_blas_checks();
  } catch (const std::exception& e) {
    v = failed(std::string("the probe threw: ") + e.what());
  }
  std::printf("%s\n", verdict_line(v, core).c_str());
  std::fflush(stdout);
  std::_Exit(0);
}

ProbeVerdict probe_in_child(const std::string& core, double timeout_s) {
  int out[2];
  if (::pipe2(out, O_CLOEXEC) != 0) return failed(std::string("pipe: ") + std::strerror(errno));
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(out[0]);
    ::close(out[1]);
    return failed(std::string("fork: ") + std::strerror(errno));
  }
  if (pid == 0) {
    ::dup2(out[1], STDOUT_FILENO);
    const int null = ::open("/dev/null", O_WRONLY);
    if (null >= 0) ::dup2(null, STDERR_FILENO);
    setenv("OPENBLAS_CORETYPE", core.c_str(), 1);
    setenv("ACTMEM_BLAS_PROBE", "1", 1);
    setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
    unsetenv("ACTMEM_BLAS_FAKE_CORE");
    char name[] = "actmem-blas-probe";
    char* argv[] = {name, nullptr};
    execv("/proc/self/exe", argv);
    std::_Exit(127);
  }
  ::close(out[1]);
  std::string text;
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  bool timed_out = false;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                          deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) {
      timed_out = true;
      break;
    }
    pollfd p{out[0], POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 1000))) <= 0) continue;
    char buf[4096];
    const ssize_t n = ::read(out[0], buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  ::close(out[0]);
  if (timed_out) ::kill(pid, SIGKILL);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  std::ostringstream why;
  if (timed_out) {
    why << "the probe did not finish within " << timeout_s << " s (killed)";
    return failed(why.str());
  }
  if (WIFSIGNALED(status)) {
    why << "the probe crashed (signal " << WTERMSIG(status) << ")";
    return failed(why.str());
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    why << "the probe failed (exit code " << WEXITSTATUS(status) << ")";
    return failed(why.str());
  }
  try {
    const auto j = nlohmann::json::parse(text);
    ProbeVerdict v;
    v.ok = j.at("ok").get<bool>();
    v.reason = j.at("reason").get<std::string>();
    if (j.contains("checks")) {
      for (const auto& c : j["checks"]) v.checks.push_back({c[0].get<std::string>(), c[1].get<double>()});
    }
    const std::string ran = j.at("core").get<std::string>();
    if (v.ok && !same_name(ran, core.c_str())) {
      return failed("OpenBLAS did not take OPENBLAS_CORETYPE=" + core + " (it ran " + ran + ")");
    }
    return v;
  } catch (const std::exception&) {
    return failed("the probe printed no verdict");
  }
}

// ---- the verdict cache --------------------------------------------------------------------------

namespace {
std::string cache_path() {
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && *x != '\0') {
    return std::string(x) + "/actmem/blas-probe.json";
  }
  if (const char* h = std::getenv("HOME"); h != nullptr && *h != '\0') {
    return std::string(h) + "/.cache/actmem/blas-probe.json";
  }
  return "";
}

nlohmann::json read_cache(const std::string& path) {
  std::ifstream in(path);
  if (!in) return nlohmann::json::object();
  try {
    auto j = nlohmann::json::parse(in);
    return j.is_object() ? j : nlohmann::json::object();
  } catch (const std::exception&) {
    return nlohmann::json::object();  // a damaged cache only costs one probe
  }
}

// Best effort: a cache that cannot be written only means the probe runs again next time.
void write_cache(const std::string& path, const nlohmann::json& j) {
  const std::string dir = path.substr(0, path.rfind('/'));
  const std::string parent = dir.substr(0, dir.rfind('/'));
  ::mkdir(parent.c_str(), 0755);
  ::mkdir(dir.c_str(), 0755);
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp);
    out << j.dump(2) << "\n";
    if (!out) {
      std::remove(tmp.c_str());
      return;
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) std::remove(tmp.c_str());
}
}  // namespace

ProbeVerdict probe_cached(const CpuFeatures& cpu, const BlasLibrary& blas, const std::string& core) {
  const std::string path = cache_path();
  const std::string key = cpu.to_string() + " | " + blas.config + " | " + core;
  nlohmann::json cache = path.empty() ? nlohmann::json::object() : read_cache(path);
  if (cache.contains(key) && cache[key].is_object() && cache[key].contains("ok")) {
    ProbeVerdict v;
    v.ok = cache[key]["ok"].get<bool>();
    v.reason = cache[key].value("reason", "");
    return v;
  }
  ProbeVerdict v = probe_in_child(core);
  if (!path.empty()) {
    cache = read_cache(path);  // another process may have written meanwhile
    cache[key] = {{"ok", v.ok}, {"reason", v.reason}, {"checks", v.checks.size()}};
    write_cache(path, cache);
  }
  return v;
}

// ---- the report -----------------------------------------------------------------------------

BlasReport blas_report() {
  BlasReport r;
  r.library = detect_blas();
  r.cpu = detect_cpu_features();
  const char* source = std::getenv("ACTMEM_BLAS_SOURCE");
  const std::string s = source != nullptr ? source : "";
  if (!r.library.openblas) {
    r.source = KernelSource::kNotOpenBlas;
  } else if (s == "actmem") {
    r.source = KernelSource::kActmem;
  } else if (s == "user" || (s.empty() && std::getenv("OPENBLAS_CORETYPE") != nullptr)) {
    r.source = KernelSource::kUser;
  } else {
    r.source = KernelSource::kDetection;
  }
  const char* detected = std::getenv("ACTMEM_BLAS_DETECTED");
  r.detected_core = detected != nullptr ? detected : r.library.core;
  const char* note = std::getenv("ACTMEM_BLAS_NOTE");
  r.note = note != nullptr ? note : "";
  return r;
}

namespace {
const char* source_name(KernelSource s) {
  switch (s) {
    case KernelSource::kDetection: return "detection";
    case KernelSource::kActmem: return "actmem";
    case KernelSource::kUser: return "user";
    case KernelSource::kNotOpenBlas: return "not OpenBLAS";
  }
  return "?";
}
}  // namespace

std::string BlasReport::summary() const {
  std::ostringstream os;
  if (!library.openblas) {
    os << "BLAS: " << library.config;
  } else {
    // "OpenBLAS 0.3.21 DYNAMIC_ARCH ..." -> "OpenBLAS 0.3.21"
    std::istringstream words(library.config);
    std::string name, version;
    words >> name >> version;
    os << "BLAS: " << name << " " << version << ", " << library.core << " kernels";
  }
  if (!note.empty()) os << " (" << note << ")";
  return os.str();
}

nlohmann::json BlasReport::to_json() const {
  return {{"library", library.config},
          {"openblas", library.openblas},
          {"core", library.core},
          {"detected_core", detected_core},
          {"source", source_name(source)},
          {"note", note},
          {"cpu_features", cpu.to_string()}};
}

bool set_blas_threads(int n) {
  if (void* f = dlsym(RTLD_DEFAULT, "openblas_set_num_threads")) {
    reinterpret_cast<void (*)(int)>(f)(n);
    return true;
  }
  if (void* f = dlsym(RTLD_DEFAULT, "bli_thread_set_num_threads")) {
    reinterpret_cast<void (*)(long)>(f)(n);
    return true;
  }
  return false;
}

}  // namespace actmem
