// bench_gdn.cpp — the gated delta rule (Note [Gated delta rule] in
// include/actmem/model/gdn/gated_delta_rule.h), token by token and by chunks, beside causal flash
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
#include "actmem/model/attention/attention.h"
#include "actmem/model/gdn/gated_delta_rule.h"
#include "actmem/train/trainer.h"
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

// The benchmark's models at width h, Qwen3-Next's proportions scaled down: attention in heads
// of 64; with a linear_attention_freq `pattern`, GatedDeltaNet layers of value width 2h in heads
// of 128 and half as many key heads.
actmem::TransformerConfig bench_model(int64_t h, int64_t s, int64_t layers,
                                      const std::string& pattern) {
  actmem::TransformerConfig c;
  c.num_layers = layers;
  c.hidden_size = h;
  c.num_attention_heads = h / 64;
  c.seq_length = s;
  c.micro_batch_size = 1;
  c.vocab_size = 1024;
  c.gated_linear_unit = true;
  c.normalization = "RMSNorm";
  c.position_embedding_type = "rope";
  c.add_bias_linear = false;
  if (!pattern.empty()) {
    c.experimental_attention_variant = "gdn";
    c.linear_attention_freq = pattern;
    c.linear_key_head_dim = c.linear_value_head_dim = 128;
    c.linear_num_value_heads = 2 * h / 128;
    c.linear_num_key_heads = h / 128;
  }
  return c;
}

// A model of `layers` GatedDeltaNet layers against the same model with attention layers (the
// flash kernel: no attention dropout). Steps alternate between the two; median step times, the
// activation bytes each step kept (tracker) and the predictor's.
nlohmann::json layer_comparison(int64_t h, int64_t s, int64_t layers, int warmup, int iters) {
  actmem::TransformerConfig attn = bench_model(h, s, layers, "");
  actmem::TransformerConfig gdn =
      bench_model(h, s, layers, "([1]*" + std::to_string(layers) + ")");  // every layer GDN
  attn.attention_dropout = gdn.attention_dropout = 0.0;
  actmem::TrainingConfig t;
  t.eval_interval = 0;
  t.train_iters = warmup + iters;
  actmem::Trainer a(attn, t), g(gdn, t);
  std::vector<double> ta, tg;
  actmem::IterationStats sa, sg;
  for (int it = 0; it < warmup + iters; ++it) {
    // Alternate which runs first.
    if (it % 2 == 0) {
      sa = a.train_step(false);
      sg = g.train_step(false);
    } else {
      sg = g.train_step(false);
      sa = a.train_step(false);
    }
    if (it >= warmup) {
      ta.push_back(sa.step_time_s);
      tg.push_back(sg.step_time_s);
    }
  }
  const double ma = actmem::median(ta), mg = actmem::median(tg);
  std::cout << std::left << std::setw(6) << s << std::setw(22) << "attention (flash)" << std::right
            << std::fixed << std::setprecision(1) << std::setw(10) << ma * 1e3 << std::setw(8)
            << "1.00" << std::setw(14)
            << actmem::format_bytes(static_cast<double>(sa.activation_bytes)) << std::setw(14)
            << actmem::format_bytes(static_cast<double>(sa.predicted_activation_bytes)) << "\n"
            << std::left << std::setw(6) << s << std::setw(22) << "GatedDeltaNet" << std::right
            << std::setw(10) << mg * 1e3 << std::setw(8) << std::setprecision(2) << mg / ma
            << std::setw(14) << actmem::format_bytes(static_cast<double>(sg.activation_bytes))
            << std::setw(14)
            << actmem::format_bytes(static_cast<double>(sg.predicted_activation_bytes)) << "\n";
  auto row = [](double ms, const actmem::IterationStats& st) {
    return nlohmann::json{{"step_ms", ms},
                          {"activation_bytes", st.activation_bytes},
                          {"predicted_activation_bytes", st.predicted_activation_bytes},
                          {"parameters", nullptr}};
  };
  nlohmann::json out = {{"seq_length", s},
                        {"hidden_size", h},
                        {"layers", layers},
                        {"attention", row(ma * 1e3, sa)},
                        {"gdn", row(mg * 1e3, sg)}};
  out["attention"]["parameters"] = a.model().num_parameters();
  out["gdn"]["parameters"] = g.model().num_parameters();
  out["gdn_step_ratio"] = mg / ma;
  return out;
}

// gdn_norm_out on a 3:1 hybrid of `layers` layers: plain against output-discarding recompute
// of the gated norm (round-robin, checked bitwise equal every step).
nlohmann::json norm_out_recompute(int64_t h, int64_t s, int64_t layers, int warmup, int iters) {
  const actmem::TransformerConfig c = bench_model(h, s, layers, "4");
  const std::vector<actmem::bench::Strategy> list = {
      {"plain", [](actmem::TransformerConfig&) {}},
      {"selective gdn_norm_out", actmem::bench::selective({"gdn_norm_out"})},
      {"selective gdn_norm_out+core_attn", actmem::bench::selective({"gdn_norm_out", "core_attn"})},
  };
  const auto run = actmem::bench::step_round_robin("bench_gdn", c, list, warmup, iters);
  return actmem::bench::print_strategy_table(std::cout, list, run);
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
    const int64_t h = 256, layers = 4;
    std::cout << "\nA layer: " << layers << " GatedDeltaNet layers against " << layers
              << " attention layers, h " << h << ", b 1; training step, median of " << iters
              << "\n\n"
              << std::left << std::setw(6) << "s" << std::setw(22) << "layers" << std::right
              << std::setw(10) << "step ms" << std::setw(8) << "ratio" << std::setw(14)
              << "activations" << std::setw(14) << "predicted"
              << "\n";
    out["layers"] = nlohmann::json::array();
    for (const int64_t s : lengths) {
      out["layers"].push_back(layer_comparison(h, s, layers, warmup, iters));
    }
    std::cout << "\ngdn_norm_out on a 3:1 hybrid (layers 0-2 GatedDeltaNet, 3 attention), h " << h
              << ", s " << lengths.front() << ", b 1\n\n";
    out["gdn_norm_out"] = norm_out_recompute(h, lengths.front(), layers, warmup, iters);
    if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  } catch (const c10::Error& e) {
    return actmem::bench::report(e);
  }
  return 0;
}
