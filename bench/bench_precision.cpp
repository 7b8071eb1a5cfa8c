// bench_precision.cpp — training quality of bf16 against fp32: the same model, data and seed
// trained --train-iters steps at each precision, validation loss at every --eval-interval.
//
// Pass: the final validation losses differ by at most --tolerance nats (exit code 1 otherwise).
// bf16 rounds parameters to 8 significant bits after every step (the fp32 main parameters keep
// the rest), so the two runs part ways bit by bit from the first step; what must hold is that
// they learn the same.
#include "actmem/base/blas.h"
#include "actmem/flags/train_options.h"
#include "actmem/train/trainer.h"
#include "bench_common.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <iomanip>
#include <iostream>

int main(int argc, char** argv) {
  actmem::set_reproducible_blas();  // as the actmem program (Note [Reproducible products])
  CLI::App app{"bench_precision: validation loss of the default model, fp32 against bf16"};
  int64_t iters = 200, eval_interval = 50;
  double tolerance = 0.05;
  int threads = 0;
  std::string json_path;
  app.add_option("--train-iters", iters, "Steps per run")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--eval-interval", eval_interval, "Validate every N steps")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--tolerance", tolerance, "Largest accepted |final val loss bf16 - fp32|, nats")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--threads", threads, "Intra-op threads (default: one per core)");
  app.add_option("--json", json_path, "Also write the results to FILE");
  CLI11_PARSE(app, argc, argv);
  actmem::bench::print_blas();
  try {
    actmem::apply_thread_count(threads);
    nlohmann::json runs;
    for (const char* precision : {"fp32", "bf16"}) {
      actmem::TransformerConfig model;  // the built-in default of `actmem train`
      model.bf16 = std::string(precision) == "bf16";
      model.attention_softmax_in_fp32 = model.bf16;
      actmem::TrainingConfig training;
      training.train_iters = iters;
      training.eval_interval = eval_interval;
      actmem::Trainer trainer(model, training);
      nlohmann::json r = {{"precision", precision},
                          {"val_loss", nlohmann::json::array()},
                          {"iteration", nlohmann::json::array()}};
      double time_s = 0.0;
      trainer.run(
          {},
          [&](const actmem::IterationStats& st) {
            time_s += st.step_time_s;
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
      runs[precision] = r;
    }
    const double a = runs["fp32"]["val_loss"].back().get<double>();
    const double b = runs["bf16"]["val_loss"].back().get<double>();
    const double diff = b - a;
    const bool pass = std::abs(diff) <= tolerance;
    std::cout << std::left << std::setw(10) << "iter" << std::setw(12) << "fp32" << std::setw(12)
              << "bf16"
              << "bf16 - fp32\n";
    for (size_t i = 0; i < runs["fp32"]["val_loss"].size(); ++i) {
      const double x = runs["fp32"]["val_loss"][i].get<double>();
      const double y = runs["bf16"]["val_loss"][i].get<double>();
      std::cout << std::left << std::setw(10) << runs["fp32"]["iteration"][i].get<int64_t>()
                << std::fixed << std::setprecision(4) << std::setw(12) << x << std::setw(12) << y
                << std::showpos << y - x << std::noshowpos << "\n";
    }
    std::cout << "final validation loss: fp32 " << a << ", bf16 " << b << " (difference "
              << std::showpos << diff << std::noshowpos << ", tolerance " << tolerance
              << "): " << (pass ? "pass" : "FAIL") << "\n"
              << "mean step time: fp32 " << std::setprecision(1)
              << runs["fp32"]["step_time_s"].get<double>() * 1e3 << " ms, bf16 "
              << runs["bf16"]["step_time_s"].get<double>() * 1e3 << " ms\n";
    nlohmann::json out = {{"runs", runs},
                          {"difference", diff},
                          {"tolerance", tolerance},
                          {"pass", pass},
                          {"blas", actmem::blas_report().to_json()}};
    if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
    return pass ? 0 : 1;
  } catch (const c10::Error& e) {
    return actmem::bench::report(e);
  }
}
