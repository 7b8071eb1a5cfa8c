// bench_attention.cpp — the two attention kernels side by side: the unfused path (scores,
// softmax and the product with V as separate ops, every [b, a, s, s] tensor kept) and the flash
// kernel (Note [Attention backends] in src/config/config.cpp).
//
// Part 1, attention alone: forward + backward of CoreAttention at s = 512, 1024, 2048 (fp32 and
// bf16), the two kernels alternating call by call, median times and their ratio, and the bytes
// each keeps for backward (the activation ledger) beside its formula. Part 2, the step: the
// 4-layer reference model (bench_common.h) at s = 512, b = 4 and at s = 2048, b = 1, fp32 and
// bf16, without
// attention dropout (the flash kernel has none) and with hidden dropout, under each kernel plain
// and with selective core_attn recompute (each pair checked bitwise equal by step_round_robin),
// with the step-time ratio flash / unfused and the measured and predicted activation bytes.
#include "actmem/base/blas.h"
#include "actmem/flags/train_options.h"
#include "actmem/memory/ledger.h"
#include "actmem/model/attention/attention.h"
#include "bench_common.h"

#include <torch/autograd.h>
#include <CLI/CLI.hpp>

#include <chrono>
#include <fstream>
#include <iostream>

namespace {

using actmem::AttentionKernel;
using actmem::TransformerConfig;

struct KernelRun {
  std::vector<double> times;
  int64_t saved_bytes = 0;
};

// One forward + backward of `attn` on fresh gradients; returns seconds, and the bytes the
// forward saved when `ledger` is given.
double attention_step(actmem::CoreAttention& attn, const at::Tensor& q, const at::Tensor& k,
                      const at::Tensor& v, const at::Tensor& mask, const at::Tensor& w,
                      actmem::ActivationLedger* ledger) {
  const auto start = std::chrono::steady_clock::now();
  at::Tensor out;
  {
    std::optional<actmem::LedgerScope> scope;
    if (ledger != nullptr) scope.emplace(*ledger);
    out = attn.forward(q, k, v, mask);
  }
  if (ledger != nullptr) ledger->finalize();
  torch::autograd::grad({(out * w).sum()}, {q, k, v});
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

nlohmann::json attention_alone(int64_t s, at::ScalarType dtype, int64_t b, int64_t a, int64_t d,
                               int warmup, int iters) {
  TransformerConfig c;
  c.attention_dropout = 0.0;
  c.attention_backend = "unfused";
  actmem::CoreAttention unfused(c);
  c.attention_backend = "flash";
  actmem::CoreAttention flash(c);
  const auto opts = at::TensorOptions().dtype(dtype);
  const at::Tensor q = at::randn({s, b, a, d}, opts).requires_grad_();
  const at::Tensor k = at::randn({s, b, a, d}, opts).requires_grad_();
  const at::Tensor v = at::randn({s, b, a, d}, opts).requires_grad_();
  const at::Tensor w = at::randn({s, b, a * d}, opts);
  const at::Tensor mask = actmem::make_causal_mask(s);
  KernelRun runs[2];
  actmem::CoreAttention* kernels[2] = {&unfused, &flash};
  for (int it = 0; it < warmup + iters; ++it) {
    // Alternate which kernel goes first, so neither always follows the other.
    for (int j = 0; j < 2; ++j) {
      const int i = (it + j) % 2;
      actmem::ActivationLedger ledger;
      ledger.exclude({q, k, v, mask});  // the inputs are the caller's, not kept by the kernel
      const double t = attention_step(*kernels[i], q, k, v, mask, w, it == 0 ? &ledger : nullptr);
      if (it == 0) runs[i].saved_bytes = ledger.total_bytes();
      if (it >= warmup) runs[i].times.push_back(t);
    }
  }
  const int64_t e = at::elementSize(dtype), lse = dtype == at::kDouble ? 8 : 4;
  const int64_t sbh = s * b * a * d, as2b = a * s * s * b;
  // Beyond the inputs: unfused keeps the softmax output (as^2b e; no dropout here) and its
  // context copy is not kept by attention; flash keeps its output (sbh e) and logsumexp (4asb).
  const int64_t unfused_formula = as2b * e, flash_formula = sbh * e + a * s * b * lse;
  const double tu = actmem::median(runs[0].times), tf = actmem::median(runs[1].times);
  std::cout << std::left << std::setw(6) << s << std::setw(7) << c10::toString(dtype) << std::right
            << std::fixed << std::setprecision(2) << std::setw(12) << tu * 1e3 << std::setw(12)
            << tf * 1e3 << std::setw(8) << tf / tu << std::setw(14)
            << actmem::format_bytes(static_cast<double>(runs[0].saved_bytes)) << std::setw(14)
            << actmem::format_bytes(static_cast<double>(unfused_formula)) << std::setw(14)
            << actmem::format_bytes(static_cast<double>(runs[1].saved_bytes)) << std::setw(14)
            << actmem::format_bytes(static_cast<double>(flash_formula)) << "\n";
  TORCH_CHECK(runs[0].saved_bytes == unfused_formula && runs[1].saved_bytes == flash_formula,
              "bench_attention: kept bytes differ from the formulas at s = ", s);
  return {{"seq_length", s},
          {"dtype", c10::toString(dtype)},
          {"unfused_ms", tu * 1e3},
          {"flash_ms", tf * 1e3},
          {"flash_over_unfused", tf / tu},
          {"unfused_saved_bytes", runs[0].saved_bytes},
          {"flash_saved_bytes", runs[1].saved_bytes}};
}

nlohmann::json model_step(const TransformerConfig& model, int warmup, int iters) {
  using actmem::bench::Strategy;
  const std::vector<Strategy> list = {
      {"plain", [](TransformerConfig&) {}},
      {"recompute core_attn", actmem::bench::selective({"core_attn"})}};
  nlohmann::json out = nlohmann::json::object();
  std::vector<double> plain_step;
  std::vector<int64_t> plain_bytes;
  for (const char* backend : {"unfused", "flash"}) {
    TransformerConfig c = model;
    c.attention_backend = backend;
    const actmem::bench::RoundRobin run =
        actmem::bench::step_round_robin("bench_attention", c, list, warmup, iters);
    std::cout << "\n"
              << backend << " (s " << c.seq_length << ", b " << c.micro_batch_size << ", "
              << c.precision() << ")\n";
    out[backend] = actmem::bench::print_strategy_table(std::cout, list, run);
    plain_step.push_back(actmem::median(run.times[0]));
    plain_bytes.push_back(run.last[0].activation_bytes);
  }
  std::cout << std::fixed << std::setprecision(3) << "flash / unfused: step time "
            << plain_step[1] / plain_step[0] << ", activations "
            << static_cast<double>(plain_bytes[1]) / static_cast<double>(plain_bytes[0]) << "\n";
  out["flash_over_unfused_step"] = plain_step[1] / plain_step[0];
  out["flash_over_unfused_activations"] =
      static_cast<double>(plain_bytes[1]) / static_cast<double>(plain_bytes[0]);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  actmem::set_reproducible_blas();  // as the actmem program (Note [Reproducible products])
  CLI::App app{"bench_attention: the unfused and flash attention kernels, alone and in the step"};
  int iters = 3, warmup = 1, threads = 0;
  bool skip_model = false;
  std::string json_path;
  std::vector<int64_t> lengths = {512, 1024, 2048};
  app.add_option("--seq-lengths", lengths, "Sequence lengths of part 1")->capture_default_str();
  app.add_option("--iters", iters, "Timed runs per kernel / steps per strategy")
      ->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed runs first")->capture_default_str();
  app.add_option("--threads", threads, "Intra-op threads (default: one per core)");
  app.add_flag("--attention-only", skip_model, "Part 1 only");
  app.add_option("--json", json_path, "Also write the results to FILE");
  CLI11_PARSE(app, argc, argv);
  actmem::bench::print_blas();
  try {
    actmem::apply_thread_count(threads);
    const int64_t b = 1, a = 8, d = 64;
    std::cout << "attention alone: b " << b << ", " << a << " heads of " << d
              << ", causal, no dropout; forward + backward, median of " << iters << "\n\n"
              << std::left << std::setw(6) << "s" << std::setw(7) << "dtype" << std::right
              << std::setw(12) << "unfused ms" << std::setw(12) << "flash ms" << std::setw(8)
              << "ratio" << std::setw(14) << "unfused kept" << std::setw(14) << "as^2b e"
              << std::setw(14) << "flash kept" << std::setw(14) << "sbh e + 4asb"
              << "\n";
    nlohmann::json out;
    out["attention"] = nlohmann::json::array();
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      for (const int64_t s : lengths) {
        out["attention"].push_back(attention_alone(s, dtype, b, a, d, warmup, iters));
      }
    }
    if (!skip_model) {
      for (const bool bf16 : {false, true}) {
        TransformerConfig m;
        actmem::bench::use_reference_model(m);
        m.attention_dropout = 0.0;
        m.bf16 = bf16;
        const std::string tag = bf16 ? "_bf16" : "_fp32";
        out["model_s512" + tag] = model_step(m, warmup, iters);
        m.seq_length = 2048;
        m.micro_batch_size = 1;
        out["model_s2048" + tag] = model_step(m, warmup, iters);
      }
    }
    if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  } catch (const c10::Error& e) {
    return actmem::bench::report(e);
  }
  return 0;
}
