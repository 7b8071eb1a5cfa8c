// test_blas_kernels.cpp — the BLAS kernel choice (Note [BLAS kernel choice]): the decision for
// every combination of CPU, detected family and user setting; the probe's verdicts (a correct
// BLAS passes, a wrong result, a crash and a hang fail without hurting the caller); and the
// program's behaviour through the seam that fakes what detection picked.
#include "actmem/blas_kernels.h"
#include "test_util.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>

namespace actmem {
namespace {


CpuFeatures sse_only() {
  CpuFeatures f;
  f.sse3 = f.ssse3 = f.sse4_1 = f.sse4_2 = true;
  return f;
}
CpuFeatures avx2_fma() {
  CpuFeatures f = sse_only();
  f.avx = f.avx2 = f.fma = true;
  return f;
}
CpuFeatures avx512(bool bf16) {
  CpuFeatures f = avx2_fma();
  f.avx512f = f.avx512dq = f.avx512cd = f.avx512bw = f.avx512vl = f.avx512_vnni = true;
  f.avx512_bf16 = bf16;
  return f;
}
BlasLibrary openblas(const std::string& core) {
  return {true, "OpenBLAS 0.3.21 DYNAMIC_ARCH NO_AFFINITY " + core + " MAX_THREADS=64", core};
}

TEST(BlasKernels, BestFamilyFollowsTheFeatureBitsNotTheModelName) {
  EXPECT_EQ(best_openblas_core(CpuFeatures{}), "Prescott");
  EXPECT_EQ(best_openblas_core(sse_only()), "Nehalem");
  CpuFeatures avx = sse_only();
  avx.avx = true;
  EXPECT_EQ(best_openblas_core(avx), "Sandybridge");
  EXPECT_EQ(best_openblas_core(avx2_fma()), "Haswell");
  EXPECT_EQ(best_openblas_core(avx512(false)), "SkylakeX");
  EXPECT_EQ(best_openblas_core(avx512(true)), "Cooperlake");
  CpuFeatures partial = avx512(false);
  partial.avx512vl = false;  // not every AVX-512 part SkylakeX's kernels use
  EXPECT_EQ(best_openblas_core(partial), "Haswell");
  EXPECT_LT(openblas_core_rank("Prescott"), openblas_core_rank("Haswell"));
  EXPECT_EQ(openblas_core_rank("haswell"), openblas_core_rank("Haswell"));  // as OpenBLAS reads it
  EXPECT_EQ(openblas_core_rank("Zen"), openblas_core_rank("Haswell"));
  EXPECT_EQ(openblas_core_rank("NoSuchCore"), -1);
}

struct DecisionCase {
  const char* name;
  CpuFeatures cpu;
  BlasLibrary blas;
  const char* user;
  bool enabled;
  const char* candidate;  // nullptr: keep
  const char* reason;
};
void PrintTo(const DecisionCase& c, std::ostream* os) { *os << c.name; }

class KernelDecisions : public ::testing::TestWithParam<DecisionCase> {};

TEST_P(KernelDecisions, FeatureBitsTimesDetectedTimesUserSetting) {
  const auto& c = GetParam();
  const KernelDecision d = decide_kernel(c.cpu, c.blas, c.user, c.enabled);
  if (c.candidate == nullptr) {
    EXPECT_FALSE(d.candidate.has_value()) << *d.candidate;
  } else {
    ASSERT_TRUE(d.candidate.has_value()) << d.reason;
    EXPECT_EQ(*d.candidate, c.candidate);
  }
  EXPECT_NE(d.reason.find(c.reason), std::string::npos) << d.reason;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, KernelDecisions,
    ::testing::Values(
        DecisionCase{"MaskedAvx512FallsBackToPrescott", avx512(true), openblas("Prescott"), nullptr,
                     true, "Cooperlake", "detection picked Prescott, below what this CPU supports"},
        DecisionCase{"Avx2MachineOnSandybridge", avx2_fma(), openblas("Sandybridge"), nullptr, true,
                     "Haswell", "below what this CPU supports (Haswell"},
        DecisionCase{"DetectionAlreadyBest", avx512(true), openblas("Cooperlake"), nullptr, true,
                     nullptr, "the best this CPU supports"},
        DecisionCase{"DetectionAboveOurTable", avx2_fma(), openblas("SkylakeX"), nullptr, true,
                     nullptr, "the best this CPU supports"},
        DecisionCase{"UserSettingIsKept", avx512(true), openblas("Prescott"), "Haswell", true,
                     nullptr, "OPENBLAS_CORETYPE=Haswell was set by the user: kept"},
        DecisionCase{"SwitchedOff", avx512(true), openblas("Prescott"), nullptr, false, nullptr,
                     "kernel choice switched off"},
        DecisionCase{"NotOpenBlas", avx512(true), BlasLibrary{false, "BLIS", ""}, nullptr, true,
                     nullptr, "the BLAS is not OpenBLAS"},
        DecisionCase{"UnknownFamily", avx512(true), openblas("Future9000"), nullptr, true, nullptr,
                     "a family this build does not rank"},
        DecisionCase{"OldCpuKeepsPrescott", CpuFeatures{}, openblas("Prescott"), nullptr, true,
                     nullptr, "the best this CPU supports"}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(BlasProbe, TheBlasInUsePassesEveryCheck) {
  const ProbeVerdict v = run_blas_checks();
  EXPECT_TRUE(v.ok) << v.reason;
  EXPECT_GE(v.checks.size(), 40u);  // sgemm/dgemm x shapes x transposes, gemv, dot
  for (const auto& c : v.checks) EXPECT_LE(c.worst, 1.0) << c.routine;
}

TEST(BlasProbe, AWrongResultIsRejected) {
  // One element off by a unit in an otherwise exact 2x2 product: far beyond its rounding bound.
  const std::vector<long double> ref = {1.0L, 2.0L, 3.0L, 4.0L}, mag = {1.0L, 2.0L, 3.0L, 4.0L};
  EXPECT_LE(check_gemm_result("exact", {1.0, 2.0, 3.0, 4.0}, ref, mag, 2, std::ldexp(1.0, -24)).worst,
            1.0);
  EXPECT_GT(check_gemm_result("off", {1.0, 2.0, 4.0, 4.0}, ref, mag, 2, std::ldexp(1.0, -24)).worst,
            1e5);
  EXPECT_TRUE(std::isinf(
      check_gemm_result("nan", {1.0, NAN, 3.0, 4.0}, ref, mag, 2, std::ldexp(1.0, -24)).worst));
  // Rounding within the bound passes: a relative error of k u.
  const double u = std::ldexp(1.0, -24);
  EXPECT_LE(check_gemm_result("rounded", {1.0 + 2 * u, 2.0, 3.0, 4.0}, ref, mag, 2, u).worst, 1.0);
}

TEST(BlasProbe, ChildVerdictsSurviveCrashesHangsAndWrongKernels) {
  const std::string core = detect_blas().core;
  if (!detect_blas().openblas) GTEST_SKIP() << "the BLAS is not OpenBLAS";
  ProbeVerdict v = probe_in_child(core);  // this very binary, re-executed as a probe child
  EXPECT_TRUE(v.ok) << v.reason;
  EXPECT_GE(v.checks.size(), 40u);
  setenv("ACTMEM_BLAS_PROBE_FAULT", "wrong", 1);
  v = probe_in_child(core);
  EXPECT_FALSE(v.ok);
  EXPECT_NE(v.reason.find("sgemm NT 67x129x53 is off by"), std::string::npos) << v.reason;
  setenv("ACTMEM_BLAS_PROBE_FAULT", "crash", 1);
  v = probe_in_child(core);
  EXPECT_FALSE(v.ok);
  EXPECT_NE(v.reason.find("the probe crashed (signal 6)"), std::string::npos) << v.reason;
  setenv("ACTMEM_BLAS_PROBE_FAULT", "hang", 1);
  v = probe_in_child(core, /*timeout_s=*/2.0);
  EXPECT_FALSE(v.ok);
  EXPECT_NE(v.reason.find("did not finish within 2 s"), std::string::npos) << v.reason;
  unsetenv("ACTMEM_BLAS_PROBE_FAULT");
}

// The program, through the seam that fakes what detection picked (ACTMEM_BLAS_FAKE_CORE), with
// its own verdict cache.
nlohmann::json blas_record(const std::string& env, const std::string& cache) {
  const std::string log = cache + ".jsonl";  // one per test: ctest runs them side by side
  const std::string cmd = "env -u OPENBLAS_CORETYPE XDG_CACHE_HOME=" + cache + " " + env + " " +
                          std::string(ACTMEM_BINARY) +
                          " train --num-layers 1 --hidden-size 32 --num-attention-heads 2 "
                          "--seq-length 16 --micro-batch-size 2 --threads 1 --train-iters 1 "
                          "--eval-interval 0 --log-json " + log + " > /dev/null 2>&1";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream in(log);
  std::string first;
  std::getline(in, first);
  return nlohmann::json::parse(first)["runtime"]["blas"];
}

TEST(BlasChoice, NothingChangesWhenDetectionPicksTheBest) {
  if (!detect_blas().openblas || std::getenv("OPENBLAS_CORETYPE") != nullptr) {
    GTEST_SKIP() << "needs OpenBLAS without OPENBLAS_CORETYPE";
  }
  const std::string cache = ::testing::TempDir() + "blas_cache_best";
  std::filesystem::remove_all(cache);
  const std::string best = best_openblas_core(detect_cpu_features());
  const auto blas = blas_record("ACTMEM_BLAS_FAKE_CORE=" + best, cache);
  EXPECT_EQ(blas["source"], "detection") << blas.dump();
  EXPECT_EQ(blas["detected_core"], best);
  EXPECT_NE(blas["note"].get<std::string>().find("the best this CPU supports"), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(cache + "/actmem/blas-probe.json"));  // no probe ran
}

TEST(BlasChoice, AFamilyBelowTheCpusIsReplacedAfterAProbeThatIsCached) {
  const CpuFeatures cpu = detect_cpu_features();
  const std::string best = best_openblas_core(cpu);
  if (!detect_blas().openblas || std::getenv("OPENBLAS_CORETYPE") != nullptr ||
      openblas_core_rank(best) <= openblas_core_rank("Prescott")) {
    GTEST_SKIP() << "needs OpenBLAS without OPENBLAS_CORETYPE on a CPU above Prescott";
  }
  const std::string cache = ::testing::TempDir() + "blas_cache_choice";
  std::filesystem::remove_all(cache);
  auto blas = blas_record("ACTMEM_BLAS_FAKE_CORE=Prescott", cache);
  EXPECT_EQ(blas["source"], "actmem") << blas.dump();
  EXPECT_EQ(blas["detected_core"], "Prescott");
  EXPECT_EQ(blas["core"], best);  // what OpenBLAS runs after the re-execution
  const std::string file = cache + "/actmem/blas-probe.json";
  ASSERT_TRUE(std::filesystem::exists(file));
  const auto verdicts = nlohmann::json::parse(std::ifstream(file));
  ASSERT_EQ(verdicts.size(), 1u);
  EXPECT_TRUE(verdicts.begin().value()["ok"].get<bool>());
  const auto written = std::filesystem::last_write_time(file);
  // The second run reads the verdict instead of probing again, and the switch keeps Prescott.
  blas = blas_record("ACTMEM_BLAS_FAKE_CORE=Prescott", cache);
  EXPECT_EQ(blas["source"], "actmem");
  EXPECT_EQ(std::filesystem::last_write_time(file), written);
  blas = blas_record("ACTMEM_BLAS_FAKE_CORE=Prescott ACTMEM_BLAS_KERNEL_CHOICE=off", cache);
  EXPECT_EQ(blas["source"], "detection");
  EXPECT_NE(blas["note"].get<std::string>().find("switched off"), std::string::npos);
}

TEST(BlasChoice, AUserSettingIsKeptAndReported) {
  if (!detect_blas().openblas) GTEST_SKIP() << "the BLAS is not OpenBLAS";
  const std::string cache = ::testing::TempDir() + "blas_cache_user";
  const auto blas = blas_record("OPENBLAS_CORETYPE=Haswell ACTMEM_BLAS_FAKE_CORE=Prescott", cache);
  EXPECT_EQ(blas["source"], "user") << blas.dump();
  EXPECT_NE(blas["note"].get<std::string>().find("set by the user: kept"), std::string::npos);
}

}  // namespace
}  // namespace actmem
