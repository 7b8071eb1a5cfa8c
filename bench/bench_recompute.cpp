// bench_recompute.cpp — step-time ratio and activation memory of every recompute strategy
// against the plain step, on the 4-layer hidden-512 model (or any shape given by flags).
//
// Reference: the plain run, stepped in the same round-robin as the strategies so machine drift
// hits all alike. Validation: every strategy's loss and gradient digest must equal the plain
// run's at every step (the program fails otherwise). Bounds, measured in the same run: full
// recompute replays the whole forward once, so its ideal ratio is (step + forward) / step;
// selective core_attn replays the core-attention forward, so its ideal is
// (step + L * core-attention forward) / step.
#include "actmem/base/blas.h"
#include "actmem/flags/train_options.h"
#include "actmem/model/model.h"
#include "actmem/train/trainer.h"
#include "bench_common.h"

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <iostream>

namespace {

using actmem::bench::Strategy;

std::vector<Strategy> strategies(int64_t L) {
  auto full = [](const char* method, int64_t n) {
    return [=](actmem::TransformerConfig& c) {
      c.recompute_granularity = "full";
      c.recompute_method = method;
      c.recompute_num_layers = n;
    };
  };
  auto sel = [](std::vector<std::string> m) {
    return [=](actmem::TransformerConfig& c) {
      c.recompute_granularity = "selective";
      c.recompute_modules = m;
    };
  };
  return {{"plain", [](actmem::TransformerConfig&) {}},
          {"full uniform 1", full("uniform", 1)},
          {"full uniform " + std::to_string(L), full("uniform", L)},
          {"full block " + std::to_string(std::max<int64_t>(1, L / 2)),
           full("block", std::max<int64_t>(1, L / 2))},
          {"selective core_attn", sel({"core_attn"})},
          {"selective mlp", sel({"mlp"})},
          {"selective layernorm", sel({"layernorm"})},
          {"selective all", sel({"core_attn", "mlp", "layernorm"})}};
}

using Clock = std::chrono::steady_clock;

// Median time of a training-mode forward (graph built, then dropped) of the whole model.
double time_forward(actmem::GPTModel& model, const actmem::TransformerConfig& c, int iters) {
  const at::Tensor tokens = at::randint(0, 256, {c.micro_batch_size, c.seq_length}, at::kLong);
  std::vector<double> t;
  for (int i = 0; i < iters + 1; ++i) {
    const auto t0 = Clock::now();
    { at::Tensor loss = model.forward(tokens, tokens); }
    if (i > 0) t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return actmem::median(t);
}

// Median time of the core-attention forward of one layer with grad enabled.
double time_core_attention(const actmem::TransformerConfig& c, int iters) {
  actmem::CoreAttention attn(c);
  attn.train();
  const int64_t d = c.kv_channels();
  auto make = [&] {
    return at::randn({c.seq_length, c.micro_batch_size, c.num_attention_heads, d})
        .requires_grad_(true);
  };
  const at::Tensor q = make(), k = make(), v = make();
  const at::Tensor mask = actmem::make_causal_mask(c.seq_length);
  std::vector<double> t;
  for (int i = 0; i < iters + 1; ++i) {
    const auto t0 = Clock::now();
    { at::Tensor out = attn.forward(q, k, v, mask); }
    if (i > 0) t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return actmem::median(t);
}

}  // namespace

int main(int argc, char** argv) {
  actmem::set_reproducible_blas();  // as the actmem program (Note [Reproducible products])
  CLI::App app{"bench_recompute: step time and activation memory of every recompute strategy"};
  actmem::TrainOptions o;
  actmem::bench::use_reference_model(o.model);
  actmem::add_model_flags(app, o);
  int iters = 3, warmup = 1;
  std::string json_path;
  app.add_option("--iters", iters, "Timed steps per strategy")->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed steps first")->capture_default_str();
  app.add_option("--threads", o.threads, "Intra-op threads (default: one per core)");
  app.add_option("--json", json_path, "Also write the results to FILE");
  CLI11_PARSE(app, argc, argv);
  actmem::bench::print_blas();
  try {
    o.finalize();
    actmem::apply_thread_count(o.threads);
    const auto& base = o.model;
    const auto list = strategies(base.num_layers);
    const actmem::bench::RoundRobin run =
        actmem::bench::step_round_robin("bench_recompute", base, list, warmup, iters);
    const auto& times = run.times;
    const auto& last = run.last;
    const auto& trainers = run.trainers;
    const double plain = actmem::median(times[0]);
    const double fwd = time_forward(trainers[0]->model(), base, iters);
    const double core = time_core_attention(base, iters) * static_cast<double>(base.num_layers);
    nlohmann::json out = {{"model",
                           {{"num_layers", base.num_layers},
                            {"hidden_size", base.hidden_size},
                            {"num_attention_heads", base.num_attention_heads},
                            {"ffn_hidden_size", base.ffn()},
                            {"seq_length", base.seq_length},
                            {"micro_batch_size", base.micro_batch_size}}},
                          {"plain_step_s", plain},
                          {"forward_s", fwd},
                          {"core_attention_forward_s", core},
                          {"full_recompute_bound", (plain + fwd) / plain},
                          {"core_attn_bound", (plain + core) / plain},
                          {"strategies", nlohmann::json::array()}};
    std::cout << std::fixed << "plain step " << std::setprecision(3) << plain << " s; forward "
              << fwd << " s; core attention forward (all layers) " << core << " s\n"
              << "ideal ratios: full recompute " << (plain + fwd) / plain
              << ", selective core_attn " << (plain + core) / plain << "\n\n"
              << std::left << std::setw(24) << "strategy" << std::right << std::setw(10) << "step s"
              << std::setw(8) << "ratio" << std::setw(14) << "activations" << std::setw(12)
              << "vs plain" << std::setw(14) << "act. peak" << std::setw(9) << "exact\n";
    for (size_t i = 0; i < list.size(); ++i) {
      const double step = actmem::median(times[i]);
      const auto& st = last[i];
      std::cout << std::left << std::setw(24) << list[i].name << std::right << std::setw(10)
                << std::setprecision(3) << step << std::setw(8) << step / plain << std::setw(14)
                << actmem::format_bytes(st.activation_bytes) << std::setw(11)
                << std::setprecision(1) << 100.0 * st.activation_bytes / last[0].activation_bytes
                << "%" << std::setw(14) << actmem::format_bytes(st.activation_peak_bytes)
                << std::setw(8) << "yes"
                << "\n";
      out["strategies"].push_back({{"name", list[i].name},
                                   {"step_time_s", step},
                                   {"ratio", step / plain},
                                   {"activation_bytes", st.activation_bytes},
                                   {"activation_peak_bytes", st.activation_peak_bytes},
                                   {"peak_device_bytes", st.peak_device_bytes},
                                   {"bitwise_equal_to_plain", true}});
    }
    if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  } catch (const c10::Error& e) {
    return actmem::bench::report(e);
  }
  return 0;
}
