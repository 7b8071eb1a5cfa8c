// bench_gdn.cpp — the gated delta rule (Note [Gated delta rule] in
// include/actmem/model/gated_delta_rule.h), token by token and by chunks, beside causal flash
// attention of the same heads.
//
// Forward + backward at s = 512 and 2048 (fp32 and bf16), b 1, H heads of dk = dv = d: the
// kernels alternating call by call, median times, tokens per second, the chunked form's speed-up
// over the recurrence, and the bytes each keeps for its backward beyond its inputs (the activation
// ledger): the two compositions of libtorch ops keep what their ops save, the one-node form
// (gated_delta_rule) nothing but its inputs.
#include "actmem/base/blas.h"
#include "actmem/flags/train_options.h"
#include "actmem/memory/ledger.h"
#include "actmem/model/attention.h"
#include "actmem/model/gated_delta_rule.h"
#include "bench_common.h"

#include <torch/autograd.h>
#include <CLI/CLI.hpp>

#include <chrono>
#include <fstream>
#include <functional>
#include <iostream>

namespace {

using Kernel = std::function<at::Tensor()>;

struct KernelRun {
  const char* name;
  Kernel run;
  std::vector<double> times;
  int64_t saved_bytes = 0;
};

nlohmann::json kernels_at(int64_t s, at::ScalarType dtype, int64_t b, int64_t H, int64_t d,
                          int64_t chunk, int warmup, int iters) {
  const auto opts = at::TensorOptions().dtype(dtype);
  auto l2 = [](const at::Tensor& x) { return x / x.norm(2, -1, true); };
  const at::Tensor q =
      l2(at::randn({b, s, H, d}, opts.dtype(at::kFloat))).to(dtype).requires_grad_();
  const at::Tensor k =
      l2(at::randn({b, s, H, d}, opts.dtype(at::kFloat))).to(dtype).requires_grad_();
  const at::Tensor v = at::randn({b, s, H, d}, opts).requires_grad_();
  const at::Tensor g = (-at::softplus(at::randn({b, s, H}))).to(dtype).requires_grad_();
  const at::Tensor beta = at::sigmoid(at::randn({b, s, H})).to(dtype).requires_grad_();
  const at::Tensor w = at::randn({b, s, H, d}, opts);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  // Flash attention over the same heads, [s, b, H, d] as CoreAttention takes them.
  actmem::TransformerConfig c;
  c.attention_dropout = 0.0;
  c.attention_backend = "flash";
  actmem::CoreAttention flash(c);
  const at::Tensor qs = q.detach().transpose(0, 1).contiguous().requires_grad_();
  const at::Tensor ks = k.detach().transpose(0, 1).contiguous().requires_grad_();
  const at::Tensor vs = v.detach().transpose(0, 1).contiguous().requires_grad_();
  const at::Tensor mask = actmem::make_causal_mask(s);
  std::vector<KernelRun> runs = {
      {"recurrent",
       [&] { return actmem::gated_delta_rule_recurrent(q, k, v, g, beta, scale); },
       {},
       0},
      {"chunked",
       [&] { return actmem::gated_delta_rule_chunked(q, k, v, g, beta, scale, chunk); },
       {},
       0},
      {"chunked, one node",
       [&] { return actmem::gated_delta_rule(q, k, v, g, beta, scale, chunk); },
       {},
       0},
      {"flash attention",
       [&] {
         return flash.forward(qs, ks, vs, mask).view({s, b, H, d}).transpose(0, 1);
       },
       {},
       0}};
  for (int it = 0; it < warmup + iters; ++it) {
    for (size_t j = 0; j < runs.size(); ++j) {
      KernelRun& r = runs[(static_cast<size_t>(it) + j) % runs.size()];
      actmem::ActivationLedger ledger;
      ledger.exclude({q, k, v, g, beta, qs, ks, vs, mask});  // the caller's inputs
      const auto start = std::chrono::steady_clock::now();
      at::Tensor out;
      {
        std::optional<actmem::LedgerScope> scope;
        if (it == 0) scope.emplace(ledger);
        out = r.run();
      }
      if (it == 0) {
        ledger.finalize();
        r.saved_bytes = ledger.total_bytes();
      }
      const bool attention = r.name[0] == 'f';
      torch::autograd::grad({(out * w).sum()}, attention
                                                   ? std::vector<at::Tensor>{qs, ks, vs}
                                                   : std::vector<at::Tensor>{q, k, v, g, beta});
      const double t =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (it >= warmup) r.times.push_back(t);
    }
  }
  nlohmann::json row = {{"seq_length", s}, {"dtype", c10::toString(dtype)}};
  const double recurrent = actmem::median(runs[0].times), chunked = actmem::median(runs[1].times);
  for (const KernelRun& r : runs) {
    const double t = actmem::median(r.times);
    std::cout << std::left << std::setw(6) << s << std::setw(10) << c10::toString(dtype)
              << std::setw(19) << r.name << std::right << std::fixed << std::setprecision(2)
              << std::setw(11) << t * 1e3 << std::setw(13) << std::setprecision(0)
              << static_cast<double>(b * s) / t << std::setw(14)
              << actmem::format_bytes(static_cast<double>(r.saved_bytes)) << "\n";
    row[r.name] = {{"ms", t * 1e3},
                   {"tokens_per_s", static_cast<double>(b * s) / t},
                   {"saved_bytes", r.saved_bytes}};
  }
  std::cout << std::setprecision(1) << "      chunked is " << recurrent / chunked
            << "x the recurrence\n";
  row["chunked_speedup"] = recurrent / chunked;
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  actmem::set_reproducible_blas();  // as the actmem program (Note [Reproducible products])
  CLI::App app{"bench_gdn: the gated delta rule, recurrent and chunked, beside flash attention"};
  int iters = 3, warmup = 1, threads = 0;
  int64_t heads = 4, head_dim = 64, chunk = 64;
  std::string json_path;
  std::vector<int64_t> lengths = {512, 2048};
  app.add_option("--seq-lengths", lengths, "Sequence lengths")->capture_default_str();
  app.add_option("--heads", heads, "Value heads (one key head each)")->capture_default_str();
  app.add_option("--head-dim", head_dim, "dk = dv")->capture_default_str();
  app.add_option("--chunk-size", chunk, "The chunked form's chunk")->capture_default_str();
  app.add_option("--iters", iters, "Timed runs per kernel")->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed runs first")->capture_default_str();
  app.add_option("--threads", threads, "Intra-op threads (default: one per core)");
  app.add_option("--json", json_path, "Also write the results to FILE");
  CLI11_PARSE(app, argc, argv);
  actmem::bench::print_blas();
  try {
    actmem::apply_thread_count(threads);
    const int64_t b = 1;
    std::cout << "gated delta rule: b " << b << ", " << heads << " heads of " << head_dim
              << ", chunks of " << chunk << "; forward + backward, median of " << iters << "\n\n"
              << std::left << std::setw(6) << "s" << std::setw(10) << "dtype" << std::setw(19)
              << "kernel" << std::right << std::setw(11) << "ms" << std::setw(13) << "tokens/s"
              << std::setw(14) << "kept"
              << "\n";
    nlohmann::json out;
    out["kernels"] = nlohmann::json::array();
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      for (const int64_t s : lengths) {
        out["kernels"].push_back(kernels_at(s, dtype, b, heads, head_dim, chunk, warmup, iters));
      }
    }
    if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  } catch (const c10::Error& e) {
    return actmem::bench::report(e);
  }
  return 0;
}
