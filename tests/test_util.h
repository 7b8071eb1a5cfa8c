// test_util.h — helpers shared by the tests: error-message matching, bitwise comparison,
// finite-difference gradient checks and running the actmem binary.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>
#include <nlohmann/json.hpp>

#include <unistd.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

namespace actmem::testing {

/// Runs `fn`, expects a c10::Error whose message contains `needle`.
inline void expect_error_containing(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected an error containing \"" << needle << "\", but nothing was thrown";
  } catch (const c10::Error& e) {
    EXPECT_NE(e.msg().find(needle), std::string::npos)
        << "error \"" << e.msg() << "\" does not contain \"" << needle << "\"";
  }
}

/// True when a and b have the same dtype, shape and bytes.
/// |a - b| / |b|: how far a is from the reference b, relatively.
inline double rel(double a, double b) {
  return std::abs(a - b) / std::max(std::abs(b), 1e-30);
}

inline bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::Tensor x = a.cpu().contiguous(), y = b.cpu().contiguous();  // CUDA tensors too
  return std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

/// Finite-difference gradient check in double: compares autograd's gradient of
/// sum(fn(inputs) * w) (w fixed random) with central differences for every input element.
inline void gradcheck(const std::function<at::Tensor(const std::vector<at::Tensor>&)>& fn,
                      std::vector<at::Tensor> inputs, double eps = 1e-6, double atol = 1e-7,
                      double rtol = 1e-5) {
  for (auto& x : inputs) {
    ASSERT_EQ(x.scalar_type(), at::kDouble) << "gradcheck needs double inputs";
    x = x.detach().clone().requires_grad_(true);
  }
  at::Tensor out = fn(inputs);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(99);
  const at::Tensor w = at::empty(out.sizes(), at::kDouble).normal_(0, 1, gen);
  // backward() rather than autograd::grad(): checkpoints refuse grad(), as Megatron's do.
  (out * w).sum().backward();
  std::vector<at::Tensor> analytic;
  for (auto& x : inputs) analytic.push_back(x.grad().defined() ? x.grad().clone() : at::Tensor());
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < inputs.size(); ++i) {
    at::Tensor flat = inputs[i].view({-1});
    const at::Tensor g = analytic[i].defined() ? analytic[i].reshape({-1}) : at::zeros_like(flat);
    for (int64_t j = 0; j < flat.numel(); ++j) {
      const double orig = flat[j].item<double>();
      flat[j] = orig + eps;
      const double plus = (fn(inputs) * w).sum().item<double>();
      flat[j] = orig - eps;
      const double minus = (fn(inputs) * w).sum().item<double>();
      flat[j] = orig;
      const double numeric = (plus - minus) / (2 * eps);
      const double got = g[j].item<double>();
      ASSERT_NEAR(got, numeric, atol + rtol * std::abs(numeric))
          << "input " << i << " element " << j;
    }
  }
}

/// A new, empty directory under the test temp dir (unique: ctest runs tests in parallel).
inline std::string fresh_temp_dir(const std::string& prefix) {
  std::string path = ::testing::TempDir() + prefix + "_XXXXXX";
  if (mkdtemp(path.data()) == nullptr) ADD_FAILURE() << "mkdtemp failed for " << path;
  return path;
}

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
  std::string stderr_text;
};

/// Runs the actmem binary with `args` (a shell-quoted string) and captures its output.
inline CommandResult run_actmem(const std::string& args) {
  std::string err_file = ::testing::TempDir() + "actmem_stderr_XXXXXX";
  const int fd = mkstemp(err_file.data());  // unique: ctest runs tests in parallel
  if (fd >= 0) close(fd);
  const std::string cmd = std::string(ACTMEM_BINARY) + " " + args + " 2>" + err_file;
  CommandResult r;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return r;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) r.output.append(buf.data(), n);
  const int status = pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  if (FILE* f = std::fopen(err_file.c_str(), "r")) {
    while ((n = fread(buf.data(), 1, buf.size(), f)) > 0) r.stderr_text.append(buf.data(), n);
    std::fclose(f);
  }
  std::remove(err_file.c_str());
  r.output += r.stderr_text;
  return r;
}

/// A JSON log of `actmem train --log-json`: its first record (the run's configuration) and one
/// record per iteration. Adds a failure when the first record is not the configuration or a
/// later one is not an iteration.
struct JsonLog {
  nlohmann::json config;
  std::vector<nlohmann::json> iterations;
};
inline JsonLog read_json_log(const std::string& path) {
  JsonLog log;
  std::ifstream in(path);
  std::string line;
  bool first = true;
  while (std::getline(in, line)) {
    nlohmann::json j = nlohmann::json::parse(line);
    if (first) {
      EXPECT_EQ(j.value("record", ""), "config") << "first record of " << path << ": " << line;
      log.config = std::move(j);
      first = false;
    } else {
      EXPECT_TRUE(j.contains("iteration")) << path << ": " << line;
      log.iterations.push_back(std::move(j));
    }
  }
  return log;
}

}  // namespace actmem::testing
