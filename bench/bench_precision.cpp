// bench_precision.cpp — training quality and cost of each precision: the same model, data and
// seed trained --train-iters steps in fp32, bf16 and FP8 (hybrid, delayed and tensorwise
// scaling: docs/fp8.md), validation loss at every --eval-interval, step time and the activation
// bytes a micro-batch keeps for the backward.
//
// Pass: bf16's final validation loss at most --tolerance nats above fp32's, and each FP8 run's at
// most --fp8-tolerance above bf16's (exit code 1 otherwise). bf16 rounds parameters to 8
// significant bits after every step (the fp32 main parameters keep the rest) and FP8 quantizes
// every GEMM's operands to 3 (or 2) mantissa bits, so the runs part ways bit by bit from the first
// step; what must hold is that they learn the same.
#include "actmem/base/blas.h"
#include "actmem/flags/train_options.h"
#include "actmem/train/plot.h"
#include "actmem/train/trainer.h"
#include "bench_common.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  actmem::set_reproducible_blas();  // as the actmem program (Note [Reproducible products])
  CLI::App app{"bench_precision: validation loss of the default model in fp32, bf16 and FP8"};
  int64_t iters = 200, eval_interval = 50;
  double tolerance = 0.05, fp8_tolerance = 0.1;
  int threads = 0;
  std::string json_path;
  app.add_option("--train-iters", iters, "Steps per run")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--eval-interval", eval_interval, "Validate every N steps")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--tolerance", tolerance,
                 "Largest accepted final val loss bf16 - fp32, nats (lower is accepted)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--fp8-tolerance", fp8_tolerance,
                 "Largest accepted final val loss FP8 - bf16, nats (lower is accepted)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--threads", threads, "Intra-op threads (default: one per core)");
  app.add_option("--json", json_path, "Also write the results to FILE");
  std::string svg_path;
  app.add_option("--svg", svg_path, "Also plot the validation-loss curves to FILE");
  CLI11_PARSE(app, argc, argv);
  actmem::bench::print_blas();
  try {
    actmem::apply_thread_count(threads);
    nlohmann::json runs;
    // FP8 runs are hybrid (E5M2 gradients): delayed scaling with Transformer Engine's default
    // window (the last amax) and with a window of 16 and its maximum, and current scaling.
    const std::vector<std::string> precisions = {"fp32", "bf16", "fp8-delayed", "fp8-delayed-max16",
                                                 "fp8-tensorwise"};
    for (const std::string& precision : precisions) {
      actmem::TransformerConfig model;  // the built-in default of `actmem train`
      actmem::bench::set_bench_precision(model, precision);
      actmem::TrainingConfig training;
      training.train_iters = iters;
      training.eval_interval = eval_interval;
      actmem::Trainer trainer(model, training);
      nlohmann::json r = {{"precision", precision},
                          {"val_loss", nlohmann::json::array()},
                          {"iteration", nlohmann::json::array()}};
      double time_s = 0.0;
      int64_t activation_bytes = 0;
      trainer.run(
          {},
          [&](const actmem::IterationStats& st) {
            time_s += st.step_time_s;
            activation_bytes = std::max(activation_bytes, st.activation_bytes);
            r["final_train_loss"] = st.loss;
            if (st.val_loss) {
              r["iteration"].push_back(st.iteration);
              r["val_loss"].push_back(*st.val_loss);
              std::cerr << precision << " iter " << st.iteration << ": val loss " << std::fixed
                        << std::setprecision(4) << *st.val_loss << "\n";
            }
          },
          /*compute_digest=*/false);
      r["step_time_s"] = time_s / static_cast<double>(iters);
      r["activation_bytes"] = activation_bytes;
      runs[precision] = r;
    }
    auto final_loss = [&](const std::string& p) {
      return runs[p]["val_loss"].back().get<double>();
    };
    const double diff = final_loss("bf16") - final_loss("fp32");
    bool pass = diff <= tolerance;  // bf16 must not learn worse than fp32
    std::cout << std::left << std::setw(10) << "iter";
    for (const auto& p : precisions) std::cout << std::setw(18) << p;
    std::cout << "\n";
    for (size_t i = 0; i < runs["fp32"]["val_loss"].size(); ++i) {
      std::cout << std::left << std::setw(10) << runs["fp32"]["iteration"][i].get<int64_t>();
      for (const auto& p : precisions) {
        std::cout << std::fixed << std::setprecision(4) << std::setw(18)
                  << runs[p]["val_loss"][i].get<double>();
      }
      std::cout << "\n";
    }
    std::cout << "\n"
              << std::setw(18) << "precision" << std::setw(14) << "final val" << std::setw(14)
              << "vs reference" << std::setw(14) << "step ms" << std::setw(14) << "step / bf16"
              << "activation bytes\n";
    nlohmann::json differences;
    for (const auto& p : precisions) {
      const std::string ref = p == "fp32" ? "fp32" : p == "bf16" ? "fp32" : "bf16";
      const double d = final_loss(p) - final_loss(ref);
      // FP8 may learn differently (delayed scaling clips what outgrows the window's amax); it
      // must not learn worse.
      if (p.rfind("fp8-", 0) == 0) pass = pass && std::isfinite(d) && d <= fp8_tolerance;
      differences[p] = d;
      const double ms = runs[p]["step_time_s"].get<double>() * 1e3;
      std::cout << std::setw(18) << p << std::setprecision(4) << std::setw(14) << final_loss(p)
                << std::showpos << std::setw(14) << d << std::noshowpos << std::setprecision(1)
                << std::setw(14) << ms << std::setprecision(2) << std::setw(14)
                << ms / (runs["bf16"]["step_time_s"].get<double>() * 1e3)
                << runs[p]["activation_bytes"].get<int64_t>() << "\n";
    }
    std::cout << "bf16 - fp32 at most " << tolerance << ", FP8 - bf16 at most " << fp8_tolerance
              << ": " << (pass ? "pass" : "FAIL") << "\n";
    nlohmann::json out = {{"runs", runs},
                          {"difference", diff},
                          {"differences", differences},
                          {"fp8_tolerance", fp8_tolerance},
                          {"tolerance", tolerance},
                          {"pass", pass},
                          {"blas", actmem::blas_report().to_json()}};
    if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
    if (!svg_path.empty()) {
      std::vector<actmem::CurveSeries> curves;
      for (const auto& p : precisions) {
        actmem::CurveSeries c{p, {}, {}};
        for (const auto& it : runs[p]["iteration"]) c.x.push_back(it.get<double>());
        for (const auto& v : runs[p]["val_loss"]) c.y.push_back(v.get<double>());
        curves.push_back(std::move(c));
      }
      std::ofstream(svg_path) << actmem::line_chart_svg(
          curves, "Validation loss of the default model by precision (bench_precision)",
          "iteration", "validation loss (nats)");
    }
    return pass ? 0 : 1;
  } catch (const c10::Error& e) {
    return actmem::bench::report(e);
  }
}
