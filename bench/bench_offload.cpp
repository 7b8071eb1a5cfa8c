// bench_offload.cpp — step-time overhead of CPU offload against the plain step at several
// emulated host-link bandwidths, and the overlap achieved (time compute waited for copies against
// the copy engine's busy time).
//
// Reference: the plain run, stepped round-robin with the offload runs. Validation: every run's
// loss and gradient digest must equal the plain run's at every step. Bandwidth is emulated by the
// CPU copy engine (docs/offload.md, "Copy engine"): a copy of n bytes takes at least
// n / bandwidth.
#include "actmem/base/blas.h"
#include "actmem/flags/train_options.h"
#include "actmem/train/trainer.h"
#include "bench_common.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <iomanip>
#include <iostream>

int main(int argc, char** argv) {
  actmem::set_reproducible_blas();  // as the actmem program (Note [Reproducible products])
  CLI::App app{"bench_offload: step-time overhead and overlap of CPU offload"};
  actmem::TrainOptions o;
  actmem::bench::use_reference_model(o.model);
  actmem::add_model_flags(app, o);
  std::vector<double> bandwidths = {0, 20, 5, 1};
  int iters = 3, warmup = 1;
  std::string json_path;
  app.add_option("--bandwidths", bandwidths, "Emulated GB/s per direction (0 = uncapped)")
      ->capture_default_str();
  app.add_option("--iters", iters, "Timed steps")->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed steps first (>= 1: offload's warmup)")
      ->capture_default_str();
  app.add_option("--threads", o.threads, "Intra-op threads (default: one per core)");
  app.add_option("--json", json_path, "Also write the results to FILE");
  CLI11_PARSE(app, argc, argv);
  actmem::bench::print_blas();
  try {
    o.offload_planned_later = true;  // the runs below add the offload the settings apply to
    o.finalize();
    actmem::apply_thread_count(o.threads);
    struct Run {
      std::string name;
      std::unique_ptr<actmem::Trainer> trainer;
      std::vector<double> times, waits, copies;
      actmem::IterationStats last;
    };
    std::vector<Run> runs;
    actmem::TrainingConfig t;
    t.eval_interval = 0;
    runs.push_back({"plain", std::make_unique<actmem::Trainer>(o.model, t), {}, {}, {}, {}});
    for (double bw : bandwidths) {
      actmem::TrainingConfig tb = t;
      tb.offload_bandwidth_gbps = bw;
      const std::string link = bw > 0 ? std::to_string(static_cast<int>(bw)) + " GB/s" : "uncapped";
      actmem::TransformerConfig fg = o.model;
      fg.fine_grained_activation_offloading = true;
      fg.offload_modules = {"attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"};
      runs.push_back(
          {"fine-grained all, " + link, std::make_unique<actmem::Trainer>(fg, tb), {}, {}, {}, {}});
      actmem::TransformerConfig layer = o.model;
      layer.cpu_offloading_num_layers = layer.num_layers / 2;
      runs.push_back(
          {"layer-level " + std::to_string(layer.cpu_offloading_num_layers) + ", " + link,
           std::make_unique<actmem::Trainer>(layer, tb),
           {},
           {},
           {},
           {}});
    }
    // Every run steps once per round, in a new order each round (Note [Step round order]).
    std::vector<actmem::Trainer*> order;
    for (auto& r : runs) order.push_back(r.trainer.get());
    actmem::run_shuffled_rounds(
        order, warmup + iters, /*compute_digest=*/true,
        [&](int it, const std::vector<actmem::IterationStats>& st) {
          for (size_t i = 0; i < runs.size(); ++i) {
            auto& r = runs[i];
            r.last = st[i];
            TORCH_CHECK(st[i].grad_digest == st[0].grad_digest && st[i].loss == st[0].loss,
                        "bench_offload: ", r.name,
                        " is not bitwise equal to the plain run at step ", it + 1);
            if (it >= warmup) {
              r.times.push_back(r.last.step_time_s);
              r.waits.push_back(r.last.offload_wait_s);
              r.copies.push_back(r.last.offload_copy_s);
            }
          }
          std::cerr << "step " << it + 1 << "/" << warmup + iters << " done for all runs\n";
        });
    const double plain = actmem::median(runs[0].times);
    nlohmann::json out = {{"plain_step_s", plain}, {"runs", nlohmann::json::array()}};
    std::cout << std::left << std::setw(34) << "run" << std::right << std::setw(9) << "step s"
              << std::setw(8) << "ratio" << std::setw(12) << "offloaded" << std::setw(12)
              << "activations" << std::setw(11) << "act. peak" << std::setw(10) << "copy s"
              << std::setw(10) << "wait s" << std::setw(10) << "hidden\n";
    for (const auto& r : runs) {
      const double step = actmem::median(r.times), wait = actmem::median(r.waits),
                   copy = actmem::median(r.copies);
      const double hidden = copy > 0 ? std::max(0.0, 1.0 - wait / copy) : 0.0;
      std::cout << std::left << std::setw(34) << r.name << std::right << std::fixed
                << std::setprecision(3) << std::setw(9) << step << std::setw(8) << step / plain
                << std::setw(12) << actmem::format_bytes(r.last.offloaded_bytes) << std::setw(12)
                << actmem::format_bytes(r.last.activation_bytes) << std::setw(11)
                << actmem::format_bytes(r.last.activation_peak_bytes) << std::setw(10) << copy
                << std::setw(10) << wait << std::setw(9) << std::setprecision(0) << 100 * hidden
                << "%\n";
      out["runs"].push_back({{"name", r.name},
                             {"step_time_s", step},
                             {"ratio", step / plain},
                             {"offloaded_bytes", r.last.offloaded_bytes},
                             {"activation_bytes", r.last.activation_bytes},
                             {"activation_peak_bytes", r.last.activation_peak_bytes},
                             {"offload_copy_s", copy},
                             {"offload_wait_s", wait},
                             {"copy_hidden_fraction", hidden}});
    }
    std::cout << "hidden = 1 - wait / copy: the share of copy time the compute did not wait for\n";
    if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  } catch (const c10::Error& e) {
    return actmem::bench::report(e);
  }
  return 0;
}
